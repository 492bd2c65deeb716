"""Engine work is owned by the HTTP request that queued it.

An ASGI middleware gives every HTTP request its :class:`OwnedRequests` group and closes it when the
request ends, however it ends: the reply sent, an error after part of the work was queued,
a client gone before its stream was ever read, a cancellation. Closing aborts every engine
request of the group still queued or running, at once. (A stream's own cleanup cannot do
this alone: a generator that never started has no ``finally`` to run.)
"""

from litestar import Request
from litestar.middleware import DefineMiddleware
from litestar.types import ASGIApp, Receive, Scope, Send

from application.engine_client import EngineClient, OwnedRequests

_KEY = "infer.request_group"


def owning_middleware(engine: EngineClient) -> DefineMiddleware:
    """The Litestar middleware giving each HTTP request its group."""
    return DefineMiddleware(OwningMiddleware, engine=engine)


class OwningMiddleware:
    def __init__(self, app: ASGIApp, engine: EngineClient) -> None:
        self.app, self.engine = app, engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        group = self.engine.group()
        # A state of its own (the server's may be shared between requests).
        scope["state"] = {**scope.get("state", {}), _KEY: group}
        try:
            await self.app(scope, receive, send)
        finally:  # synchronous: it runs even when the request's task is cancelled
            group.close()


def request_group(request: Request) -> OwnedRequests:
    """The group of the HTTP request being served."""
    state = request.scope["state"]
    assert _KEY in state, "owning_middleware is not installed"
    group: OwnedRequests = state[_KEY]
    return group
