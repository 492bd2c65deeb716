"""generate() (one engine request): stop conditions, streaming deltas and UTF-8, scripted."""

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from adapters.fake import ByteTokenizer
from adapters.torch.loading.loader import load_model
from adapters.torch.models.config import ModelConfig
from adapters.torch.models.layers import PagedBatch
from adapters.torch.runtime.generate import generate, stream_generate
from domain.errors import InvalidParameterError
from domain.sampling import SamplingParams
from tests.support.tiny_models import save_tiny_model

TOKENIZER = ByteTokenizer()
EOS = next(iter(TOKENIZER.eos_token_ids))


class ScriptedModel(nn.Module):
    """Emits a fixed token script greedily: the logits put all mass on the next token."""

    def __init__(self, script: list[int]) -> None:
        super().__init__()
        self.config = ModelConfig.from_hf(
            {
                "model_type": "llama",
                "vocab_size": 259,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
                "max_position_embeddings": 512,
            }
        )
        self.embed_tokens = nn.Embedding(259, 8)
        self.script = script
        self.calls = 0

    def windows(self) -> dict[bool, int | None]:
        return {False: None}

    def forward_mixed(self, input_ids: Tensor, batch: PagedBatch, sample_rows: Tensor) -> Tensor:
        assert sample_rows.shape == (1,)  # one request, one sampled row a step
        logits = torch.zeros(1, 259)
        logits[0, self.script[self.calls]] = 10.0
        self.calls += 1
        return logits


def script_of(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def run(text: str, **params) -> list:
    model = ScriptedModel([*script_of(text), EOS])
    prompt = TOKENIZER.encode("prompt")
    sampling = SamplingParams(temperature=0.0, **params)
    return list(stream_generate(model, TOKENIZER, prompt, sampling))  # type: ignore[arg-type]


def test_stops_at_eos_without_emitting_it() -> None:
    chunks = run("Hello")
    assert "".join(c.text for c in chunks) == "Hello"
    assert chunks[-1].finish_reason == "eos" and chunks[-1].token_id == EOS
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_stops_at_max_tokens() -> None:
    chunks = run("Hello world", max_tokens=4)
    assert len(chunks) == 4
    assert "".join(c.text for c in chunks) == "Hell"
    assert chunks[-1].finish_reason == "length"


def test_a_stop_string_spanning_tokens_ends_generation_and_is_not_emitted() -> None:
    chunks = run("Answer: 42 END more text", stop=("END",))
    assert "".join(c.text for c in chunks) == "Answer: 42 "
    assert chunks[-1].finish_reason == "stop"
    assert len(chunks) == len("Answer: 42 END")


def test_a_stop_token_id_ends_generation() -> None:
    space = script_of(" ")[0]
    chunks = run("one two", stop_token_ids=(space,))
    assert "".join(c.text for c in chunks) == "one"
    assert chunks[-1].finish_reason == "stop"


def test_streamed_deltas_never_split_a_multibyte_character() -> None:
    text = "héllo 👋🏽 世界 ok"
    chunks = run(text)
    assert "".join(c.text for c in chunks) == text
    assert all("\ufffd" not in c.text for c in chunks)
    assert len(chunks) > len(text)  # several byte tokens per character, one chunk each


def test_ignore_eos_generates_through_eos() -> None:
    model = ScriptedModel([*script_of("ab"), EOS, *script_of("cd")])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompt = TOKENIZER.encode("p")
    chunks = list(stream_generate(model, TOKENIZER, prompt, params))  # type: ignore[arg-type]
    assert [c.finish_reason for c in chunks][-1] == "length"
    assert "".join(c.text for c in chunks) == "abcd"


def test_generate_reports_text_tokens_and_reason() -> None:
    model = ScriptedModel([*script_of("fine"), EOS])
    result = generate(model, TOKENIZER, "How are you?", SamplingParams(temperature=0.0), chat=True)  # type: ignore[arg-type]
    assert (result.text, result.finish_reason) == ("fine", "eos")
    assert result.prompt_tokens == len(
        TOKENIZER.render_chat([{"role": "user", "content": "How are you?"}])
    )


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([], SamplingParams(), "prompt"),
        ([1, 999], SamplingParams(), "prompt"),
        ([1, 2], SamplingParams(max_tokens=511), "max_tokens"),
    ],
)
def test_bad_prompts_are_rejected_before_generating(prompt, params, param) -> None:
    model = ScriptedModel([EOS])
    with pytest.raises(InvalidParameterError) as error:
        next(stream_generate(model, TOKENIZER, prompt, params))  # type: ignore[arg-type]
    assert error.value.param == param
    assert model.calls == 0


def test_seeded_sampling_on_a_real_model_is_reproducible(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    first = [c.token_id for c in stream_generate(model, TOKENIZER, [1, 5, 9], params)]
    second = [c.token_id for c in stream_generate(model, TOKENIZER, [1, 5, 9], params)]
    other = SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=12, ignore_eos=True)
    third = [c.token_id for c in stream_generate(model, TOKENIZER, [1, 5, 9], other)]
    assert first == second
    assert first != third
