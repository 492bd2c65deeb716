"""The ingress's :class:`~application.engine.remote_engine.Dispatch` over a Ray Serve deployment
handle: each call is one streaming ``generate`` call on the engine deployment, placed by
its request router (:mod:`adapters.ray.router`). The replica's first item is its id with
the first batch of outputs (or its refusal of the call), the rest are batches. A replica
that dies (or cannot be reached) is a :class:`ReplicaLostError`; its own refusal (a domain
error) is raised as it is, unwrapped from Ray's task error. Leaving the outputs early
cancels the call (the replica aborts)."""

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from adapters.ray.forward import HttpCall, HttpReply
from application.engine.remote_engine import ReplicaLostError, Routed
from domain.request import AdmitCall, StepOutput
from domain.routing import RouteRequest

LOST = (RayActorError, ActorUnavailableError)


Handles = Callable[[], DeploymentHandle]


def loop_handle(deployment: str, app: str) -> Handles:
    """A deployment's handle (one for every caller), made at its first use: its router then
    runs on the event loop that uses it (no thread hop per call), which must be that first
    caller's."""
    made: list[DeploymentHandle] = []

    def make() -> DeploymentHandle:
        if not made:
            handle = serve.get_deployment_handle(deployment, app)
            handle._init(_run_router_in_separate_loop=False)
            made.append(handle)
        return made[0]

    return make


class HandleDispatch:
    """``handles()``: the engine deployment's handle, asked for at the first call."""

    def __init__(self, handles: Handles) -> None:
        self._handles = handles
        self._handle: DeploymentHandle | None = None

    async def __call__(self, route: RouteRequest, call: AdmitCall, avoid: frozenset[str]) -> Routed:
        if self._handle is None:
            self._handle = self._handles().options(stream=True, method_name="generate")
        outputs = self._handle.remote(route, call, avoid)
        assert isinstance(outputs, DeploymentResponseGenerator)  # a streaming handle's
        try:
            replica_id, first = await _next(outputs, None)
        except BaseException:
            outputs.cancel()
            raise
        return Routed(replica_id, _rest(outputs, replica_id, first))


async def _next(outputs: DeploymentResponseGenerator, replica_id: str | None) -> Any:
    try:
        return await outputs.__anext__()
    except StopAsyncIteration:
        raise ReplicaLostError(replica_id, "the call ended without a reply") from None
    except LOST as e:
        raise ReplicaLostError(replica_id, type(e).__name__) from e
    except RayTaskError as e:
        raise _cause(e, replica_id) from None


async def _rest(
    outputs: DeploymentResponseGenerator, replica_id: str, first: list[StepOutput] | Exception
) -> AsyncIterator[list[StepOutput]]:
    try:
        if isinstance(first, Exception):  # the replica refused the call
            raise first
        yield first
        async for batch in outputs:
            yield batch
    except LOST as e:
        raise ReplicaLostError(replica_id, type(e).__name__) from e
    except RayTaskError as e:
        raise _cause(e, replica_id) from None
    finally:
        outputs.cancel()


def _cause(error: RayTaskError, replica_id: str | None) -> Exception:
    """The replica's own error (its queue full...), not Ray's wrapper of it; the replica's
    death reported inside a task error is the replica lost."""
    cause = error.cause
    if isinstance(cause, LOST):
        return ReplicaLostError(replica_id, type(cause).__name__)
    return cause if isinstance(cause, Exception) else error


class HandleForward:
    """The ingress's Tinker :data:`~adapters.ray.forward.Forward`: a call
    (``tinker_http``) on the engine deployment, placed by the request router by the replica
    its ids name (``route.replica``)."""

    def __init__(self, handles: Handles) -> None:
        self._handles = handles
        self._handle: DeploymentHandle | None = None

    async def __call__(self, route: RouteRequest, call: HttpCall) -> HttpReply:
        if self._handle is None:
            self._handle = self._handles().options(method_name="tinker_http")
        try:
            reply = await self._handle.remote(route, call, frozenset())
        except LOST as e:
            raise ReplicaLostError(route.replica, type(e).__name__) from e
        except RayTaskError as e:
            raise _cause(e, route.replica) from None
        assert isinstance(reply, HttpReply)
        return reply


FAULT_ENV = "INFER_FAULT_INJECTION"
Fault = Callable[[str, bool], Awaitable[str]]


def fault_hook(handles: Handles) -> Fault | None:
    """With ``INFER_FAULT_INJECTION=1`` (tests and chaos runs only): a call that makes a
    replica fail every call from now on, or serve again (``set_fault`` on the replica its
    id names); None otherwise (``/admin/replicas/{id}/fault`` is then not served)."""
    if os.environ.get(FAULT_ENV) != "1":
        return None

    async def set_fault(replica_id: str, fail: bool) -> str:
        handle = handles().options(method_name="set_fault")
        done: str = await handle.remote(RouteRequest(replica=replica_id), fail, frozenset())
        return done

    return set_fault
