"""What one API request carries from the middlewares and the guard to its handler:
Litestar's ``request.state``, typed (:class:`ApiState`), and the handlers' dependencies:
the one read from it (:func:`caller`) and the app's services (:func:`provide`).

The owning middleware (``ownership.py``) sets the state up for every request: its record
(``ObservedApp``'s, when it wraps the app), its request group, what it holds on its model;
the inference guard (``access.py``) adds the caller's tenant and what its limits admitted.
"""

import asyncio
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import structlog
from litestar import Request
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide

from application.access.quotas import Admission, Quotas
from application.engine.engine_client import OwnedRequests
from application.serving.completions import Caller
from application.serving.request_record import RequestRecord
from domain.tenancy import Tenant

log = structlog.get_logger(__name__)
# A handler's ``caller: RequestCaller``: its group, record and limits.
RequestCaller = NamedDependency[Caller]


class ModelHold:
    """What one HTTP request holds on its model until it ends: the LoRA adapter pinned in
    the engine, and the deprecation headers of the name it used."""

    def __init__(self) -> None:
        self.pins = ExitStack()
        self.headers: list[tuple[bytes, bytes]] = []


@dataclass(frozen=True, slots=True)
class HeldLimits:
    """What the request was admitted with under its tenant's limits (the guard's):
    reservations count against them; what was not used is settled at the end."""

    quotas: Quotas
    admission: Admission

    async def reserve(self, tokens: int) -> None:
        await self.quotas.reserve(self.admission, tokens)

    async def settle(self, used_tokens: int) -> None:
        """Give back what the request reserved and did not use (even when cancelled)."""
        try:
            await asyncio.shield(self.quotas.settle(self.admission, used_tokens))
        except Exception:  # the counters' store is down: the window will reset on its own
            log.exception("settling a request's rate limits failed")

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's ``x-ratelimit-*`` headers for the limits the request was counted in."""
        headers = []
        for suffix, state in (
            ("requests", self.admission.requests),
            ("tokens", self.admission.tokens),
        ):
            if state is not None:
                headers += [
                    (f"x-ratelimit-limit-{suffix}".encode(), str(state.limit).encode()),
                    (f"x-ratelimit-remaining-{suffix}".encode(), str(state.remaining).encode()),
                    (f"x-ratelimit-reset-{suffix}".encode(), f"{state.reset_s:.3f}s".encode()),
                ]
        return headers


class ApiState(State):
    """``request.state`` of a request the app serves (attributes, never string keys)."""

    record: RequestRecord
    group: OwnedRequests
    hold: ModelHold
    tenant: Tenant | None  # None: an open server
    limits: HeldLimits | None  # None: no limits

    @classmethod
    def open(cls, state: dict[str, Any], group: OwnedRequests, record: RequestRecord) -> "ApiState":
        """The state of a request starting, over its ASGI ``state`` mapping."""
        api = cls(state)
        api.record, api.group, api.hold = record, group, ModelHold()
        api.tenant = api.limits = None
        return api


def api_state(connection: ASGIConnection[Any, Any, Any, Any]) -> ApiState:
    state: ApiState = connection.state
    return state


def caller(request: Request[Any, Any, Any]) -> Caller:
    """A handler's ``caller``: the request's group, record, limits and its tenant's cap on
    output tokens."""
    state = api_state(request)
    cap = state.tenant.limits.max_output_tokens if state.tenant is not None else None
    return Caller(state.group, state.record, state.limits, cap)


# The dependencies of the inference faces' handlers, by parameter name.
REQUEST_DEPENDENCIES = {"caller": Provide(caller, sync_to_thread=False)}


def constants(services: Mapping[str, object]) -> dict[str, Provide]:
    """``services`` as dependencies by name (each the same object for every request)."""
    return {
        name: Provide(_constant(value), use_cache=True, sync_to_thread=False)
        for name, value in services.items()
    }


def provide(services: Mapping[str, object]) -> dict[str, Provide]:
    """The app's ``services`` as dependencies by name, with the request's ones."""
    return {**constants(services), **REQUEST_DEPENDENCIES}


def _constant(value: object) -> Any:
    return lambda: value
