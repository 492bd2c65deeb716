"""What every console response carries, and who may read the console's data.

The console's pages and assets are public (they hold no data); its data endpoints
(``/ui/api/...``, except ``/ui/api/info``) sit behind the server's API keys when it has a
keys file: any key of the keyring (whatever faces its tenant may use), sent as
``Authorization: Bearer`` (the page keeps it in ``sessionStorage``). Every response of a
console route gets a strict Content-Security-Policy (scripts, styles, images and
connections from the server itself only, no inline script or style, no framing, no
plugins) and ``X-Content-Type-Options: nosniff``: model output rendered by mistake as
HTML still could not run a script.
"""

from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.middleware import DefineMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from adapters.http.auth import ApiKeyGuard
from adapters.http.errors import HTTPError
from adapters.http.request_state import api_state
from application.access.access import Access

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
    "form-action 'self'"
)
CONSOLE_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
)
MISSING_KEY = "missing API key: send it as Authorization: Bearer <key>"


class ConsoleHeaders:
    """ASGI middleware: the console's security headers on every response of its routes
    (errors included), replacing any of the same names."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name for name, _ in CONSOLE_HEADERS}
                kept = [(k, v) for k, v in message.get("headers", ()) if k.lower() not in names]
                message = {**message, "headers": [*kept, *CONSOLE_HEADERS]}
            await send(message)

        await self.app(scope, receive, with_headers)


def console_headers() -> DefineMiddleware:
    """The middleware of every console router (a router's ``middleware=[...]``)."""
    return DefineMiddleware(ConsoleHeaders)


Guard = Any


def console_guard(access: Access | None) -> list[Guard]:
    """The guards of the console's data routes: none on an open server; otherwise any key
    of the keyring (a 401 in OpenAI's error schema without one). The caller's tenant is
    noted in the request's state (``api_state(request).tenant``)."""
    if access is None:
        return []
    keys = ApiKeyGuard(_refused)

    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        if access.open:
            return
        key = keys.key(connection)
        if not key:
            raise _refused(MISSING_KEY)
        tenant = access.tenant(key)
        if tenant is None:
            raise _refused("invalid API key")
        state = api_state(connection)
        state.tenant = tenant
        record = getattr(state, "record", None)
        if record is not None:
            record.tenant_id = tenant.id

    return [guard]


def _refused(message: str) -> HTTPError:
    return HTTPError(401, message, "invalid_request_error", code="invalid_api_key")
