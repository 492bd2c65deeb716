"""RolloutBook: the rollouts a server serves (:class:`~application.serving.served_models.
ServedModels`) kept in a :class:`~domain.rollout.RolloutStore` — the usage ledger's
database — so that a restart keeps them and the servers sharing the database serve the
same ones; and their health: each target's recent outcomes, and the automatic rollbacks
a target's policy calls for.

At start the stored rollouts are served, and ``--model-rollout`` flags name rollouts only
where the store has none of that name (the store holds the latest decision: an admin's
``PUT``, an automatic rollback). Every change through the admin API is stored, then served;
an automatic rollback is stored as it happens. Each server polls the store's version and
serves what another one changed. A store that cannot be reached is logged; the rollouts in
memory keep serving.
"""

import threading
import time
from collections import deque
from dataclasses import dataclass

import structlog

from application.access.audit import Audit
from application.serving.served_models import ServedModels
from application.serving.store_sync import StoreSync
from domain.errors import InvalidParameterError
from domain.rollout import Rollout, RolloutStore

log = structlog.get_logger("infer.audit")


@dataclass(frozen=True, slots=True)
class RolledBack:
    """A rollout's target taken out by its rollback policy: ``error_rate`` of its last
    ``requests`` failed."""

    rollout: str
    target: str
    error_rate: float
    requests: int
    at: float  # wall time (unix seconds)


class RolloutBook(StoreSync[Rollout]):
    what = "rollouts"
    store: RolloutStore | None

    def __init__(
        self, models: ServedModels, store: RolloutStore | None = None, audit: Audit | None = None
    ) -> None:
        self.models, self.store, self.audit = models, store, audit or Audit()
        self._seen: int | None = None
        self._health: dict[tuple[str, str], deque[bool]] = {}  # (rollout, target): outcomes
        self._rolled_back: dict[str, list[RolledBack]] = {}
        # One at a time: outcomes (and the rollbacks they make), sets, removals, syncs.
        self._lock = threading.Lock()

    def start(self) -> None:
        """Serve the stored rollouts, and store the flags' that the store lacks."""
        if self.store is None:
            return
        try:
            stored = {r.name: r for r in self.store.load()}
            for rollout in self.models.rollouts():
                if rollout.name not in stored:
                    self.store.save(rollout)
                elif stored[rollout.name] != rollout:
                    log.info(
                        "rollout kept from the store, not --model-rollout", rollout=rollout.name
                    )
            self._seen = self.store.version()
            self._serve(self.store.load())
        except Exception as e:
            log.error("rollouts not read from the store; serving the flags'", error=str(e))

    # --- changes --------------------------------------------------------------------------

    def rollouts(self) -> list[Rollout]:
        return self.models.rollouts()

    def rollbacks(self, name: str) -> list[RolledBack]:
        """The rollout's targets rolled back by its policy since it was last set."""
        with self._lock:
            return list(self._rolled_back.get(name, ()))

    def health(self, name: str) -> dict[str, tuple[int, int]]:
        """Each target's recent requests in this server (its rollback policy's window) and
        how many of them failed, as the policy counts them."""
        with self._lock:
            return {
                target: (len(outcomes), sum(outcomes))
                for (rollout, target), outcomes in self._health.items()
                if rollout == name
            }

    def outcome(self, name: str, target: str, failed: bool) -> RolledBack | None:
        """A request the rollout ``name`` sent to ``target`` ended (``failed``: a server
        error). Rolls the target back (its weight 0, its tenants unpinned; stored and
        audited) when its policy says so and another target serving by weight fails less;
        what happened."""
        with self._lock:
            rollout = self.models.rollout(name)
            policy = None if rollout is None else rollout.rollback
            if rollout is None or policy is None:
                return None
            outcomes = self._health.setdefault((name, target), deque(maxlen=policy.window))
            if outcomes.maxlen != policy.window:
                outcomes = self._health[(name, target)] = deque(outcomes, maxlen=policy.window)
            outcomes.append(failed)
            rate = sum(outcomes) / len(outcomes)
            if len(outcomes) < policy.min_requests or rate < policy.max_error_rate:
                return None
            current = next((t for t in rollout.targets if t.model == target), None)
            if current is None or (current.weight == 0 and not current.tenants):
                return None  # already out
            healthier = [
                t
                for t in rollout.targets
                if t.model != target and t.weight > 0 and self._rate(name, t.model) < rate
            ]
            if not healthier:
                return None  # nothing better to send its requests to
            rolled = rollout.without(target)
            try:
                self.models.set_rollout(rolled)
            except InvalidParameterError:  # a target no longer served: nothing to move
                return None
            del self._health[(name, target)]
            event = RolledBack(name, target, rate, len(outcomes), time.time())
            self._rolled_back.setdefault(name, []).append(event)
        self._rolled_back_event(rolled, event)
        return event

    def _rate(self, name: str, target: str) -> float:
        outcomes = self._health.get((name, target))
        return sum(outcomes) / len(outcomes) if outcomes else 0.0

    def _forget(self, name: str) -> None:
        """A rollout set or removed anew: its history starts afresh."""
        self._health = {k: v for k, v in self._health.items() if k[0] != name}
        self._rolled_back.pop(name, None)

    def set(self, rollout: Rollout, actor: str | None = None) -> Rollout | None:
        """Check ``rollout`` against the served models, store it, serve it, audit it (by
        ``actor``); the one it replaced (blocking: call it off the event loop)."""
        with self._lock:
            self.models.check_rollout(rollout)
            if self.store is not None:
                self.store.save(rollout)
                self._seen = self.store.version()
            before = self.models.set_rollout(rollout)
            self._forget(rollout.name)
        self.audit.record(
            "rollout set",
            actor=actor,
            subject=f"rollout:{rollout.name}",
            rollout=rollout.name,
            targets={t.model: t.weight for t in rollout.targets},
            pinned={t.model: sorted(t.tenants) for t in rollout.targets if t.tenants},
            before=None if before is None else {t.model: t.weight for t in before.targets},
        )
        return before

    def remove(self, name: str, actor: str | None = None) -> Rollout | None:
        with self._lock:
            removed = self.models.remove_rollout(name)
            self._forget(name)
        if removed is not None:
            if self.store is not None:
                self.store.delete(name)
                self._seen = self.store.version()
            self.audit.record(
                "rollout removed", actor=actor, subject=f"rollout:{name}", rollout=name
            )
        return removed

    def _rolled_back_event(self, rollout: Rollout, event: RolledBack) -> None:
        self.audit.record(
            "rollout target rolled back",
            actor="automatic",
            subject=f"rollout:{rollout.name}",
            warning=True,
            rollout=rollout.name,
            target=event.target,
            error_rate=round(event.error_rate, 4),
            requests=event.requests,
        )
        if self.store is None:
            return
        try:
            self.store.save(rollout)
        except Exception as e:
            log.error("an automatic rollback was not stored", rollout=rollout.name, error=str(e))

    # --- other servers' changes -----------------------------------------------------------

    def _serve(self, stored: list[Rollout]) -> None:
        names = {r.name for r in stored}
        with self._lock:
            for rollout in stored:
                if rollout in self.models.rollouts():
                    continue  # unchanged: its health kept
                try:
                    self.models.set_rollout(rollout)
                except InvalidParameterError as e:  # another server's models
                    log.warning(
                        "a stored rollout is not served here", rollout=rollout.name, error=str(e)
                    )
                    continue
                self._forget(rollout.name)
            for rollout in self.models.rollouts():
                if rollout.name not in names:
                    self.models.remove_rollout(rollout.name)
                    self._forget(rollout.name)
