"""POST /v1/generate over Litestar with the fake runner and byte tokenizer."""

import json
from collections.abc import AsyncIterator

import pytest
from litestar.testing import AsyncTestClient

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from adapters.http import create_app
from application.engine.async_engine import LOOP_CRASHED, AsyncEngine
from domain.sampling import SamplingParams
from tests.fakes import fake_async_engine
from tests.support.engine_calls import add_request

MODEL = "test/fake-model"
TOKENIZER = ByteTokenizer()
REPLY = "Hello world, end of story."


def build(**config) -> tuple[AsyncEngine, FakeModelRunner]:
    runner = FakeModelRunner(script=reply_script(TOKENIZER, REPLY))
    return fake_async_engine(
        runner, tokenizer=TOKENIZER, **{"max_model_len": 256, **config}
    ), runner


@pytest.fixture
async def client() -> AsyncIterator[AsyncTestClient]:
    engine, _ = build()
    async with AsyncTestClient(app=create_app(engine, MODEL)) as client:
        yield client


def events(text: str) -> list[tuple[str, dict]]:
    parsed, kind = [], None
    for line in text.splitlines():
        if line.startswith("event:"):
            kind = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            parsed.append((kind, json.loads(line.removeprefix("data:").strip())))
    return parsed


def body(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 64, **fields}


async def test_a_valid_request_streams_tokens_then_one_done_with_usage(client) -> None:
    response = await client.post("/v1/generate", json=body())
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    stream = events(response.text)
    kinds = [k for k, _ in stream]
    assert kinds.count("done") == 1 and kinds[-1] == "done" and "token" in kinds
    assert "".join(d["token"] for k, d in stream if k == "token") == REPLY
    done = stream[-1][1]
    assert done["finish_reason"] == "eos"
    assert done["usage"] == {
        "prompt_tokens": 3,  # <bos> H i
        "completion_tokens": len(REPLY) + 1,
        "total_tokens": 3 + len(REPLY) + 1,
    }


async def test_token_id_prompts_are_accepted(client) -> None:
    response = await client.post("/v1/generate", json=body(prompt=[1, 72, 105]))
    assert events(response.text)[-1][1]["usage"]["prompt_tokens"] == 3


async def test_a_stop_string_ends_with_finish_reason_stop(client) -> None:
    response = await client.post("/v1/generate", json=body(stop=["end"]))
    stream = events(response.text)
    assert "".join(d["token"] for k, d in stream if k == "token") == "Hello world, "
    assert stream[-1][1]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        ({"prompt": ""}, 400),
        ({"prompt": []}, 400),
        ({"prompt": 12}, 400),
        ({"max_tokens": "many"}, 400),
        ({"model": "nonexistent"}, 422),
        ({"temperature": -1.0}, 422),
        ({"top_p": 0.0}, 422),
        ({"max_tokens": 0}, 422),
        ({"foo": "bar"}, 422),
        ({"prompt": "x" * 200, "max_tokens": 100}, 422),
    ],
)
async def test_bad_requests_get_the_seed_status_codes(client, fields, status) -> None:
    response = await client.post("/v1/generate", json=body(**fields))
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"]


async def test_malformed_json_is_a_400(client) -> None:
    response = await client.post(
        "/v1/generate", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400


async def test_a_full_queue_answers_503_at_once_with_retry_after_and_queues_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The engine holds max_num_seqs running + max_waiting_requests waiting requests;
    # these run for seconds (the fake runner sleeps 10 ms a step).
    engine, runner = build(max_waiting_requests=1, max_num_seqs=2)
    runner.step_latency_s = 0.01
    for name in ("a", "b", "c"):
        occupant = SamplingParams(max_tokens=200, ignore_eos=True)
        add_request(engine.engine, name, [1, 2], occupant)
    tokenized: list[str] = []
    encode = TOKENIZER.encode
    monkeypatch.setattr(
        TOKENIZER, "encode", lambda text, **kw: tokenized.append(text) or encode(text, **kw)
    )
    async with AsyncTestClient(app=create_app(engine, MODEL)) as client:
        response = await client.post("/v1/generate", json=body())
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "overloaded_error"
        assert tokenized == []  # refused before any preparation work
        assert len(engine.sink) == 0
        assert engine.engine.scheduler.room() == 0
        assert len(engine.engine.output) == 3


async def test_a_dead_engine_loop_ends_streams_with_an_error_and_fails_health() -> None:
    engine, _ = build()

    def broken_step() -> bool:
        raise RuntimeError("bug")

    async with AsyncTestClient(app=create_app(engine, MODEL)) as client:
        assert (await client.get("/health")).status_code == 200
        engine.engine.step = broken_step  # type: ignore[method-assign]
        response = await client.post("/v1/generate", json=body())
        assert events(response.text) == [("error", {"error": LOOP_CRASHED})]
        assert (await client.get("/health")).status_code == 503
