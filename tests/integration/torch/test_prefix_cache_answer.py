"""With the defaults (not ``--batch-invariant``), the same greedy chat sent twice gives the
same answer although the second reads its prompt from the prefix cache: a step with prompt
chunks runs every row on the float path (``quant.prompt_step``), so the few tail tokens
computed after the cached blocks round as the whole prompt's did (on the integer path the
default model answered 6 of 8 such chats differently the second time). Where the float path
is the bf16 panels' GEMM (a row's sums in one order whatever the rows beside it)."""

import pytest

from adapters.torch.quant import QuantLinear
from domain.config import EngineConfig
from domain.sampling import SamplingParams
from entrypoints.inprocess import LLM

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Tell me a short story about a robot.",
    "Explain photosynthesis in two sentences.",
]


def test_a_greedy_chat_twice_gives_the_same_answer_from_the_prefix_cache() -> None:
    llm = LLM(engine=EngineConfig(max_model_len=512, max_num_seqs=4), quantization="gguf")
    model = llm._container.backend.model()
    if not any(m.panels is not None for m in model.modules() if isinstance(m, QuantLinear)):
        # the float path is then the tiles' oneDNN GEMM, whose reduction order may change
        # with the row count
        pytest.skip("no bf16 panel copies on this CPU (no AVX512-BF16 kernels, or slower)")
    tokenizer = llm.tokenizer
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=0)
    for chat in CHATS:
        prompt = tokenizer.render_chat([{"role": "user", "content": chat}])
        first, again = (llm.generate([prompt], params)[0] for _ in range(2))
        assert again.token_ids == first.token_ids, chat
        assert again.logprobs == first.logprobs, chat  # the panels' GEMM: a row's own order
