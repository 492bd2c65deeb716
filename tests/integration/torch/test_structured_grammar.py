"""The llguidance compiler over SmolLM2's tokenizer: every test schema's valid example walks
through its matcher token by token and then may end (a closed object or array: must);
invalid or unsupported constraints are InvalidParameterErrors naming response_format."""

import json
from pathlib import Path

import jsonschema
import llguidance.torch
import pytest
import torch

from adapters.grammar import LLGuidanceCompiler, RequestMatchers
from adapters.hf_tokenizer import HFTokenizer
from adapters.weights import resolve_model
from domain.errors import InvalidParameterError
from domain.sampling import StructuredOutput
from tests.structured_schemas import SCHEMAS

VOCAB = 49152


@pytest.fixture(scope="module")
def folder() -> Path:
    """The default model's folder (converted once into the user cache, then reused)."""
    return resolve_model(None, progress=False).path


@pytest.fixture(scope="module")
def tokenizer(folder: Path) -> HFTokenizer:
    return HFTokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def compiler(folder: Path, tokenizer: HFTokenizer) -> LLGuidanceCompiler:
    return LLGuidanceCompiler.from_tokenizer_json(
        folder / "tokenizer.json", VOCAB, tokenizer.eos_token_ids
    )


def allowed(bitmask: torch.Tensor) -> set[int]:
    bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()).flatten().tolist())


@pytest.mark.parametrize("case", SCHEMAS, ids=[c.name for c in SCHEMAS])
def test_each_example_is_valid_and_walks_through_its_grammar(
    case, compiler: LLGuidanceCompiler, tokenizer: HFTokenizer
) -> None:
    jsonschema.validate(case.example, case.schema)
    matcher = compiler.matcher(StructuredOutput("json_schema", json.dumps(case.schema)))
    bitmask = torch.zeros((1, VOCAB // 32), dtype=torch.int32)
    text = json.dumps(case.example)  # the layout the grammar asks for: ", " and ": "
    for token in tokenizer.encode(text, add_special_tokens=False):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
        assert token in allowed(bitmask), tokenizer.decode([token])
        assert matcher.consume_token(token)
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
    assert allowed(bitmask) & tokenizer.eos_token_ids  # it may end here
    if isinstance(case.example, dict | list):  # closed: nothing but the end may follow
        assert allowed(bitmask) <= tokenizer.eos_token_ids


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutput("json_schema", '{"type": "foo"}'),
        StructuredOutput("json_schema", '{"type": "array", "uniqueItems": true}'),
        StructuredOutput("json_schema", '{"$ref": "#/nowhere"}'),
        StructuredOutput("json_schema", '{"type": "string", "minLength": 3, "maxLength": 1}'),
        StructuredOutput("json_schema", "[1]"),
        StructuredOutput("json_schema", "{nope"),
        StructuredOutput("regex", "a(b"),
        StructuredOutput("choice", "[]"),
        StructuredOutput("grammar", "start: undefined_rule"),
        StructuredOutput("grammar", "  "),
    ],
)
def test_invalid_or_unsupported_constraints_name_response_format(
    structured: StructuredOutput, compiler: LLGuidanceCompiler
) -> None:
    with pytest.raises(InvalidParameterError) as error:
        compiler.check(structured)
    assert error.value.param == "response_format"


def test_matchers_replay_generated_tokens_and_free_on_release(
    compiler: LLGuidanceCompiler, tokenizer: HFTokenizer
) -> None:
    """A request first met with tokens already generated (recomputed after a preemption)
    continues from them; released requests hold nothing."""
    choice = StructuredOutput("choice", '["yes please", "no thanks"]')
    matchers = RequestMatchers(compiler, threads=1)
    done = tokenizer.encode("yes please", add_special_tokens=False)
    assert len(done) >= 2
    bitmask = torch.zeros((2, VOCAB // 32), dtype=torch.int32)
    matchers.fill([("fresh", choice, []), ("resumed", choice, done)], bitmask)
    assert allowed(bitmask[1:]) <= tokenizer.eos_token_ids
    assert not allowed(bitmask[:1]) & tokenizer.eos_token_ids
    matchers.advance("fresh", done[0])
    matchers.advance("unknown", 5)  # a request without a grammar: ignored
    matchers.fill([("fresh", choice, [])], bitmask[:1])
    assert done[1] in allowed(bitmask[:1])  # the first token was consumed at this fill
    assert len(matchers) == 2
    matchers.release("fresh")
    matchers.release("resumed")
    assert len(matchers) == 0
