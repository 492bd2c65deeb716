"""Real weights: our greedy generate() equals transformers' greedy generate, token for token.

Both load the same converted folder (fp32) from the user cache, so a warm machine does not
convert again.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from adapters.hf_tokenizer import HFTokenizer
from adapters.torch.loading.loader import load_model
from adapters.torch.runtime.generate import stream_generate
from adapters.weights import resolve_model
from domain.sampling import SamplingParams

pytestmark = pytest.mark.slow
NEW_TOKENS = 32
CASES = [
    ("smollm2", "The three most important inventions of the nineteenth century were"),
    ("gemma-3-270m", "The history of the Roman Empire begins"),
]


@pytest.mark.parametrize(("spec", "prompt"), CASES)
def test_greedy_tokens_match_transformers(spec: str, prompt: str) -> None:
    resolved = resolve_model(spec, progress=False)
    tokenizer = HFTokenizer.from_folder(resolved.path)
    prompt_ids = tokenizer.encode(prompt)
    reference = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = reference.generate(
            torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False
        )
    expected = out[0, len(prompt_ids) :].tolist()

    model = load_model(resolved.path, dtype=torch.float32)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    ours = [c.token_id for c in stream_generate(model, tokenizer, prompt_ids, params)]

    assert len(expected) == NEW_TOKENS  # no early EOS: the comparison covers 32 tokens
    assert ours == expected
