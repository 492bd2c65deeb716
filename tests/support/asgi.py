"""One request straight through an ASGI app, from a client that leaves once it is sent: the
receive channel reports ``http.disconnect`` right after the body, before any reply."""

from typing import Any

from litestar import Litestar


async def leave_right_after_sending(app: Litestar, path: str, body: bytes) -> list[Any]:
    """``POST path`` with the JSON ``body`` through ``app``; the messages it sent back."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Any:
        return pending.pop() if pending else {"type": "http.disconnect"}

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    await app(scope, receive, send)  # type: ignore[arg-type]
    return sent
