"""``/v1/responses`` driven by the official openai SDK's ``client.responses`` over the
scripted fake engine: the response object (string and item input, instructions, the
thinking as a reasoning item, a cut answer), the event stream (its order, the SDK's
accumulator), tools (a call out, its output back, the history rendered), ``text.format``
as the engine's constraint, refused fields, stored responses (``previous_response_id``,
GET / DELETE / cancel / input_items, per tenant, in Redis), and the request's logs,
metrics, traces and idempotency."""

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from litestar.testing import TestClient
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from adapters.fake.runner import FakeModelRunner
from adapters.http import create_app
from adapters.http.app import HttpServices, HttpSettings
from adapters.http.responses.replies import response_events
from adapters.http.responses.schemas import ResponseObject
from adapters.observability.http import ObservedApp
from adapters.observability.tracing import Tracing, TracingSettings, build_tracer_provider
from application.access.idempotency import MemoryIdempotencyStore
from application.access.keys import hash_key
from domain.request import StepOutput
from tests.fakes import AcceptingGrammar, fake_async_engine, fake_container
from tests.support.json_logs import json_log_stream
from tests.support.scripted import TOKENIZER, Replies

MODEL = "test/fake-model"
THOUGHT = "<think>\nThe user adds 2 and 2.\n</think>\n\nIt is 4."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
PARIS = '{"city": "Paris"}'
HERMES_CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>'


@pytest.fixture
def replies() -> Replies:
    return Replies()


def engine_for(replies: Replies) -> Any:
    return fake_async_engine(
        script=replies.script(), tokenizer=TOKENIZER, max_model_len=2048, grammar=AcceptingGrammar()
    )


@pytest.fixture
def http(replies: Replies) -> Iterator[TestClient]:
    app = create_app(engine_for(replies), MODEL, settings=HttpSettings(reasoning_parser="think"))
    with TestClient(app=app) as client:
        yield client


def sdk(http: TestClient, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{http.base_url}/v1", api_key=key, http_client=http, max_retries=0
    )


@pytest.fixture
def client(http: TestClient) -> openai.OpenAI:
    return sdk(http)


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.responses.create(
        model=MODEL,
        input=kwargs.pop("input", "What is 2 + 2?"),
        max_output_tokens=kwargs.pop("max_output_tokens", 256),
        **kwargs,
    )


def without_ids(data: Any) -> Any:
    """A response as data with what differs between two runs of one request left out
    (ids, times; the cached part of the input: a second run finds the prompt cached; and
    what the SDK's stream helper adds: ``parsed``, ``parsed_arguments``)."""
    if isinstance(data, dict):
        return {
            k: without_ids(v)
            for k, v in data.items()
            if k not in ("id", "call_id", "created_at", "completed_at", "cached_tokens")
            and k not in ("parsed", "parsed_arguments")
        }
    if isinstance(data, list):
        return [without_ids(v) for v in data]
    return data


# --- the response object ----------------------------------------------------------------


def test_a_string_input_answers_a_response_object(
    client: openai.OpenAI, http: TestClient, replies: Replies
) -> None:
    replies.text = "Hello there."
    response = create(client, temperature=0.5, metadata={"run": "7"}, user="u-1")
    assert response.id.startswith("resp_") and response.object == "response"
    assert (response.status, response.model, response.output_text) == (
        "completed",
        MODEL,
        "Hello there.",
    )
    [message] = response.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert (message.role, message.status) == ("assistant", "completed")
    assert [(p.type, p.text, p.annotations) for p in message.content] == [
        ("output_text", "Hello there.", [])
    ]
    usage = response.usage
    assert usage is not None and usage.output_tokens == len("Hello there.") + 1  # and EOS
    assert usage.input_tokens == len(replies.requests[-1].prompt_token_ids)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens_details.cached_tokens == 0
    # What the request asked is echoed.
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0.5, 1.0, 256)
    assert (response.metadata, response.user, response.store) == ({"run": "7"}, "u-1", True)
    assert (response.tool_choice, response.tools, response.parallel_tool_calls) == (
        "auto",
        [],
        True,
    )
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "text"
    assert replies.prompt() == "<|user|>\nWhat is 2 + 2?\n<|assistant|>\n"
    assert replies.requests[-1].sampling_params.temperature == 0.5
    # The raw body: the item as OpenAI writes it.
    raw = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 32}).json()
    assert set(raw["output"][0]) == {"type", "id", "status", "role", "content"}
    assert raw["output"][0]["content"][0] == {
        "type": "output_text",
        "text": "Hello there.",
        "annotations": [],
        "logprobs": [],
    }
    assert raw["object"] == "response" and isinstance(raw["created_at"], int)


def test_item_input_and_instructions_render_as_a_conversation(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = "Blue."
    create(
        client,
        instructions="Answer in one word.",
        input=[
            {"role": "developer", "content": "Be kind."},
            {"role": "user", "content": "Hi"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello!"}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Sky "},
                    {"type": "input_text", "text": "colour?"},
                ],
            },
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": []},  # not shown
        ],
    )
    assert replies.prompt() == (
        "<|system|>\nAnswer in one word.\n<|developer|>\nBe kind.\n<|user|>\nHi\n"
        "<|assistant|>\nHello!\n<|user|>\nSky colour?\n<|assistant|>\n"
    )


def test_the_thinking_comes_back_as_a_reasoning_item(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = THOUGHT
    response = create(client)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content or ()] == [
        ("reasoning_text", "The user adds 2 and 2.")
    ]
    assert message.type == "message" and response.output_text == "It is 4."
    usage = response.usage
    thought = "<think>\nThe user adds 2 and 2.\n</think>"
    assert usage is not None and usage.output_tokens_details.reasoning_tokens == len(thought)
    assert usage.output_tokens == len(THOUGHT) + 1


def test_reasoning_effort_none_switches_the_thinking_off(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = "4."
    create(client, reasoning={"effort": "none"})
    assert replies.prompt().endswith("<think>\n\n</think>\n\n")
    response = create(client, reasoning={"effort": "low", "summary": "auto"})
    assert not replies.prompt().endswith("</think>\n\n")
    assert response.reasoning is not None
    assert (response.reasoning.effort, response.reasoning.summary) == ("low", "auto")


def test_a_cut_answer_is_incomplete(client: openai.OpenAI, replies: Replies) -> None:
    replies.text = "A long answer that goes on."
    response = create(client, max_output_tokens=6)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "A long"
    assert response.output[-1].status == "incomplete"


# --- streaming --------------------------------------------------------------------------


def test_the_stream_sends_openais_events_in_order(client: openai.OpenAI, replies: Replies) -> None:
    replies.text = THOUGHT
    events = list(create(client, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    thinking = [e for e in events if e.type == "response.reasoning_text.delta"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    expected = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * len(thinking),
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert kinds == expected
    assert "".join(e.delta for e in thinking) == "The user adds 2 and 2."
    assert "".join(e.delta for e in deltas) == "It is 4."
    created, done = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == []
    assert created.id == done.id and done.status == "completed"
    message_events = [e for e in events if getattr(e, "output_index", None) == 1]
    assert {e.item_id for e in message_events if hasattr(e, "item_id")} == {done.output[1].id}
    assert all(e.logprobs == [] for e in deltas)


def test_the_sdks_accumulated_stream_equals_the_whole_response(
    client: openai.OpenAI, replies: Replies
) -> None:
    for text in (THOUGHT, f"Checking.\n{HERMES_CALL}", "Plain."):
        replies.text = text
        whole = create(client, tools=[WEATHER])
        with client.responses.stream(
            model=MODEL, input="What is 2 + 2?", max_output_tokens=256, tools=[WEATHER]
        ) as stream:
            for _ in stream:
                pass
            final = stream.get_final_response()
        assert without_ids(final.model_dump()) == without_ids(whole.model_dump()), text


def test_a_streamed_call_sends_its_arguments_in_pieces(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = HERMES_CALL
    events = list(create(client, stream=True, tools=[WEATHER]))
    [added] = [e for e in events if e.type == "response.output_item.added"]
    assert added.item.type == "function_call" and added.item.status == "in_progress"
    assert (added.item.name, added.item.arguments) == ("get_weather", "")
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == {"city": "Paris"} and done.item_id == added.item.id
    final = events[-1].response
    [call] = final.output
    assert (call.call_id, call.status) == (added.item.call_id, "completed")


def test_a_cut_stream_ends_incomplete(client: openai.OpenAI, replies: Replies) -> None:
    replies.text = "A long answer that goes on."
    events = list(create(client, stream=True, max_output_tokens=6))
    assert events[-1].type == "response.incomplete"
    response = events[-1].response
    assert response.incomplete_details.reason == "max_output_tokens"
    assert (response.output_text, response.output[0].status) == ("A long", "incomplete")


# --- tools ------------------------------------------------------------------------------


def test_a_tool_round_trip(client: openai.OpenAI, replies: Replies) -> None:
    replies.text = HERMES_CALL
    first = create(client, input="Weather in Paris?", tools=[WEATHER])
    [call] = first.output
    assert call.type == "function_call" and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert "<|tools|>\nget_weather" in replies.prompt()  # the tool was rendered
    echoed = first.tools[0]
    assert (echoed.type, echoed.name, echoed.strict) == ("function", "get_weather", True)

    replies.text = "It is sunny in Paris."
    second = create(
        client,
        tools=[WEATHER],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24C"},
        ],
    )
    assert second.output_text == "It is sunny in Paris."
    prompt = replies.prompt()
    # The call in the assistant's turn and its output after it, in the tool format's words.
    assert prompt.index('"name": "get_weather"') < prompt.index("sunny, 24C")
    assert prompt.index("Weather in Paris?") < prompt.index('"name": "get_weather"')


def test_required_and_named_choices_constrain_to_the_tools(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = f'[{{"name": "get_weather", "parameters": {PARIS}}}]'
    response = create(client, tools=[WEATHER], tool_choice="required")
    assert [(c.name, c.arguments) for c in response.output] == [("get_weather", PARIS)]
    schema = json.loads(replies.requests[-1].sampling_params.structured.spec)
    assert schema["type"] == "array"
    replies.text = PARIS
    choice = {"type": "function", "name": "get_weather"}
    response = create(client, tools=[WEATHER], tool_choice=choice)
    assert [(c.name, c.arguments) for c in response.output] == [("get_weather", PARIS)]
    assert response.tool_choice.name == "get_weather"


def test_text_format_reaches_the_engine_as_its_constraint(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = '{"answer": 4}'
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    text = {"format": {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}}
    response = create(client, text=text, reasoning={"effort": "none"})
    structured = replies.requests[-1].sampling_params.structured
    assert structured is not None and structured.kind == "json_schema"
    assert json.loads(structured.spec) == schema
    assert response.output_text == '{"answer": 4}'
    assert response.text.format.type == "json_schema"
    create(client, text={"format": {"type": "json_object"}})
    structured = replies.requests[-1].sampling_params.structured
    assert structured is not None and structured.kind == "json_object"
    create(client, text={"format": {"type": "text"}})
    assert replies.requests[-1].sampling_params.structured is None


# --- refusals ---------------------------------------------------------------------------


def bad_request(client: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as raised:
        create(client, **kwargs)
    body = raised.value.body
    assert isinstance(body, dict)
    return body


@pytest.mark.parametrize(
    "tool", ["web_search", "file_search", "code_interpreter", "computer_use_preview", "mcp"]
)
def test_hosted_tools_are_a_400_naming_their_type(client: openai.OpenAI, tool: str) -> None:
    error = bad_request(client, tools=[WEATHER, {"type": tool}])
    assert error["param"] == "tools[1].type"
    assert tool in error["message"] and "function tools only" in error["message"]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "oops": 1}}}, "text.format"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"temperature": 3.0}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": []}, "input"),
        ({"input": "x" * 3000}, "input"),  # longer than the context
        ({"extra_body": {"stop": ["a"] * 100}}, "stop"),
    ],
)
def test_bad_or_unsupported_fields_are_400s_naming_them(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str
) -> None:
    error = bad_request(client, **kwargs)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_harmless_fields_are_accepted(client: openai.OpenAI, replies: Replies) -> None:
    """What the openai-agents SDK and others send that changes nothing here."""
    replies.text = "ok"
    response = create(
        client,
        include=["reasoning.encrypted_content"],
        truncation="disabled",
        tools=[],
        parallel_tool_calls=True,
        service_tier="auto",
        prompt_cache_key="k",
        safety_identifier="s",
        text={"verbosity": "low"},
        extra_body={"top_k": 5, "seed": 3},
    )
    assert response.output_text == "ok"
    assert replies.requests[-1].sampling_params.top_k == 5


# --- stored responses -------------------------------------------------------------------


def test_previous_response_id_continues_the_conversation(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = "Hi Ada."
    first = create(client, input="I am Ada.", instructions="Be brief.")
    replies.text = "You are Ada."
    second = create(client, input="Who am I?", previous_response_id=first.id)
    # The first's input and output before the new input; its instructions are not inherited.
    assert replies.prompt() == (
        "<|user|>\nI am Ada.\n<|assistant|>\nHi Ada.\n<|user|>\nWho am I?\n<|assistant|>\n"
    )
    assert second.previous_response_id == first.id
    replies.text = "Still Ada."
    create(client, input="Sure?", previous_response_id=second.id)
    assert replies.prompt().count("<|user|>") == 3
    # A streamed response is stored too.
    with client.responses.stream(model=MODEL, input="Again?", previous_response_id=second.id) as s:
        streamed = s.get_final_response()
    assert client.responses.retrieve(streamed.id).output_text == "Still Ada."


def test_unknown_or_unstored_previous_ids_are_404s(client: openai.OpenAI, replies: Replies) -> None:
    replies.text = "ok"
    with pytest.raises(openai.NotFoundError) as raised:
        create(client, previous_response_id="resp_nope")
    body = raised.value.body
    assert isinstance(body, dict)
    assert (body["param"], body["code"]) == ("previous_response_id", "previous_response_not_found")
    unstored = create(client, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        create(client, previous_response_id=unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_get_delete_cancel_and_input_items(
    client: openai.OpenAI, http: TestClient, replies: Replies
) -> None:
    replies.text = "Hi."
    first = create(client, input="Hello")
    second = create(
        client, input=[{"role": "user", "content": "More"}], previous_response_id=first.id
    )
    got = client.responses.retrieve(second.id)
    assert without_ids(got.model_dump()) == without_ids(second.model_dump())
    assert got.id == second.id
    items = client.responses.input_items.list(second.id)
    # The conversation it answered, newest first: its input, the first's output and input.
    assert [i.type for i in items.data] == ["message", "message", "message"]
    assert [i.role for i in items.data] == ["user", "assistant", "user"]
    assert items.data[1].id == first.output[0].id
    assert [c.text for c in items.data[2].content] == ["Hello"]
    oldest = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert [i.id for i in oldest.data] == [items.data[2].id] and oldest.has_more
    after = client.responses.input_items.list(second.id, order="asc", after=oldest.data[0].id)
    assert [i.id for i in after.data] == [items.data[1].id, items.data[0].id]
    cancel = http.post(f"/v1/responses/{second.id}/cancel")
    assert cancel.status_code == 400 and "background" in cancel.json()["error"]["message"]
    assert http.post("/v1/responses/resp_nope/cancel").status_code == 404
    deleted = client.responses.delete(second.id)
    assert deleted is None  # the SDK returns nothing; the body:
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    raw = http.delete(f"/v1/responses/{first.id}")
    assert raw.json() == {"id": first.id, "object": "response", "deleted": True}
    assert http.delete(f"/v1/responses/{first.id}").status_code == 404


def test_a_server_without_a_store_keeps_nothing(replies: Replies) -> None:
    app = create_app(engine_for(replies), MODEL, HttpServices(responses=None))
    replies.text = "ok"
    with TestClient(app=app) as http:
        client = sdk(http)
        response = create(client)
        assert response.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response.id)


KEYS = {"alice": "sk-alice", "bob": "sk-bob"}


def keyed_client(tmp_path: Path, **config: Any) -> TestClient:
    tenants = [{"id": name, "keys": [hash_key(key)]} for name, key in KEYS.items()]
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": tenants}))
    container = fake_container(
        FakeModelRunner(script=Replies("Hi.").script()),
        cache_dir=str(tmp_path),
        api_keys_file=str(path),
        **config,
    )
    return TestClient(app=container.http_app())  # type: ignore[arg-type]


def test_stored_responses_belong_to_their_tenant(tmp_path: Path) -> None:
    with keyed_client(tmp_path) as http:
        alice, bob = sdk(http, KEYS["alice"]), sdk(http, KEYS["bob"])
        mine = alice.responses.create(model="fake", input="Hi", max_output_tokens=8)
        assert alice.responses.retrieve(mine.id).id == mine.id
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model="fake", input="Hi", previous_response_id=mine.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(mine.id)
        assert alice.responses.retrieve(mine.id).id == mine.id
        with pytest.raises(openai.AuthenticationError):
            sdk(http, "sk-nobody").responses.retrieve(mine.id)


def test_replicas_share_stored_responses_through_redis(tmp_path: Path, redis_url: str) -> None:
    one = keyed_client(tmp_path / "one", redis_url=redis_url, responses_ttl=60.0)
    two = keyed_client(tmp_path / "two", redis_url=redis_url, responses_ttl=60.0)
    with one as first, two as second:
        made = sdk(first, KEYS["alice"]).responses.create(
            model="fake", input="Hi", max_output_tokens=8
        )
        again = sdk(second, KEYS["alice"])
        assert without_ids(again.responses.retrieve(made.id).model_dump()) == without_ids(
            made.model_dump()
        )
        follow = again.responses.create(
            model="fake", input="More", previous_response_id=made.id, max_output_tokens=8
        )
        assert [i.role for i in again.responses.input_items.list(follow.id).data] == [
            "user",
            "assistant",
            "user",
        ]
        with pytest.raises(openai.NotFoundError):
            sdk(second, KEYS["bob"]).responses.retrieve(made.id)
        again.responses.delete(made.id)
        with pytest.raises(openai.NotFoundError):
            sdk(first, KEYS["alice"]).responses.retrieve(made.id)


# --- operations: logs, metrics, idempotency ----------------------------------------------


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_routes_are_counted_per_route_and_logged(tmp_path: Path) -> None:
    runner = FakeModelRunner(script=Replies("Paris.").script())
    container = fake_container(runner, cache_dir=str(tmp_path))
    with json_log_stream() as stream, TestClient(app=container.http_app()) as http:  # type: ignore[arg-type]
        made = http.post("/v1/responses", json={"input": "Capital?", "user": "u-9"})
        assert made.status_code == 200, made.text
        usage = made.json()["usage"]
        with http.stream("POST", "/v1/responses", json={"input": "Hi", "stream": True}) as s:
            assert "response.completed" in "".join(s.iter_text())
        assert http.get(f"/v1/responses/{made.json()['id']}").status_code == 200
        text = http.get("/metrics").text
    samples = _samples(text)

    def count(route: str) -> float:
        return sum(
            value
            for (name, labels), value in samples.items()
            if name == "infer:requests_total" and ("route", route) in labels
        )

    assert count("/v1/responses") == 2
    assert count("/v1/responses/{response_id}") == 1
    lines = [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
    requests = [x for x in lines if x.get("event") == "request"]
    [line, streamed] = [x for x in requests if x["method"] == "POST"]
    assert [x["route"] for x in requests if x["method"] == "GET"] == [
        "/v1/responses/{response_id}",
        "/metrics",
    ]
    assert (line["route"], line["status"], line["user"], line["stream"]) == (
        "/v1/responses",
        200,
        "u-9",
        False,
    )
    assert (line["tokens_in"], line["tokens_out"]) == (
        usage["input_tokens"],
        usage["output_tokens"],
    )
    assert streamed["stream"] is True and streamed["finish_reason"] == "eos"


def test_an_idempotent_retry_is_answered_once(replies: Replies) -> None:
    services = HttpServices(idempotency=MemoryIdempotencyStore())
    app = ObservedApp(create_app(engine_for(replies), MODEL, services))
    replies.text = "Once."
    with TestClient(app=app) as http:  # type: ignore[arg-type]
        body = {"input": "Hi", "max_output_tokens": 8}
        headers = {"Idempotency-Key": "k-1"}
        first = http.post("/v1/responses", json=body, headers=headers)
        again = http.post("/v1/responses", json=body, headers=headers)
    assert first.status_code == again.status_code == 200
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.json() == first.json()
    assert len(replies.requests) == 1


def test_a_response_is_traced_through_the_engine(replies: Replies) -> None:
    exporter = InMemorySpanExporter()
    provider = build_tracer_provider(TracingSettings(), (SimpleSpanProcessor(exporter),))
    tracing = Tracing(provider, MODEL)
    replies.text = "Traced."
    engine = fake_async_engine(script=replies.script(), tokenizer=TOKENIZER, observer=tracing)
    app = ObservedApp(create_app(engine, MODEL), tracing=tracing)
    with TestClient(app=app) as http:  # type: ignore[arg-type]
        made = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 16})
        assert made.status_code == 200, made.text
    provider.shutdown()
    spans = exporter.get_finished_spans()
    [server] = [s for s in spans if s.name == "POST /v1/responses"]
    [request] = [s for s in spans if s.name == "engine.request"]
    assert request.parent is not None and request.parent.span_id == server.context.span_id
    assert server.attributes is not None
    assert server.attributes["gen_ai.usage.output_tokens"] == made.json()["usage"]["output_tokens"]


def test_an_engine_failure_mid_stream_is_response_failed() -> None:
    async def failing() -> AsyncIterator[StepOutput]:
        yield StepOutput("r", 5, "Hi", False)
        yield StepOutput("r", None, "", True, error="the engine failed")

    async def kept(_: Any) -> None:
        raise AssertionError("a failed response is not stored")

    async def run() -> list[Any]:
        skeleton = ResponseObject(
            id="resp_1", created_at=0, model=MODEL, status="in_progress", output=[]
        )
        events = response_events(skeleton, failing(), None, None, True, kept)
        return [event async for event in events]

    events = asyncio.run(run())
    names = [type(e).__name__ for e in events]
    assert names[-4:] == ["TextDone", "PartDone", "ItemDone", "Failed"]
    failed = events[-1].response
    assert (failed.status, failed.error.code, failed.error.message) == (
        "failed",
        "server_error",
        "the engine failed",
    )
    assert failed.output[0].status == "incomplete" and failed.output[0].content[0].text == "Hi"


def test_the_deadline_ends_a_stream_with_response_failed(replies: Replies) -> None:
    replies.text = "x" * 200
    engine = fake_async_engine(script=replies.script(), tokenizer=TOKENIZER, step_latency_s=0.02)
    app = create_app(engine, MODEL, settings=HttpSettings(request_timeout=0.3))
    body = {"input": "Hi", "stream": True}
    with TestClient(app=app) as http, http.stream("POST", "/v1/responses", json=body) as s:
        text = "".join(s.iter_text())
    names = [line[len("event: ") :] for line in text.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.failed"
    last = json.loads(text.strip().splitlines()[-1][len("data: ") :])
    assert "timed out" in last["response"]["error"]["message"]


def test_usage_counts_the_input_tokens_found_in_the_prefix_cache(client: openai.OpenAI) -> None:
    question = "Tell me about Paris. " * 8
    first, again = create(client, input=question), create(client, input=question)
    assert first.usage.input_tokens_details.cached_tokens == 0
    prompt = first.usage.input_tokens
    assert again.usage.input_tokens == prompt
    assert again.usage.input_tokens_details.cached_tokens == (prompt - 1) // 16 * 16 > 0
