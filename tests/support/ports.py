"""Waiting for a server a test started to listen on a local port."""

import socket
import time


def port_listens(port: int, seconds: float) -> bool:
    """Whether 127.0.0.1:``port`` takes a connection within ``seconds`` (tried every 50 ms)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False
