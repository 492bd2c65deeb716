"""``--batch-invariant`` end to end on the default model (SmolLM2-135M, its GGUF's 4-bit
blocks, the engine's kernels): a greedy request alone, the same again (its prompt from the
prefix cache), among 63 others, and with prompt-lookup speculation gives the same tokens
and the same logprobs, bit for bit; seeded sampling too. vLLM's batch-invariance test
(tests/v1/generation/test_batch_invariance.py) in this engine's terms."""

import pytest

from domain.config import EngineConfig
from domain.sampling import SamplingParams
from domain.speculation import SpeculativeConfig
from entrypoints.inprocess import LLM, GenerateResult

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that reverses a string, and explain it.",
    "Tell me a story about a dragon who learns to read.",
]
OTHERS = [f"Question {i}: describe the number {i} in words." for i in range(62)]


def llm(speculative: SpeculativeConfig | None) -> LLM:
    config = EngineConfig(
        max_model_len=1024, max_num_seqs=64, batch_invariant=True, speculative_config=speculative
    )
    return LLM(engine=config, quantization="gguf")


def outputs(results: list[GenerateResult]) -> list[tuple[list[int], list[float] | None]]:
    return [(r.token_ids, r.logprobs) for r in results]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0.0, logprobs=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, seed=7, logprobs=0, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_a_request_is_the_same_whatever_shares_its_steps(params: SamplingParams) -> None:
    plain = llm(None)
    alone = outputs([plain.generate([p], params)[0] for p in PROMPTS])
    assert all(lp is not None and len(lp) == 24 for _, lp in alone)
    again = outputs([plain.generate([p], params)[0] for p in PROMPTS])  # prefix cache hits
    assert again == alone
    crowd = outputs(plain.generate(PROMPTS + OTHERS, params)[: len(PROMPTS)])
    assert crowd == alone
    drafted = llm(SpeculativeConfig(num_speculative_tokens=3))
    assert outputs([drafted.generate([p], params)[0] for p in PROMPTS]) == alone
