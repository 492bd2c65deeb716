"""The accuracy gate of issue 16 on the real default model (SmolLM2-135M-Instruct): each
quantization against the unquantized model on 150 fixed prompts (benchmarks/data), teacher
forced, and greedy answers that stay sensible.

The reference computes in float32: bf16 itself agrees with float32 on 97.7% of these
positions (KL 0.0023), so a bf16 reference would blur the gate, and float32 is the fast
dtype on CPUs without AVX512-BF16."""

from pathlib import Path

import pytest
import torch

from adapters.hf_tokenizer.tokenizer import HFTokenizer
from adapters.torch.loading.loader import load_model
from adapters.torch.quant import agreement, has_gguf_blocks
from adapters.torch.runtime.generate import generate
from adapters.weights.packaged import resolve_smollm2
from domain.sampling import SamplingParams

pytestmark = pytest.mark.slow
PROMPTS = Path(__file__).parents[3] / "benchmarks" / "data" / "accuracy_prompts.txt"
# issue 16's gate: top-1 next-token agreement with the unquantized model at least this
MIN_TOP1 = {"int8": 0.97, "int4": 0.90, "gguf": 0.90}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_smollm2(tmp_path_factory.mktemp("cache"), progress=False).path


@pytest.fixture(scope="module")
def tokenizer(folder: Path) -> HFTokenizer:
    return HFTokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def reference(folder: Path) -> torch.nn.Module:
    return load_model(folder, dtype=torch.float32, prepack=False)


def _prompts(tokenizer: HFTokenizer) -> list[list[int]]:
    lines = PROMPTS.read_text().splitlines()
    assert len(lines) == 150
    return [tokenizer.encode(line.replace("\\n", "\n")) for line in lines]


@pytest.mark.parametrize("method", ["int8", "int4", "gguf"])
def test_quantized_agrees_with_bf16(
    method: str, folder: Path, tokenizer: HFTokenizer, reference: torch.nn.Module
) -> None:
    if method == "gguf" and not has_gguf_blocks(folder):
        pytest.fail("the default model's conversion kept no GGUF blocks")
    model = load_model(folder, dtype=torch.float32, quantization=method)
    result = agreement(reference, model, _prompts(tokenizer))
    print(f"\n{method}: {result}")
    assert result.positions > 1000
    assert result.top1 >= MIN_TOP1[method], result
    assert result.mean_kl < 0.05, result
    answer = generate(
        model,
        tokenizer,
        tokenizer.render_chat([{"role": "user", "content": "What is the capital of France?"}]),
        SamplingParams(max_tokens=32, temperature=0.0),
    )
    assert "Paris" in answer.text, answer.text
