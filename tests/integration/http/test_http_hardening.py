"""Issue 11 on the OpenAI endpoints and /v1/generate: work owned by the HTTP request that
queued it, malformed bodies, request limits, a responsive event loop while a request is
prepared, special tokens in chat content, and the smaller fixes (seed, logprobs, tools,
error params, Retry-After).

Ownership is checked at the ASGI level (a client that leaves right after sending: the
receive channel reports the disconnect at once, before the response's stream starts) with
the engine loop stopped, so a request left behind stays queued and is seen; and against a
real server whose clients reset their connections.
"""

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from litestar import Litestar
from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from adapters.http import create_app
from domain.sampling import SamplingParams
from tests.fakes import fake_async_engine
from tests.support.asgi import leave_right_after_sending
from tests.support.engine_calls import add_request
from tests.support.engine_leftovers import EngineLeftovers
from tests.support.uvicorn_thread import running

MODEL = "test/fake-model"
TOKENIZER = ByteTokenizer()
CHAT = [{"role": "user", "content": "hi"}]
PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/generate"]


class Stack(EngineLeftovers):
    """The app over the fake runner; ``endless``: every request runs to ``max_tokens``."""

    def __init__(self, *, endless: bool = True, step_latency_s: float = 0.0, **config: Any):
        self.tokenizer = tokenizer = config.pop("tokenizer", TOKENIZER)
        self.runner = FakeModelRunner(
            script=reply_script(tokenizer, "Paris is the capital.", then_eos=not endless),
            step_latency_s=step_latency_s,
        )
        self.engine = fake_async_engine(
            self.runner, tokenizer=tokenizer, **{"max_model_len": 2048, **config}
        )
        self.core, self.sink = self.engine.engine, self.engine.sink
        self.app: Litestar = create_app(self.engine, MODEL)

    def occupy(self, count: int) -> None:
        """``count`` requests that run for a long time."""
        for i in range(count):
            params = SamplingParams(max_tokens=1500, ignore_eos=True)
            add_request(self.core, f"occupant-{i}", [5], params)


def body_for(path: str, **fields: Any) -> dict[str, Any]:
    slot = {"messages": CHAT} if path == "/v1/chat/completions" else {"prompt": "hi"}
    return {"model": MODEL, "max_tokens": 600, **slot, **fields}


def status_of(sent: list[Any]) -> int:
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


# --- ghost requests (item 1) -------------------------------------------------------------


CASES = {
    "completions": ("/v1/completions", {"prompt": "hi"}),
    "completions-stream": ("/v1/completions", {"prompt": "hi", "stream": True}),
    "completions-9-prompts": ("/v1/completions", {"prompt": [f"p{i}" for i in range(9)]}),
    "completions-9-prompts-stream": (
        "/v1/completions",
        {"prompt": [f"p{i}" for i in range(9)], "stream": True},
    ),
    "chat": ("/v1/chat/completions", {"messages": CHAT}),
    "chat-stream": ("/v1/chat/completions", {"messages": CHAT, "stream": True}),
    "generate": ("/v1/generate", {"prompt": "hi"}),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_client_leaving_right_after_sending_leaves_nothing_queued(case: str) -> None:
    """The stream was never read (a generator never started cleans nothing up): the HTTP
    request's end aborts what it queued. The engine loop is not running: anything left
    would stay queued."""
    stack = Stack(max_num_seqs=4, max_waiting_requests=8)
    path, fields = CASES[case]
    body = json.dumps({"model": MODEL, "max_tokens": 600, **fields}).encode()
    sent = await leave_right_after_sending(stack.app, path, body)
    assert status_of(sent) in (200, 499)
    assert stack.leftovers() == {}
    assert stack.core.scheduler.room() == 12


@pytest.mark.parametrize("stream", [False, True])
def test_prompts_that_do_not_all_fit_now_get_429_and_none_is_queued(stream: bool) -> None:
    """Nine prompts with four places left: the issue's 503 left eight of them running (a
    full queue is a 429 queue_full on the OpenAI face)."""
    stack = Stack(step_latency_s=0.01, max_num_seqs=4, max_waiting_requests=8)
    stack.occupy(8)
    with TestClient(stack.app) as http:
        prompts = [f"p{i}" for i in range(9)]
        response = http.post("/v1/completions", json=body_for("", prompt=prompts, stream=stream))
        assert response.status_code == 429, response.text
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "queue_full"
        assert sorted(stack.core.output) == [f"occupant-{i}" for i in range(8)]
        assert len(stack.sink) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_prompts_that_fit_the_engine_run_together(stream: bool) -> None:
    """Nine prompts for four running places and eight waiting ones: all run."""
    stack = Stack(endless=False, max_num_seqs=4, max_waiting_requests=8)
    with TestClient(stack.app) as http:
        prompts = [f"p{i}" for i in range(9)]
        body = body_for("", prompt=prompts, stream=stream, max_tokens=5)
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        if not stream:
            assert len(response.json()["choices"]) == 9
        assert stack.wait_idle() == {}  # while the loop runs: it releases the last slots


@pytest.mark.parametrize(
    ("prompt", "config"),
    [
        ([f"p{i}" for i in range(13)], {}),  # more than 4 running + 8 waiting
        ([f"p{i}" for i in range(3)], {"max_prompts_per_request": 2}),
    ],
)
def test_prompts_that_can_never_fit_are_a_400(prompt: list[str], config: dict) -> None:
    stack = Stack(max_num_seqs=4, max_waiting_requests=8, **config)
    with TestClient(stack.app) as http:
        response = http.post("/v1/completions", json=body_for("", prompt=prompt))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt"
        assert "fit" in response.json()["error"]["message"]
    assert stack.leftovers() == {}


@pytest.mark.parametrize("prompt", [[[1, 2, 3], [-1]], [[1, 2, 3], [10**9]], ["ok", ""]])
@pytest.mark.parametrize("stream", [False, True])
def test_one_bad_prompt_of_several_queues_none(prompt: list[Any], stream: bool) -> None:
    stack = Stack(max_num_seqs=4, max_waiting_requests=8)
    stack.engine.start = lambda: None  # type: ignore[method-assign]  # nothing runs
    with TestClient(stack.app) as http:
        response = http.post("/v1/completions", json=body_for("", prompt=prompt, stream=stream))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt"
    assert stack.leftovers() == {}


@contextmanager
def serving(app: Litestar) -> Iterator[str]:
    """``app`` under a real uvicorn server on 127.0.0.1; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    with running(server) as started:
        yield started.url


def raw_post(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


@pytest.mark.parametrize(
    ("path", "stream"),
    [(path, stream) for path in PATHS[:2] for stream in (True, False)] + [(PATHS[2], True)],
)
def test_clients_resetting_right_after_sending_leave_nothing_running(
    path: str, stream: bool
) -> None:
    """The issue's repro: 8 clients send and reset at once; every request they started is
    aborted (each asks for 1,500 tokens: 15 s of steps, far beyond the wait)."""
    stack = Stack(step_latency_s=0.01, max_num_seqs=4, max_waiting_requests=8)
    with serving(stack.app) as url:
        port = int(url.rsplit(":", 1)[1])
        request = raw_post(path, body_for(path, max_tokens=1500, stream=stream))
        sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
        for sock in sockets:
            sock.sendall(request)
        for sock in sockets:  # SO_LINGER 0: close with a TCP reset
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        assert stack.wait_idle() == {}
        assert stack.core.scheduler.room() == 12


# --- malformed bodies (item 3) -----------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_invalid_utf8_in_a_json_body_is_a_400_without_exception_text(path: str) -> None:
    stack = Stack()
    raw = json.dumps(body_for(path)).replace("hi", "h\udcffi", 1)
    body = raw.encode("utf-8", "surrogateescape")  # a lone 0xff byte inside a string
    with TestClient(stack.app) as http:
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == "malformed JSON: invalid UTF-8"
    assert stack.leftovers() == {}


@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
@pytest.mark.parametrize("path", PATHS)
def test_a_json_body_sent_as_form_data_is_refused(path: str, content_type: str) -> None:
    stack = Stack()
    with TestClient(stack.app) as http:
        body = json.dumps(body_for(path, max_tokens=2))
        response = http.post(path, content=body, headers={"content-type": content_type})
        assert response.status_code == 400, response.text
        assert "application/json" in response.json()["error"]["message"]
        ok = http.post(path, content=body, headers={"content-type": "application/json"})
        assert ok.status_code == 200
        assert stack.wait_idle() == {}


# --- request limits and a responsive event loop (item 4) ---------------------------------


LIMITS = {"max_prompt_bytes": 100, "max_stop_strings": 2, "max_stop_bytes": 10}
COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (COMPLETIONS, {"prompt": "x" * 101}, "prompt"),
        (COMPLETIONS, {"prompt": ["ok", "é" * 51]}, "prompt"),  # 102 bytes, 51 characters
        (CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "x" * 60}] * 2}, "messages"),
        *[
            (path, fields, param)
            for path in (COMPLETIONS, CHAT_COMPLETIONS)
            for fields, param in [
                ({"stop": ["a", "b", "c"]}, "stop"),
                ({"stop": ["abcdef", "ghijk"]}, "stop"),  # 11 bytes
                ({"stop_token_ids": [5, 6, 7]}, "stop_token_ids"),
            ]
        ],
    ],
)
def test_limits_are_400s_naming_the_field(path: str, fields: dict, param: str) -> None:
    stack = Stack(**LIMITS)
    with TestClient(stack.app) as http:
        response = http.post(path, json={**body_for(path), **fields})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert stack.leftovers() == {}


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"prompt": "x" * 101}, "prompt"), ({"stop": ["a", "b", "c"]}, "stop")],
)
def test_limits_on_generate_are_422s_as_other_invalid_values(fields: dict, param: str) -> None:
    stack = Stack(**LIMITS)
    with TestClient(stack.app) as http:
        response = http.post("/v1/generate", json={**body_for("/v1/generate"), **fields})
        assert response.status_code == 422, response.text
        assert response.json()["error"]["param"] == param


class GatedTokenizer(ByteTokenizer):
    """Tokenizing a text with BIG in it waits until ``release`` (5 s at most): a long
    tokenization. Nothing else on its thread can run meanwhile."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        if "BIG" in text:
            self.started.set()
            self.release.wait(timeout=5)
        return super().encode(text, **kwargs)


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/completions", {"prompt": "BIG"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "BIG"}]}),
        ("/v1/generate", {"prompt": "BIG"}),
    ],
)
def test_other_streams_keep_getting_tokens_while_a_request_is_prepared(
    path: str, fields: dict
) -> None:
    """While one request's prompt is tokenized (or its chat rendered), a running stream
    receives tokens: preparation is off the event loop."""
    tokenizer = GatedTokenizer()
    stack = Stack(step_latency_s=0.002, tokenizer=tokenizer)
    tokens: list[int] = []
    done = threading.Event()

    def read_stream(url: str) -> None:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1500}
        with httpx.stream("POST", f"{url}/v1/generate", json=body, timeout=10) as response:
            for line in response.iter_lines():
                if line.startswith("event: token"):
                    tokens.append(1)
                if done.is_set():
                    return

    with serving(stack.app) as url:
        reader = threading.Thread(target=read_stream, args=(url,), daemon=True)
        reader.start()
        big = threading.Thread(
            target=lambda: httpx.post(
                f"{url}{path}", json={**body_for(path), **fields, "max_tokens": 1}, timeout=10
            ),
            daemon=True,
        )
        try:
            deadline = time.monotonic() + 5
            while not tokens and time.monotonic() < deadline:
                time.sleep(0.01)
            big.start()
            assert tokenizer.started.wait(timeout=5)
            before = len(tokens)
            deadline = time.monotonic() + 3
            while len(tokens) < before + 20 and time.monotonic() < deadline:
                time.sleep(0.01)
            progressed = len(tokens) - before
            still_preparing = not tokenizer.release.is_set()
        finally:
            tokenizer.release.set()
            done.set()
            big.join(timeout=10)
            reader.join(timeout=10)
        left = stack.wait_idle()
    assert still_preparing and progressed >= 20, progressed
    assert left == {}


# --- special tokens in chat content (item 7) ---------------------------------------------


@pytest.mark.parametrize(("trust", "prompt_tokens"), [(False, 5), (True, 1)])
def test_special_token_text_in_a_chat_message_is_plain_text_unless_trusted(
    trust: bool, prompt_tokens: int
) -> None:
    """``<eos>`` is the byte tokenizer's end-of-turn token: five bytes of text in a message
    (as ``<xyz>`` is), one control token only when the server trusts chat content."""

    def prompt_tokens_of(http: TestClient, content: str) -> int:
        body = body_for("/v1/chat/completions", messages=[{"role": "user", "content": content}])
        response = http.post("/v1/chat/completions", json={**body, "max_tokens": 1})
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens"])

    stack = Stack(trust_chat_special_tokens=trust)
    with TestClient(stack.app) as http:
        plain = prompt_tokens_of(http, "<xyz>")
        assert prompt_tokens_of(http, "<eos>") == plain - 5 + prompt_tokens


# --- smaller ones (item 8) ---------------------------------------------------------------


@pytest.mark.parametrize("seed", [-1, -(2**63)])
@pytest.mark.parametrize("path", PATHS)
def test_a_negative_seed_is_accepted(path: str, seed: int) -> None:
    with TestClient(Stack(endless=False).app) as http:
        response = http.post(path, json=body_for(path, seed=seed, max_tokens=3))
        assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"logprobs": 6}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),  # fewer candidates than n
        ("/v1/completions", {"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ("/v1/completions", {"seed": 2**63}, "seed"),
        ("/v1/completions", {"max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"stop": [1]}, "stop[0]"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 0}, "top_logprobs"),
        ("/v1/chat/completions", {"n": 17}, "n"),
        ("/v1/chat/completions", {"tools": []}, "tools"),
        ("/v1/chat/completions", {"functions": []}, "functions"),
        ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
        ("/v1/chat/completions", {"tool_choice": "none", "tools": []}, "tools"),
        ("/v1/chat/completions", {"parallel_tool_calls": True}, "parallel_tool_calls"),
        ("/v1/chat/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 1}]}, "messages"),
        ("/v1/generate", {"max_tokens": "many"}, "max_tokens"),
    ],
)
def test_refused_fields_are_named_in_param(path: str, fields: dict, param: str) -> None:
    stack = Stack()
    with TestClient(stack.app) as http:
        response = http.post(path, json={**body_for(path), **fields})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    assert stack.leftovers() == {}


def test_a_full_engine_answers_at_once_with_retry_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stack = Stack(step_latency_s=0.01, max_num_seqs=1, max_waiting_requests=1)
    stack.occupy(2)
    monkeypatch.setattr(stack.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    monkeypatch.setattr(stack.tokenizer, "render_chat", lambda *a, **k: pytest.fail("rendered"))
    with TestClient(stack.app) as http:
        for path in PATHS:
            response = http.post(path, json=body_for(path))
            # 429 queue_full on the OpenAI face, 503 on /v1/generate.
            assert response.status_code == (503 if path == "/v1/generate" else 429), response.text
            assert response.headers["retry-after"] == "1"
