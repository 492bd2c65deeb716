"""Connection abuse against a real uvicorn server (``adapters.http.uvicorn_server``) on the
fake model: slow or partial headers and bodies, idle floods, every connection busy,
malformed HTTP, an open-files limit smaller than the flood. Bounded: short timeouts, a few
dozen sockets."""

import asyncio
import contextlib
import itertools
import logging
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.http.uvicorn_server import (
    AcceptErrorLog,
    ConnectionLimits,
    FoldedLog,
    connection_cap,
    raise_open_files_limit,
)
from entrypoints import cli
from entrypoints.config.connection import connection_limits
from tests.robustness.harness import (
    MODEL,
    Served,
    Stack,
    fake_stack,
    json_body,
    read_until_closed,
    serving,
    status_of,
)

SHORT = ConnectionLimits(
    max_connections=8, header_timeout=0.5, body_timeout=0.5, timeout_keep_alive=1
)
# Far more than SHORT's timeouts: a connection still open then was never going to close.
PATIENCE_S = 8.0
COMPLETION = b'{"model": "%s", "prompt": "hi", "max_tokens": 4}' % MODEL.encode()


@pytest.fixture
def stack() -> Stack:
    return fake_stack()


@pytest.fixture
def served(stack: Stack) -> Iterator[Served]:
    with serving(stack.app(), SHORT) as served:
        yield served


def assert_openai_error(raw: bytes, status: int, kind: str) -> None:
    assert status_of(raw) == status, raw[:200]
    assert b"connection: close" in raw.lower()
    error = json_body(raw)["error"]
    assert error["type"] == kind and error["message"]


def drip(sock: socket.socket, drop: bytes) -> tuple[bytes, float]:
    """Send ``drop`` every 0.1 s until the server answers (what it sent) or closes (b""),
    for ``PATIENCE_S`` at most; and when the drip began."""
    sock.settimeout(0.1)
    start, data = time.monotonic(), b""
    while time.monotonic() - start < PATIENCE_S:
        try:
            sock.sendall(drop)
            data = sock.recv(65536)
            break
        except TimeoutError:
            continue
        except ConnectionError:
            break
    return data, start


# --- read deadlines -----------------------------------------------------------------------


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(
    served: Served,
) -> None:
    with served.connect() as sock:
        data, took = read_until_closed(sock, PATIENCE_S)
    assert data == b"" and took < PATIENCE_S


def test_slowloris_headers_get_408_at_the_header_deadline_however_steady_the_drip(
    served: Served,
) -> None:
    with served.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        data, start = drip(sock, b"X-Drip: 1\r\n")  # a header line every 0.1 s
    assert_openai_error(data, 408, "timeout_error")
    assert time.monotonic() - start < PATIENCE_S


@pytest.mark.parametrize(
    "head",
    [
        b"Content-Length: 500\r\n\r\n" + COMPLETION[:10],
        b"Transfer-Encoding: chunked\r\n\r\n" + b"a\r\n" + COMPLETION[:10] + b"\r\n",
        b"Transfer-Encoding: chunked\r\n\r\n",
    ],
    ids=["partial-body", "incomplete-chunked-body", "chunked-no-chunk"],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/generate"])
def test_a_body_that_never_completes_gets_408_at_the_body_deadline(
    served: Served, stack: Stack, path: str, head: bytes
) -> None:
    with served.connect() as sock:
        request = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(request.encode() + head)
        data, took = read_until_closed(sock, PATIENCE_S)
    assert_openai_error(data, 408, "timeout_error")
    assert took < PATIENCE_S
    assert stack.wait_idle() == {}


def test_the_body_deadline_does_not_cut_a_request_that_completes_in_time(served: Served) -> None:
    with served.connect() as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(COMPLETION) + COMPLETION[:5])
        time.sleep(0.2)
        sock.sendall(COMPLETION[5:])
        data, _ = read_until_closed(sock, 2.0)
    assert status_of(data) == 200, data[:300]


# A body that stops arriving: answered at the read timeout, long before the total one.
STALL = ConnectionLimits(header_timeout=5, body_timeout=30, body_read_timeout=0.5)
# The faces, each with a request it takes and how its error body reads.
FACES = {
    "completions": ("/v1/completions", COMPLETION),
    "chat": (
        "/v1/chat/completions",
        b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}' % MODEL.encode(),
    ),
    "generate": ("/v1/generate", b'{"prompt": "hi", "max_tokens": 4}'),
    "tinker": ("/api/v1/create_session", b'{"tags": [], "user_metadata": {}}'),
}


def _post(path: str, framing: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "X-API-Key: tml-stall\r\n"
    ).encode() + framing


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def assert_face_error(raw: bytes, path: str, status: int) -> dict[str, Any]:
    """A ``status`` closing the connection, in the error format of ``path``'s face."""
    assert status_of(raw) == status, raw[:300]
    assert b"connection: close" in raw.lower()
    body = json_body(raw)
    if path.startswith("/api/"):  # Tinker's
        assert body["category"] == "user" and body["detail"] == body["error"], body
        return {"message": body["detail"]}
    error = body["error"]  # OpenAI's (the native /v1/generate face's too)
    assert error["type"] == "timeout_error" and set(error) == {"message", "type", "param", "code"}
    return dict(error)


@pytest.fixture
def stalling(tmp_path: Path) -> Iterator[tuple[Served, Stack]]:
    stack = fake_stack(tmp_path)  # with the Tinker face
    with serving(stack.app(), STALL) as served:
        yield served, stack


@pytest.mark.parametrize("cut", ["short-content-length", "chunked-without-last-chunk"])
@pytest.mark.parametrize("face", list(FACES))
def test_a_body_that_stops_arriving_gets_408_in_its_face_format_at_the_read_timeout(
    stalling: tuple[Served, Stack], face: str, cut: str
) -> None:
    """The issue: Content-Length 1000 and fewer bytes, or a chunked body cut short, the
    socket left open, got no answer for 15 s and more (the total --body-timeout, 60 s)."""
    served, stack = stalling
    path, body = FACES[face]
    if cut == "short-content-length":
        framing = b"Content-Length: 1000\r\n\r\n" + body
    else:
        framing = b"Transfer-Encoding: chunked\r\n\r\n" + _chunk(body[:10]) + _chunk(body[10:])
    with served.connect() as sock:
        sock.sendall(_post(path, framing))
        data, took = read_until_closed(sock, PATIENCE_S)
    error = assert_face_error(data, path, 408)
    assert "no bytes for 0.5 s" in error["message"]
    assert 0.4 < took < 3.0, took  # the read timeout, nowhere near the total 30 s
    assert stack.wait_idle() == {}


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_slow_but_steady_upload_outlasting_the_read_timeout_succeeds(
    stalling: tuple[Served, Stack], chunked: bool
) -> None:
    """A piece every 0.15 s (under the 0.5 s read timeout) for 1.8 s (over three of them)."""
    served, _ = stalling
    cuts = [len(COMPLETION) * i // 12 for i in range(13)]
    pieces = [COMPLETION[a:b] for a, b in itertools.pairwise(cuts)]
    framing = (
        b"Transfer-Encoding: chunked\r\n"
        if chunked
        else b"Content-Length: %d\r\n" % len(COMPLETION)
    )
    start = time.monotonic()
    with served.connect() as sock:
        sock.sendall(_post("/v1/completions", framing + b"Connection: close\r\n\r\n"))
        for piece in pieces:
            time.sleep(0.15)
            sock.sendall(_chunk(piece) if chunked else piece)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
        data, _ = read_until_closed(sock, PATIENCE_S)
    assert time.monotonic() - start > 3 * STALL.body_read_timeout
    assert status_of(data) == 200, data[:300]
    assert json_body(data)["choices"][0]["text"]


async def _slow_reader(scope: Any, receive: Any, send: Any) -> None:
    """An ASGI app that reads the body only after 1.5 s, then answers its size."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await asyncio.sleep(1.5)
    size, more = 0, True
    while more:
        message = await receive()
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    body = str(size).encode()
    headers = [(b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def test_a_body_the_app_is_slow_to_read_is_not_a_stalled_client() -> None:
    """Past 64 KiB unread, uvicorn stops reading the socket: no bytes come, by the server's
    doing, for longer than the read timeout."""
    size = 1 << 20
    with serving(_slow_reader, STALL) as served, served.connect() as sock:  # type: ignore[arg-type]
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
        sender = threading.Thread(target=sock.sendall, args=(b"x" * size,), daemon=True)
        sender.start()
        data, _ = read_until_closed(sock, PATIENCE_S)
        sender.join(timeout=5)
    assert status_of(data) == 200, data[:300]
    assert json_body(data) == size


def test_a_steady_drip_still_gets_408_at_the_total_body_timeout(stack: Stack) -> None:
    limits = ConnectionLimits(header_timeout=5, body_timeout=1.0, body_read_timeout=0.5)
    with serving(stack.app(), limits) as served, served.connect() as sock:
        sock.sendall(_post("/v1/completions", b"Content-Length: 1000\r\n\r\n"))
        data, start = drip(sock, b" ")  # a byte every 0.1 s
        took = time.monotonic() - start
    error = assert_face_error(data, "/v1/completions", 408)
    assert "within 1 s" in error["message"] and 0.9 < took < 3.0, (error, took)


def test_an_idle_keep_alive_connection_is_closed_after_timeout_keep_alive(
    served: Served,
) -> None:
    with served.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, took = read_until_closed(sock, PATIENCE_S)
    assert status_of(data) == 200 and took < PATIENCE_S


# --- the connection cap -------------------------------------------------------------------


def test_idle_connections_beyond_the_cap_do_not_lock_out_health_or_completions(
    served: Served,
) -> None:
    idle = [served.connect() for _ in range(5 * SHORT.max_connections)]
    try:
        idle[-1].sendall(b"GET /he")  # partial headers count as idle too
        time.sleep(0.2)
        with httpx.Client(base_url=served.url, timeout=5) as client:
            assert client.get("/health").status_code == 200
            reply = client.post("/v1/completions", content=COMPLETION)
            assert reply.status_code == 200, reply.text
        assert served.open_connections <= SHORT.max_connections
    finally:
        for sock in idle:
            sock.close()


def test_a_connection_beyond_the_cap_closes_the_longest_idle_one(stack: Stack) -> None:
    limits = ConnectionLimits(max_connections=2, header_timeout=30)
    with serving(stack.app(), limits) as served:
        oldest, newer = served.connect(), served.connect()
        time.sleep(0.1)
        newer.sendall(b"GET /he")  # partial headers: still idle, not refreshed
        time.sleep(0.1)
        with served.connect() as newest:
            data, took = read_until_closed(oldest, PATIENCE_S)
            assert data == b"" and took < PATIENCE_S
            newest.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status_of(newest.recv(65536)) == 200
        newer.sendall(b"alth HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data, _ = read_until_closed(newer, PATIENCE_S)
        assert status_of(data) == 200
        oldest.close()
        newer.close()


def test_when_every_connection_is_busy_a_new_one_gets_a_fast_503() -> None:
    stack = fake_stack(endless=True, step_latency_s=0.01)
    limits = ConnectionLimits(max_connections=2, header_timeout=5, body_timeout=5)
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 1500}' % MODEL.encode()
    request = (
        b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with serving(stack.app(), limits) as served:
        streams = [served.connect() for _ in range(2)]
        for sock in streams:
            sock.sendall(request)
            assert status_of(sock.recv(65536)) == 200
        with served.connect() as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data, took = read_until_closed(extra, PATIENCE_S)
        assert_openai_error(data, 503, "overloaded_error")
        assert b"retry-after: 1" in data.lower() and took < PATIENCE_S
        for sock in streams:
            sock.close()
        assert stack.wait_idle() == {}
        assert httpx.get(f"{served.url}/health", timeout=5).status_code == 200


# --- malformed HTTP -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header Name: 1\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ],
    ids=["request-line", "header-name", "headers-too-large", "negative-length", "bad-chunk"],
)
def test_malformed_http_gets_400_in_the_error_schema(served: Served, raw: bytes) -> None:
    with served.connect() as sock:
        sock.sendall(raw)
        data, _ = read_until_closed(sock, PATIENCE_S)
    assert_openai_error(data, 400, "invalid_request_error")


# --- open-files limit and the log ---------------------------------------------------------


def _low_open_files_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


def test_a_flood_beyond_the_open_files_limit_neither_locks_out_nor_floods_the_log(
    tmp_path: Path,
) -> None:
    """400 idle connections against a server whose open-files limit is 256 (the issue: 1,100
    at 1,024 timed /health out and wrote 354k "Too many open files" lines in 65 s)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "tests.robustness.fake_serve", "--port", str(port)]
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command,
            cwd=root,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_low_open_files_limit,
        )
    flood: list[socket.socket] = []
    try:
        _wait_for_health(url, process)
        for _ in range(400):  # connect without waiting: they pile up in the backlog
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            flood.append(sock)
        time.sleep(1.0)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        reply = httpx.post(f"{url}/v1/completions", content=COMPLETION, timeout=10)
        assert reply.status_code == 200, reply.text
        time.sleep(1.5)  # the accept loop's retries, were they logged, would pile up here
    finally:
        for sock in flood:
            sock.close()
        process.terminate()
        process.wait(timeout=30)
    lines = log_path.read_text().splitlines()
    assert any("--max-connections lowered from 1000 to 128" in line for line in lines), lines
    assert len(lines) < 60, lines[:80]
    assert sum("Too many open files" in line for line in lines) <= 3


def _wait_for_health(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server exited"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("the server never answered /health")


def test_accept_errors_are_folded_into_one_line_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    handler = AcceptErrorLog(FoldedLog(interval_s=10, clock=lambda: now[0]))
    loop = asyncio.new_event_loop()
    error = {"message": "socket.accept() out of system resource", "exception": OSError(24, "x")}
    try:
        with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
            for _ in range(5000):
                handler(loop, error)
            now[0] = 11.0
            handler(loop, error)
    finally:
        loop.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "4999 more" in lines[1]


def test_other_loop_errors_still_reach_the_default_handler(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            AcceptErrorLog()(loop, {"message": "something else broke"})
    finally:
        loop.close()
    assert any("something else broke" in r.getMessage() for r in caplog.records)


def test_the_soft_open_files_limit_is_raised_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 64:
        pytest.skip("needs a finite hard open-files limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, hard // 2), hard))
    try:
        assert raise_open_files_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_connection_cap_leaves_descriptors_for_everything_else() -> None:
    assert connection_cap(1000, 1024) == 896
    assert connection_cap(1000, 1 << 20) == 1000
    assert connection_cap(1000, None) == 1000
    assert connection_cap(1000, 16) == 1


# --- flags --------------------------------------------------------------------------------


def test_infer_serve_takes_every_connection_limit_as_a_flag() -> None:
    args = cli._parser().parse_args(
        [
            "serve",
            "--max-connections=50",
            "--timeout-keep-alive=7",
            "--header-timeout=3",
            "--body-timeout=20",
            "--body-read-timeout=4",
            "--backlog=64",
            "--h11-max-incomplete-event-size=4096",
        ]
    )
    assert connection_limits(args) == ConnectionLimits(50, 7, 3.0, 20.0, 64, 4096, 4.0)
    defaults = connection_limits(cli._parser().parse_args(["serve"]))
    assert defaults == ConnectionLimits()


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--max-connections=0", "--max-connections: must be at least 1"),
        ("--header-timeout=0", "--header-timeout: must be greater than 0"),
        ("--body-timeout=-1", "--body-timeout: must be greater than 0"),
        ("--body-read-timeout=0", "--body-read-timeout: must be greater than 0"),
        ("--timeout-keep-alive=0", "--timeout-keep-alive: must be greater than 0"),
    ],
)
def test_a_bad_limit_is_refused_before_the_model_loads(
    flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", "--model", "/nonexistent", flag]) == 2
    assert message in capsys.readouterr().err
