"""Launch a real `infer serve` process on a free port for end-to-end tests."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

INFER = Path(sys.executable).with_name("infer")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def infer_serve(*flags: str, timeout_s: float = 120) -> Iterator[str]:
    """``infer serve --port <free> *flags``; yields its base URL once /health answers.

    ``INFER_TEST_DEVICE`` (e.g. ``cuda``) adds ``--device`` to every server the e2e tests
    start (``benchmarks/gpu_check.sh`` runs them so on a GPU). Without a ``--usage-db``
    flag the server's usage and rollouts are kept in its memory: no test reads another's
    (nor the user's ``~/.cache/infer/usage.sqlite3``)."""
    port = free_port()
    if "--usage-db" not in flags:
        flags = (*flags, "--usage-db", ":memory:")
    device = os.environ.get("INFER_TEST_DEVICE")
    # Its output goes to a file: a pipe nobody reads fills (64 KiB of logs) and blocks it.
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in the finally below)
    process = subprocess.Popen(
        [
            str(INFER),
            "serve",
            "--port",
            str(port),
            *flags,
            *(["--device", device] if device else []),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                log.seek(0)
                raise AssertionError(
                    f"infer serve exited {process.returncode}: {log.read()[-4000:]}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def bearer_client(url: str, key: str, timeout: float = 30) -> httpx.Client:
    """A client of the server at ``url`` sending ``key`` as its bearer token."""
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def get_ok(url: str, key: str, path: str, timeout: float = 30, **params: Any) -> Any:
    """``GET path`` with ``key``, a 200 asserted: its JSON."""
    with bearer_client(url, key, timeout) as http:
        answer = http.get(path, params=params)
    assert answer.status_code == 200, answer.text
    return answer.json()


@contextmanager
def keyed_serve(
    folder: Path, keys: dict[str, str], *flags: str, admins: tuple[str, ...] = ("ops",)
) -> Iterator[str]:
    """:func:`infer_serve` with a keys file in ``folder`` (tenant id -> its key; the
    ``admins`` with the faces openai and admin, the others openai and tinker) and the usage
    database there too; yields its base URL."""
    from application.access.keys import hash_key

    tenants: list[dict[str, object]] = [
        {"id": tenant, "keys": [hash_key(key)]}
        | ({"faces": ["openai", "admin"]} if tenant in admins else {})
        for tenant, key in keys.items()
    ]
    path = folder / "keys.json"
    path.write_text(json.dumps({"tenants": tenants}))
    database = ("--usage-db", str(folder / "usage.sqlite3"))
    with infer_serve("--api-keys-file", str(path), *database, *flags) as url:
        yield url
