"""The server process's transport and lifecycle: a graceful drain on SIGTERM (exit code 0)
and TLS, against ``tests.robustness.transport_serve`` (the composition root on the fake
runner under ``run_server``); and the transport flags' start-up errors."""

import json
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from entrypoints.cli import main

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}]}
# A self-signed certificate for 127.0.0.1 (its own CA), with an unencrypted EC key.
SELF_SIGNED = [
    *("openssl", "req", "-x509", "-days", "1", "-nodes", "-subj", "/CN=127.0.0.1"),
    *("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
    *("-addext", "subjectAltName=IP:127.0.0.1"),
]


@contextmanager
def transport_server(tmp_path: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "tests.robustness.transport_serve", "--port", str(port)]
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen([*command, *flags], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process, port
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        log.close()


def _wait_until_up(url: str, process: subprocess.Popen[bytes], **client: Any) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server exited"
        try:
            if httpx.get(f"{url}/health", timeout=1, **client).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("the server never answered /health")


class Reader(threading.Thread):
    """Reads one /v1/generate stream; ``started`` is set at its first token."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.started = threading.Event()
        self.events: list[tuple[str, dict[str, Any]]] = []

    def run(self) -> None:
        body = {"model": "fake", "prompt": "Hi", "max_tokens": self.max_tokens}
        with httpx.stream("POST", f"{self.url}/v1/generate", json=body, timeout=30) as reply:
            kind = ""
            for line in reply.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    self.events.append((kind, json.loads(line[6:])))
                    self.started.set()


def test_sigterm_drains_the_running_streams_refuses_new_work_and_exits_0(tmp_path: Path) -> None:
    flags = ("--step-latency", "0.02", "--drain-timeout", "2")
    with transport_server(tmp_path, *flags) as (process, port):
        url = f"http://127.0.0.1:{port}"
        _wait_until_up(url, process)
        short, endless = Reader(url, 40), Reader(url, 1000)
        for reader in (short, endless):
            reader.start()
            assert reader.started.wait(10)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the drain begins at the server's next tick (0.1 s)
        refused = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=5)
        ready, health = httpx.get(f"{url}/ready"), httpx.get(f"{url}/health")
        short.join(timeout=10)
        endless.join(timeout=10)
        code = process.wait(timeout=15)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["message"].startswith("the server is shutting down")
    assert (ready.status_code, health.status_code) == (503, 200)
    assert short.events[-1][0] == "done" and len(short.events) == 41
    kind, payload = endless.events[-1]
    assert kind == "error" and "shutting down" in payload["error"]
    assert code == 0, (tmp_path / "server.log").read_text()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_serves_https_that_verifies_and_refuses_plain_http(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [*SELF_SIGNED, "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True
    )
    trusted = ssl.create_default_context(cafile=str(cert))
    flags = ("--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    with transport_server(tmp_path, *flags) as (process, port):
        _wait_until_up(f"https://127.0.0.1:{port}", process, verify=trusted)
        reply = httpx.post(
            f"https://127.0.0.1:{port}/v1/chat/completions",
            json={**CHAT, "max_tokens": 5},
            verify=trusted,
        )
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # a client without the CA does not trust it
            httpx.get(f"https://127.0.0.1:{port}/health", timeout=5)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=15)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "Paris"
    assert code == 0


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--ssl-certfile", "cert.pem"], "--ssl-keyfile"),
        (["--ssl-keyfile", "key.pem"], "--ssl-certfile"),
        (["--ssl-certfile", "missing.pem", "--ssl-keyfile", "missing.pem"], "--ssl-certfile"),
        (["--sse-heartbeat-interval", "-1"], "--sse-heartbeat-interval"),
        (["--request-timeout", "-5"], "--request-timeout"),
    ],
)
def test_a_bad_transport_flag_fails_before_the_model_loads(
    flags: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["serve", "--model", str(tmp_path / "no-such-model"), *flags])
    assert code == 2
    assert named in capsys.readouterr().err
