"""The transport around the faces: CORS, the SSE heartbeat, the request deadline and the
drain, over the fake engine (in process, mostly under a real uvicorn server)."""

import asyncio
import gc
import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from litestar.testing import TestClient

from adapters.http import HttpServices, HttpSettings, create_app
from adapters.http.ownership import Draining
from adapters.http.streaming import PING, Heartbeat, HeartbeatMiddleware
from adapters.http.uvicorn_server import END_GRACE_S, ConnectionLimits, LimitedServer, server_config
from entrypoints.config.transport import TransportSettings
from tests.fakes import fake_container
from tests.robustness.harness import MODEL, Stack, fake_stack, serving
from tests.support.uvicorn_thread import running

ORIGIN = "https://app.example.com"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
GENERATE = {"model": MODEL, "prompt": "Hi"}


def _data_lines(body: str) -> list[Any]:
    """The JSON payloads of an OpenAI-style stream (``[DONE]`` as the string)."""
    lines = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def _events(body: str) -> list[tuple[str, dict[str, Any]]]:
    """The (event, payload) pairs of a /v1/generate stream."""
    pairs, kind = [], ""
    for line in body.splitlines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            pairs.append((kind, json.loads(line[6:])))
    return pairs


# --- the collector ---------------------------------------------------------------------


def test_the_start_up_heap_is_frozen_out_of_the_collector() -> None:
    """What lives when the server starts (the model, the tokenizer, the app) moves to the
    collector's permanent generation: a full collection while serving does not walk it."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    try:
        with TestClient(app=fake_container().http_app()) as client:  # type: ignore[arg-type]
            assert gc.get_freeze_count() > 1000
            assert client.get("/v1/models").status_code == 200
    finally:
        gc.unfreeze()


# --- CORS ------------------------------------------------------------------------------


def _preflight(client: TestClient, origin: str) -> httpx.Response:
    return client.options(
        "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-request-id",
        },
    )


def test_without_allowed_origins_no_cors_headers_are_sent() -> None:
    with TestClient(app=fake_container().http_app()) as client:  # type: ignore[arg-type]
        replies = [_preflight(client, ORIGIN), client.get("/v1/models", headers={"Origin": ORIGIN})]
    for reply in replies:
        assert not [h for h in reply.headers if h.startswith("access-control-")], reply.headers


def test_a_preflight_from_an_allowed_origin_gets_the_allow_headers() -> None:
    transport = TransportSettings(allowed_origins=(ORIGIN, "http://localhost:3000"))
    with TestClient(app=fake_container(http=transport).http_app()) as client:  # type: ignore[arg-type]
        reply = _preflight(client, ORIGIN)
    assert reply.status_code == 204
    assert reply.headers["access-control-allow-origin"] == ORIGIN
    allowed = {h.strip() for h in reply.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-api-key", "x-request-id", "idempotency-key"} <= (
        allowed
    )
    assert "POST" in reply.headers["access-control-allow-methods"]


def test_a_request_from_an_allowed_origin_may_read_the_request_id_and_rate_limits() -> None:
    transport = TransportSettings(allowed_origins=(ORIGIN,))
    with TestClient(app=fake_container(http=transport).http_app()) as client:  # type: ignore[arg-type]
        reply = client.get("/v1/models", headers={"Origin": ORIGIN, "X-Request-Id": "r-1"})
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == ORIGIN
    assert reply.headers["x-request-id"] == "r-1"  # the observing middleware still runs
    exposed = {h.strip().lower() for h in reply.headers["access-control-expose-headers"].split(",")}
    assert {"x-request-id", "x-ratelimit-remaining-requests", "x-ratelimit-reset-tokens"} <= exposed


def test_a_disallowed_origin_gets_no_allow_origin() -> None:
    transport = TransportSettings(allowed_origins=(ORIGIN,))
    with TestClient(app=fake_container(http=transport).http_app()) as client:  # type: ignore[arg-type]
        preflight = _preflight(client, "https://evil.example.com")
        simple = client.get("/v1/models", headers={"Origin": "https://evil.example.com"})
    assert preflight.status_code == 400
    for reply in (preflight, simple):
        assert "access-control-allow-origin" not in reply.headers


# --- the SSE heartbeat -----------------------------------------------------------------


async def _run_heartbeat(content_type: bytes, silence_s: float) -> list[bytes | None]:
    """What a response sending two events ``silence_s`` apart puts on the wire through the
    heartbeat (0.1 s); the start message as None."""
    sent: list[bytes | None] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", content_type)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"data: 1\r\n\r\n", "more_body": True})
        await asyncio.sleep(silence_s)
        await send({"type": "http.response.body", "body": b"data: 2\r\n\r\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message.get("body"))

    await HeartbeatMiddleware(app, 0.1)({"type": "http"}, None, send)
    await asyncio.sleep(0.25)  # nothing comes after the end
    return sent


async def test_a_silent_event_stream_gets_pings_between_its_events() -> None:
    sent = await _run_heartbeat(b"text/event-stream; charset=utf-8", 0.35)
    assert sent[:2] == [None, b"data: 1\r\n\r\n"]
    assert sent[-2:] == [b"data: 2\r\n\r\n", b""]
    assert set(sent[2:-2]) == {PING} and 2 <= len(sent[2:-2]) <= 4, sent


async def test_a_stream_with_events_closer_than_the_interval_gets_no_ping() -> None:
    sent = await _run_heartbeat(b"text/event-stream", 0.03)
    assert PING not in sent


async def test_other_responses_get_no_ping() -> None:
    sent = await _run_heartbeat(b"application/json", 0.35)
    assert PING not in sent


async def test_no_ping_goes_out_while_an_event_waits_for_a_slow_client() -> None:
    sent: list[bytes] = []
    checks = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"data: 1\r\n\r\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def slow_send(message: dict[str, Any]) -> None:
        if message.get("body"):
            await asyncio.sleep(0.35)  # the socket's buffer is full
        sent.append(message.get("body", b""))

    middleware = HeartbeatMiddleware(app, 0.1)
    original = Heartbeat._check

    def counted(self: Heartbeat) -> None:
        nonlocal checks
        checks += 1
        original(self)

    Heartbeat._check = counted  # type: ignore[method-assign]
    try:
        await middleware({"type": "http"}, None, slow_send)
    finally:
        Heartbeat._check = original  # type: ignore[method-assign]
    assert PING not in sent
    assert checks <= 5  # once per interval, not a busy loop


def test_a_stream_waiting_behind_others_gets_pings_and_the_openai_sdk_reads_it() -> None:
    """One KV slot, taken by another stream: the next one waits for its first token."""
    stack = fake_stack(endless=True, step_latency_s=0.01, max_num_seqs=1)
    app = create_app(stack.engine, MODEL, settings=HttpSettings(sse_heartbeat_interval=0.05))
    busy = {**GENERATE, "max_tokens": 40}
    with serving(app) as served:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        _stream_in_background(served.url, busy)
        stack.wait_busy()
        with httpx.stream(
            "POST",
            f"{served.url}/v1/chat/completions",
            json={**CHAT, "stream": True, "max_tokens": 5},
        ) as reply:
            raw = b"".join(reply.iter_raw())
        _stream_in_background(served.url, busy)
        stack.wait_busy()
        chunks = list(client.chat.completions.create(**CHAT, max_tokens=5, stream=True))  # type: ignore[call-overload]
        _stream_in_background(served.url, busy)
        stack.wait_busy()
        with httpx.stream(
            "POST", f"{served.url}/v1/generate", json={**GENERATE, "max_tokens": 5}
        ) as reply:
            generated = b"".join(reply.iter_raw())
    assert raw.count(PING) >= 3, raw
    assert _data_lines(raw.decode())[-1] == "[DONE]"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Paris"
    assert generated.count(PING) >= 3
    assert [k for k, _ in _events(generated.decode())][-1] == "done"


def test_a_fast_stream_is_unchanged_by_the_heartbeat() -> None:
    bodies = []
    for interval in (0.0, 15.0):
        stack = fake_stack()
        settings = HttpSettings(sse_heartbeat_interval=interval)
        app = create_app(stack.engine, MODEL, settings=settings)
        with TestClient(app=app) as client:
            bodies.append(client.post("/v1/generate", json=GENERATE).content)
    assert bodies[0] == bodies[1] and b"event: done" in bodies[0]


# --- the request deadline --------------------------------------------------------------


@pytest.fixture
def slow() -> Stack:
    return fake_stack(endless=True, step_latency_s=0.02)


def test_a_reply_past_its_deadline_is_a_504_and_its_work_is_aborted(slow: Stack) -> None:
    app = create_app(slow.engine, MODEL, settings=HttpSettings(request_timeout=0.3))
    with serving(app) as served:
        start = time.monotonic()
        reply = httpx.post(f"{served.url}/v1/chat/completions", json=CHAT, timeout=10)
        took = time.monotonic() - start
        left = slow.wait_idle()
    assert reply.status_code == 504, reply.text
    assert reply.json()["error"]["type"] == "timeout"
    assert took < 2
    assert left == {}


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/generate"])
def test_a_stream_past_its_deadline_ends_with_an_error_event(slow: Stack, route: str) -> None:
    body = {**CHAT, "stream": True} if "chat" in route else GENERATE
    if route == "/v1/completions":
        body = {"model": MODEL, "prompt": ["a", "b"], "stream": True}
    app = create_app(slow.engine, MODEL, settings=HttpSettings(request_timeout=0.3))
    with serving(app) as served:
        with httpx.stream("POST", f"{served.url}{route}", json=body, timeout=10) as reply:
            text = reply.read().decode()
        left = slow.wait_idle()
    assert reply.status_code == 200
    if route == "/v1/generate":
        kind, payload = _events(text)[-1]
        assert kind == "error" and "timed out" in payload["error"]
    else:
        assert "timed out" in _data_lines(text)[-1]["error"]["message"]
    assert left == {}


def test_a_request_within_its_deadline_is_unaffected() -> None:
    stack = fake_stack()
    app = create_app(stack.engine, MODEL, settings=HttpSettings(request_timeout=5))
    with TestClient(app=app) as client:
        reply = client.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == "Paris is the capital."


# --- the drain -------------------------------------------------------------------------


@dataclass
class Drain:
    """A /v1/generate stream under way on a real server whose drain has begun."""

    stack: Stack
    draining: Draining
    server: LimitedServer
    url: str
    thread: threading.Thread  # the server's
    reader: threading.Thread  # the stream's client
    out: list[str]  # the stream's body, once it ended

    def stopped(self, timeout_s: float) -> bool:
        """Whether the server's thread ends within ``timeout_s``."""
        self.thread.join(timeout=timeout_s)
        return not self.thread.is_alive()


@contextmanager
def drain_begun(
    timeout_s: float,
    max_tokens: int,
    how: signal.Signals = signal.SIGTERM,
    checkpoints: Path | None = None,
) -> Iterator[Drain]:
    """An endless fake stack (with the toy Tinker backend where ``checkpoints`` is given)
    under :class:`LimitedServer` with a drain of ``timeout_s``; a stream of ``max_tokens``
    runs when the server handles the signal ``how``."""
    stack = fake_stack(checkpoints, endless=True, step_latency_s=0.02)
    draining = Draining()
    app = create_app(stack.engine, MODEL, HttpServices(tinker=stack.tinker, draining=draining))
    config = server_config(
        app,
        "127.0.0.1",
        0,
        ConnectionLimits(),
        log_level="warning",
        timeout_graceful_shutdown=END_GRACE_S,
    )
    server = LimitedServer(config, draining, timeout_s)
    with running(server) as started:
        reader, out = _stream_in_background(started.url, {**GENERATE, "max_tokens": max_tokens})
        stack.wait_busy()
        server.handle_exit(how, None)
        yield Drain(stack, draining, server, started.url, started.thread, reader, out)


def _stream_in_background(url: str, body: dict[str, Any]) -> tuple[threading.Thread, list[str]]:
    out: list[str] = []

    def read() -> None:
        with httpx.stream("POST", f"{url}/v1/generate", json=body, timeout=30) as reply:
            out.append(reply.read().decode())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, out


def test_draining_refuses_new_work_in_each_face_format_and_is_not_ready(tmp_path: Path) -> None:
    with drain_begun(10, max_tokens=1000, checkpoints=tmp_path) as drain:
        url = drain.url
        chat = httpx.post(f"{url}/v1/chat/completions", json=CHAT)
        generate = httpx.post(f"{url}/v1/generate", json=GENERATE)
        tinker = httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-1"})
        health, ready = httpx.get(f"{url}/health"), httpx.get(f"{url}/ready")
        assert drain.server.started and drain.reader.is_alive()  # the stream still runs
        drain.server.servers[0].get_loop().call_soon_threadsafe(drain.draining.end_all)
        drain.reader.join(timeout=10)
    for reply in (chat, generate, tinker):
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1", reply.text
    assert chat.json()["error"]["type"] == "server_error"
    assert generate.json()["error"]["message"].startswith("the server is shutting down")
    assert tinker.json()["category"] == "server" and "detail" in tinker.json()
    assert health.status_code == 200
    assert (ready.status_code, ready.json()) == (503, {"ready": False})


def test_a_stream_that_fits_in_the_drain_timeout_completes_then_the_server_stops() -> None:
    with drain_begun(10, max_tokens=30) as drain:
        drain.reader.join(timeout=10)
        stopped = drain.stopped(5)
    events = _events(drain.out[0])
    assert events[-1][0] == "done" and len(events) == 31
    assert stopped


def test_a_stream_past_the_drain_timeout_gets_an_error_event_and_is_aborted() -> None:
    with drain_begun(0.3, max_tokens=1000) as drain:
        drain.reader.join(timeout=10)
        left = drain.stack.wait_idle()
        stopped = drain.stopped(10)
    kind, payload = _events(drain.out[0])[-1]
    assert kind == "error" and "shutting down" in payload["error"]
    assert left == {}
    assert stopped


def test_a_second_signal_ends_the_drain_at_once() -> None:
    with drain_begun(30, max_tokens=1000, how=signal.SIGINT) as drain:
        time.sleep(0.3)
        assert drain.reader.is_alive()
        drain.server.handle_exit(signal.SIGINT, None)
        drain.reader.join(timeout=5)
        stopped = drain.stopped(5)
    assert _events(drain.out[0])[-1][0] == "error"
    assert stopped and not drain.server.force_exit
