"""Stress tests over the HTTP app with the fake runner (bounded in time and count)."""

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from adapters.http import create_app
from application.engine.async_engine import AsyncEngine
from tests.fakes import fake_async_engine
from tests.support.engine_runs import wait_for
from tests.support.uvicorn_thread import running

pytestmark = pytest.mark.slow
MODEL = "test/fake-model"
TOKENIZER = ByteTokenizer()
REPLY = "x" * 40


def build(**config) -> tuple[AsyncEngine, FakeModelRunner]:
    runner = FakeModelRunner(script=reply_script(TOKENIZER, REPLY), step_latency_s=0.002)
    return fake_async_engine(
        runner, tokenizer=TOKENIZER, **{"max_model_len": 256, **config}
    ), runner


BODY = {"model": MODEL, "prompt": "go", "max_tokens": 64}


@contextmanager
def serving(engine: AsyncEngine) -> Iterator[str]:
    """A real uvicorn server on 127.0.0.1 in a thread: requests really run concurrently."""
    config = uvicorn.Config(
        create_app(engine, MODEL), host="127.0.0.1", port=0, log_level="warning"
    )
    server = uvicorn.Server(config)
    with running(server, target=server.run, start_timeout_s=10, stop_timeout_s=10) as started:
        yield started.url


async def test_requests_beyond_the_engines_capacity_get_503_and_the_rest_complete() -> None:
    capacity = 4 + 8  # max_num_seqs running + max_waiting_requests waiting
    engine, runner = build(
        batching_mode="static",
        max_waiting_requests=8,
        max_num_seqs=4,
        batch_wait_timeout=1.0,
    )
    runner.step_latency_s = 0.02  # the first batch runs ~0.8 s while the others arrive
    with serving(engine) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            responses = await asyncio.gather(
                *(client.post("/v1/generate", json=BODY) for _ in range(capacity + 10))
            )
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * capacity + [503] * 10
    assert all(r.headers["retry-after"] == "1" for r in responses if r.status_code == 503)
    done = [r for r in responses if r.status_code == 200]
    assert all("event: done" in r.text for r in done)
    assert not engine.engine.has_work() and len(engine.sink) == 0


async def test_concurrent_disconnects_do_not_deadlock_or_leak() -> None:
    engine, runner = build(max_num_seqs=8)
    with serving(engine) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            await _disconnects(client, engine, runner)


async def _disconnects(
    client: httpx.AsyncClient, engine: AsyncEngine, runner: FakeModelRunner
) -> None:

    async def full() -> str:
        response = await client.post("/v1/generate", json=BODY)
        return response.text

    async def abandoned() -> None:
        async with client.stream("POST", "/v1/generate", json=BODY) as response:
            async for _ in response.aiter_lines():
                break  # read one line, then hang up

    results = await asyncio.gather(*(full() for _ in range(4)), *(abandoned() for _ in range(4)))
    assert all(text.count("event: done") == 1 for text in results[:4])
    assert (await client.get("/health")).status_code == 200
    again = await client.post("/v1/generate", json=BODY)
    assert "event: done" in again.text
    await wait_for(lambda: not engine.engine.has_work() and not runner.live, 200, 0.01)
    assert not engine.engine.has_work() and runner.live == set() and len(engine.sink) == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": ["go", "on"]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}]}),
    ],
)
async def test_a_client_leaving_a_non_streamed_request_aborts_it(path: str, body: dict) -> None:
    """The non-streamed endpoints notice a disconnect too: the requests stop long before
    their 900 tokens (~2 s), and their slots are free."""
    engine, runner = build(max_num_seqs=4, max_model_len=1024)
    request = {"model": MODEL, "max_tokens": 900, "ignore_eos": True, **body}
    with serving(engine) as url:
        async with httpx.AsyncClient(base_url=url, timeout=0.3) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(path, json=request)
        await wait_for(lambda: not engine.engine.has_work() and not runner.live, 200, 0.01)
        assert not engine.engine.has_work() and runner.live == set() and len(engine.sink) == 0
        assert len(runner.steps) < 600  # 900 decode steps if nobody had noticed
