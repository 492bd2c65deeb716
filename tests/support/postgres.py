"""A throwaway PostgreSQL server for tests: Debian's ``postgresql`` binaries (``make test``
installs them when missing and root), a fresh cluster in a temporary folder, listening on
127.0.0.1 at a free port, stopped and deleted afterwards. As root the server runs as the
``postgres`` user (``initdb`` refuses root)."""

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.support.ports import port_listens


def postgres_bin() -> Path | None:
    """The folder of ``initdb`` / ``pg_ctl`` (Debian keeps them per version), or None."""
    if found := shutil.which("initdb"):
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    return Path(versions[0]).parent if versions else None


def _as_server_user() -> list[str]:
    if os.geteuid() != 0:
        return []
    runuser = shutil.which("runuser")
    if runuser is None:
        raise RuntimeError("running as root without runuser: cannot start PostgreSQL")
    return [runuser, "-u", "postgres", "--"]


# A running server's data folder and options by its URL (for :func:`restart_postgres`).
_RUNNING: dict[str, tuple[Path, str, Path]] = {}


def restart_postgres(url: str) -> None:
    """Stop the server at ``url`` (its open connections cut, as a crash of the database
    would) and start it again on the same port and data."""
    data, options, log = _RUNNING[url]
    binaries = postgres_bin()
    assert binaries is not None
    pg_ctl = [*_as_server_user(), str(binaries / "pg_ctl"), "-D", str(data)]
    subprocess.run([*pg_ctl, "-m", "fast", "stop"], capture_output=True, check=True, timeout=60)
    subprocess.run(
        [*pg_ctl, "-o", options, "-l", str(log), "-w", "start"],
        capture_output=True,
        check=True,
        timeout=60,
    )


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """A running server; yields its URL (database ``postgres``, user ``postgres``,
    trusted on 127.0.0.1)."""
    binaries = postgres_bin()
    if binaries is None:
        raise FileNotFoundError("no PostgreSQL (apt install postgresql)")
    prefix = _as_server_user()
    folder = Path(tempfile.mkdtemp(prefix="infer-pg-"))
    if prefix:
        shutil.chown(folder, "postgres", "postgres")
    data = folder / "data"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "check": True}
    try:
        subprocess.run(
            [*prefix, str(binaries / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust"],
            **quiet,  # type: ignore[call-overload]
        )
        options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run(
            [
                *prefix,
                str(binaries / "pg_ctl"),
                "-D",
                str(data),
                "-o",
                options,
                "-l",
                str(folder / "log"),
                "-w",
                "start",
            ],
            **quiet,  # type: ignore[call-overload]
        )
        _wait_for(port)
        url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        _RUNNING[url] = (data, options, folder / "log")
        yield url
    finally:
        with contextlib.suppress(Exception):
            subprocess.run(
                [*prefix, str(binaries / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=30,
            )
        shutil.rmtree(folder, ignore_errors=True)


def _wait_for(port: int) -> None:
    if not port_listens(port, 30):
        raise TimeoutError(f"PostgreSQL did not listen on port {port}")
