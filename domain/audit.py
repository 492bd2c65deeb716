"""The audit trail: what admins (and the server on its own) changed — tenants, keys,
rollouts, the keys file reloaded — kept where operators can read it back
(``GET /admin/audit``), beside the ``infer.audit`` log lines.

An :class:`AuditEvent` names what happened (``tenant created``, ``rollout set``, ...), who
did it (an admin tenant, ``automatic``, or None on an open server), what it was about
(``tenant:acme``, ``rollout:support``, ``keys``) and its details as JSON-able values; never
an API key (keys are named by their public ids).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class AuditEvent:
    at: float  # wall time (unix seconds)
    event: str
    actor: str | None
    subject: str
    details: Mapping[str, Any] = field(default_factory=dict)


class AuditTrail(Protocol):
    """Where audit events are kept (the usage ledger's database, or memory)."""

    def append(self, event: AuditEvent) -> None: ...

    def read(
        self, *, since: float | None = None, until: float | None = None, limit: int = 100
    ) -> list[AuditEvent]:
        """Events in [``since``, ``until``), newest first, ``limit`` at most."""
        ...
