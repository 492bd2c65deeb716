"""Structured outputs on the torch runner with a tiny random Llama (byte tokenizer): even
random weights produce output that parses and validates (greedy, seeded, batched); matchers
are freed when requests finish or are aborted; a preempted request resumes its grammar;
over HTTP (openai SDK) the same, and bad constraints are 400s naming their field."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch
from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.grammar import LLGuidanceCompiler, RequestMatchers
from adapters.grammar.factory import byte_grammar
from adapters.http import create_app
from adapters.torch.loading.loader import load_model
from adapters.torch.runtime.runner import TorchModelRunner
from application.engine.async_engine import AsyncEngine
from application.engine.engine import Engine
from domain.config import EngineConfig
from domain.errors import InvalidParameterError
from domain.request import RequestContext
from domain.sampling import SamplingParams, StructuredOutput
from domain.speculation import SpeculativeConfig
from tests.fakes import ListSink, ManualClock, fake_async_engine
from tests.support.engine_calls import add_request
from tests.support.tiny_models import VOCAB, save_tiny_model

TOKENIZER = ByteTokenizer()
# Schemas whose documents a random byte-level model finishes quickly (bounded strings).
RECORD = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": -5, "maximum": 99},
        "tag": {"type": "string", "maxLength": 4},
        "kind": {"enum": ["a", "bb", None]},
        "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["ok", "n", "tag", "kind", "items"],
    "additionalProperties": False,
}
CHOICE = {"anyOf": [{"const": "left"}, {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}]}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder: Path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", folder)
    return load_model(folder, dtype=torch.float32)


@pytest.fixture(scope="module")
def compiler() -> LLGuidanceCompiler:
    return byte_grammar(ByteTokenizer(), VOCAB)


def engine(
    model: Any, compiler: LLGuidanceCompiler, max_num_seqs: int = 4
) -> tuple[Engine, RequestMatchers, ListSink]:
    config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=256)
    matchers = RequestMatchers(compiler, threads=1)
    runner = TorchModelRunner(model, config, grammar=matchers)
    sink = ListSink()
    clock = ManualClock()
    return Engine(config, runner, TOKENIZER, sink, clock=clock, grammar=compiler), matchers, sink


def text(sink: ListSink, request_id: str) -> str:
    return "".join(o.text_delta for o in sink.of(request_id))


def json_params(schema: dict[str, Any], **kwargs: Any) -> SamplingParams:
    structured = StructuredOutput("json_schema", json.dumps(schema))
    return SamplingParams(structured=structured, **{"max_tokens": 200, **kwargs})


def test_random_weights_still_produce_valid_documents(model, compiler) -> None:
    e, matchers, sink = engine(model, compiler)
    cases = {
        "greedy": (RECORD, {"temperature": 0.0}),
        "seeded": (RECORD, {"temperature": 1.0, "seed": 7}),
        "hot": (CHOICE, {"temperature": 2.0, "seed": 3}),
        "free": (None, {"temperature": 1.0, "seed": 1, "max_tokens": 30}),  # unconstrained
    }
    for request_id, (schema, kwargs) in cases.items():
        params = json_params(schema, **kwargs) if schema else SamplingParams(**kwargs)
        add_request(e, request_id, "Some JSON please", params)
    while e.has_work():
        e.step()
    for request_id, (schema, _) in cases.items():
        if schema is not None:
            assert sink.of(request_id)[-1].finish_reason == "eos", text(sink, request_id)
            jsonschema.validate(json.loads(text(sink, request_id)), schema)
    assert len(matchers) == 0  # every finished request released its matcher


@pytest.mark.parametrize(
    ("structured", "check"),
    [
        (StructuredOutput("regex", "[a-c]{2,4}-[0-9]{1,3}"), lambda t: t[:1] in "abc" and "-" in t),
        (StructuredOutput("choice", '["alpha", "beta"]'), lambda t: t in ("alpha", "beta")),
        (StructuredOutput("grammar", 'start: "x" ("+" "x")* "=" /[0-9]/'), lambda t: "=" in t),
    ],
    ids=["regex", "choice", "grammar"],
)
def test_every_kind_of_constraint_holds(model, compiler, structured, check) -> None:
    e, _, sink = engine(model, compiler)
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=5, structured=structured)
    add_request(e, "r", "go", params)
    while e.has_work():
        e.step()
    assert sink.of("r")[-1].finish_reason == "eos" and check(text(sink, "r")), text(sink, "r")


def test_the_grammar_composes_with_logit_bias(model, compiler) -> None:
    """A strong bias for ``}`` is held back until the grammar allows it: any JSON object
    from a random model, made short."""
    e, _, sink = engine(model, compiler)
    close = TOKENIZER.encode("}", add_special_tokens=False)[0]
    structured = StructuredOutput("json_object")
    add_request(e, "r", "go", SamplingParams(structured=structured, logit_bias=((close, 100.0),)))
    while e.has_work():
        e.step()
    assert text(sink, "r") == "{}"


def test_a_grammar_decides_the_end_even_with_min_tokens(model, compiler) -> None:
    """A choice completes in a few tokens, before ``min_tokens``: the grammar allows only
    EOS then, and ``min_tokens`` does not mask it (else no token would be left)."""
    e, _, sink = engine(model, compiler)
    structured = StructuredOutput("choice", '["ok"]')
    params = SamplingParams(max_tokens=20, min_tokens=10, temperature=0.0, structured=structured)
    add_request(e, "r", "go", params)
    while e.has_work():
        e.step()
    assert text(sink, "r") == "ok" and sink.of("r")[-1].finish_reason == "eos"
    assert len(sink.of("r")) == 3  # "o", "k", EOS: no token drawn from an all-masked row


def test_aborting_a_request_frees_its_matcher(model, compiler) -> None:
    e, matchers, _ = engine(model, compiler)
    add_request(e, "r", "go", json_params(RECORD, temperature=0.0))
    e.step()
    e.step()
    assert len(matchers) == 1
    e.abort("r")
    e.step()  # the loop releases what ended
    assert len(matchers) == 0


def test_a_preempted_request_resumes_its_grammar(model, compiler) -> None:
    """One slot: a structured request is preempted mid-document by a higher-priority one,
    recomputed, and still ends with the document it makes alone."""
    params = json_params(RECORD, temperature=1.0, seed=11)
    alone, _, alone_sink = engine(model, compiler, max_num_seqs=1)
    add_request(alone, "low", "A document", params)
    while alone.has_work():
        alone.step()

    e, matchers, sink = engine(model, compiler, max_num_seqs=1)
    add_request(e, "low", "A document", params)
    for _ in range(8):
        e.step()
    e.clock.now += 1.0  # type: ignore[attr-defined]
    add_request(
        e,
        "high",
        "Urgent",
        json_params(CHOICE, temperature=0.0),
        context=RequestContext(priority=1),
    )
    assert e.step().preempted == ("low",)
    while e.has_work():
        e.step()
    assert text(sink, "low") == text(alone_sink, "low")
    jsonschema.validate(json.loads(text(sink, "low")), RECORD)
    jsonschema.validate(json.loads(text(sink, "high")), CHOICE)
    assert len(matchers) == 0


def test_an_invalid_constraint_is_refused_when_prepared(model, compiler) -> None:
    e, _, _ = engine(model, compiler)
    with pytest.raises(InvalidParameterError) as error:
        e.checks.prepare("hi", SamplingParams(structured=StructuredOutput("regex", "(")))
    assert error.value.param == "response_format"


@pytest.fixture(scope="module")
def client(model, compiler) -> Iterator[openai.OpenAI]:
    config = EngineConfig(max_num_seqs=4, max_model_len=256)
    runner = TorchModelRunner(model, config, grammar=RequestMatchers(compiler, threads=1))
    engine = AsyncEngine(config, runner, TOKENIZER, vocab_size=VOCAB, grammar=compiler)
    with TestClient(app=create_app(engine, "tiny")) as http:
        yield openai.OpenAI(
            base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0
        )


def test_chat_and_completions_follow_each_wire_form(client: openai.OpenAI) -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}}
    request: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "JSON"}],
        "response_format": schema_format,
        "max_tokens": 200,
    }
    chat = client.chat.completions.create(**request, seed=1)
    jsonschema.validate(json.loads(chat.choices[0].message.content or ""), RECORD)
    stream = client.chat.completions.create(**request, seed=2, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(streamed), RECORD)
    for extra in (
        {"guided_choice": ["up", "down"]},
        {"structured_outputs": {"choice": ["up", "down"]}},
    ):
        done = client.completions.create(model="tiny", prompt="go", max_tokens=20, extra_body=extra)
        assert done.choices[0].text in ("up", "down")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "start: missing"}}, "structured_outputs"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),
    ],
)
def test_bad_constraints_are_400s_naming_their_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="go", max_tokens=5, extra_body=extra)
    assert error.value.body["param"] == param  # type: ignore[index]


def test_a_server_without_a_grammar_backend_refuses_structured_requests() -> None:
    with TestClient(app=create_app(fake_async_engine(), "fake")) as http:
        reply = http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_object"},
            },
        )
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "response_format"


def test_drafts_under_a_grammar_keep_the_output_and_its_validity(model, compiler) -> None:
    """Speculative drafts copied from the prompt, masked row by row by the grammar as it
    stands after the drafts before them: the same greedy document as without drafts, valid,
    and drafts the grammar forbids are never accepted."""
    example = '{"ok": true, "n": 5, "tag": "ab", "kind": "a", "items": [true, false]}'
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=4)
    # A draft model (the target itself, unconstrained): its drafts leave the grammar where
    # the constraint moves the argmax, and are rejected there.
    drafter = SpeculativeConfig(method="draft_model", model="tiny", probe_tokens=1000)
    outputs, drafts = {}, {}
    for name, speculative in (("plain", None), ("drafted", spec), ("draft model", drafter)):
        config = EngineConfig(max_num_seqs=4, max_model_len=256, speculative_config=speculative)
        matchers = RequestMatchers(compiler, threads=1)
        runner = TorchModelRunner(model, config, grammar=matchers)
        draft = TorchModelRunner(model, config) if name == "draft model" else None
        sink, seen = ListSink(), []
        e = Engine(
            config, runner, TOKENIZER, sink, grammar=compiler, observer=_Steps(seen), draft=draft
        )
        params = json_params(RECORD, temperature=0.0, max_tokens=150)
        add_request(e, "r", f"Like this: {example}", params)
        while e.has_work():
            e.step()
        outputs[name], drafts[name] = text(sink, "r"), seen
        jsonschema.validate(json.loads(outputs[name]), RECORD)
        assert len(matchers) == 0
    assert outputs["drafted"] == outputs["draft model"] == outputs["plain"]
    for name in ("drafted", "draft model"):
        drafted = sum(s.drafted_tokens for s in drafts[name])
        accepted = sum(s.accepted_tokens for s in drafts[name])
        assert 0 < accepted < drafted, (name, accepted, drafted)


class _Steps:
    def __init__(self, seen: list[Any]) -> None:
        self.seen = seen

    def on_step(self, stats: Any) -> None:
        self.seen.append(stats)
