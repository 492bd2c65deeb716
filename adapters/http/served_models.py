"""Model names on the inference faces (:mod:`application.serving.served_models` on the wire).

:class:`ModelNames` answers which model a request's ``model`` names (``ModelNotFoundError``:
404 in OpenAI's format, ``model_not_found``, when none), whether the caller's key may use
it (403), and holds what the request needs until its HTTP exchange ends (the request
state's :class:`~adapters.http.request_state.ModelHold`): the LoRA adapter pinned in the
engine, and for a name being retired the RFC 9745 / RFC 8594 headers
``Deprecation: @<epoch>`` and ``Sunset: <HTTP-date>`` (both the name's deprecation date,
the day it stops being served). ``GET /v1/models`` (``adapters.http.openai.models``) lists
what the caller may use.

Keys' model scopes: a key allowed the base model's id may use all its names (aliases, the
pinned version) and its own Tinker checkpoints; one allowed only an alias, that alias;
LoRA modules are allowed by their own names.
"""

from collections.abc import Callable
from datetime import UTC, date, datetime, time
from email.utils import format_datetime
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection

from adapters.http.request_state import api_state
from application.serving.request_record import RequestRecord
from application.serving.rollouts import RolloutBook
from application.serving.served_models import ModelEntry, ServedModels
from domain.tenancy import PermissionDeniedError

CLIENT_CLOSED = 499
# The model a rollout's name sent the request to (the reply's ``model`` in OpenAI's faces).
ROLLOUT_HEADER = b"x-infer-model"
# The caller's Tinker tenant (raises when its key is not a Tinker key).
Owner = Callable[[ASGIConnection[Any, Any, Any, Any]], str]


class ModelNames:
    """``models`` on one app; ``owner``: the caller's Tinker tenant (None: no Tinker API,
    so no ``tinker://`` models); ``rollouts``: where a rollout's outcomes go (its health,
    its automatic rollbacks; None: not counted)."""

    def __init__(
        self,
        models: ServedModels,
        owner: Owner | None = None,
        rollouts: RolloutBook | None = None,
    ) -> None:
        self.models, self._owner, self._rollouts = models, owner, rollouts

    def owner(self, request: ASGIConnection[Any, Any, Any, Any]) -> str | None:
        if self._owner is None:
            return None
        try:
            return self._owner(request)
        except Exception:  # no Tinker key: no checkpoint of its own
            return None

    def resolve(self, request: Request[Any, Any, Any], requested: str | None) -> ModelEntry:
        """The model ``requested`` names (None: the base model), usable by the caller;
        its adapter stays loaded, and the reply carries its deprecation, until the HTTP
        request ends."""
        state = api_state(request)
        tenant, record = state.tenant, getattr(state, "record", None)
        entry = self.models.resolve(
            requested,
            self.owner(request),
            tenant=None if tenant is None else tenant.id,
            sticky=None if record is None else record.user,
        )
        if tenant is not None and not entry.allowed(tenant.allows_model):
            raise PermissionDeniedError(f"this API key may not use the model {entry.id!r}")
        state.hold.pins.enter_context(self.models.use(entry))
        if entry.deprecation_date is not None:
            state.hold.headers = deprecation_headers(entry.deprecation_date)
        if entry.rollout is not None:  # logs, metrics and usage name the model that ran
            state.hold.headers.append((ROLLOUT_HEADER, entry.id.encode()))
            if record is not None:
                record.model, record.rollout = entry.id, entry.rollout
                state.hold.pins.callback(self._outcome, entry.rollout, entry.id, record)
        return entry

    def _outcome(self, rollout: str, target: str, record: RequestRecord) -> None:
        """The request's end, told to the rollout's health (a 5xx or an engine error is a
        failure; a request that never answered, a client gone, is not counted)."""
        if record.status is None or record.status == CLIENT_CLOSED:
            return
        failed = record.status >= 500 or "error" in record.finish_reasons
        if self._rollouts is not None:  # a rollback is stored and audited there
            self._rollouts.outcome(rollout, target, failed)

    def visible(self, request: Request[Any, Any, Any]) -> list[ModelEntry]:
        """The models the caller may use."""
        tenant = api_state(request).tenant
        entries = self.models.entries(self.owner(request))
        return [e for e in entries if tenant is None or e.allowed(tenant.allows_model)]


def deprecation_headers(day: date) -> list[tuple[bytes, bytes]]:
    """RFC 9745's ``Deprecation`` (a structured date: ``@`` + seconds since the epoch) and
    RFC 8594's ``Sunset`` (an HTTP-date), both at the start of ``day`` (UTC)."""
    moment = datetime.combine(day, time(0), tzinfo=UTC)
    return [
        (b"deprecation", f"@{int(moment.timestamp())}".encode()),
        (b"sunset", format_datetime(moment, usegmt=True).encode()),
    ]


__all__ = ["ModelNames", "deprecation_headers"]
