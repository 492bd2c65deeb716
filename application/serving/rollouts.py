"""RolloutBook: the rollouts a server serves (:class:`~application.serving.served_models.
ServedModels`) kept in a :class:`~domain.rollout.RolloutStore` — the usage ledger's
database — so that a restart keeps them and the servers sharing the database serve the
same ones.

At start the stored rollouts are served, and ``--model-rollout`` flags name rollouts only
where the store has none of that name (the store holds the latest decision: an admin's
``PUT``, an automatic rollback). Every change through the admin API is stored, then served;
an automatic rollback is stored as it happens. Each server polls the store's version and
serves what another one changed. A store that cannot be reached is logged; the rollouts in
memory keep serving.
"""

import asyncio

import structlog

from application.access.audit import Audit
from application.serving.served_models import RolledBack, ServedModels
from domain.errors import InvalidParameterError
from domain.rollout import Rollout, RolloutStore

log = structlog.get_logger("infer.audit")
DEFAULT_WATCH_S = 2.0


class RolloutBook:
    def __init__(
        self, models: ServedModels, store: RolloutStore | None = None, audit: Audit | None = None
    ) -> None:
        self.models, self.store, self.audit = models, store, audit or Audit()
        self._seen: int | None = None
        models.on_rollback = self._rolled_back

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
        return self.models.rollbacks(name)

    def health(self, name: str) -> dict[str, tuple[int, int]]:
        """Each target's (recent requests, failed) in this server (see
        :meth:`ServedModels.rollout_health`)."""
        return self.models.rollout_health(name)

    def set(self, rollout: Rollout, actor: str | None = None) -> Rollout | None:
        """Check ``rollout`` against the served models, store it, serve it, audit it (by
        ``actor``); the one it replaced (blocking: call it off the event loop)."""
        self.models.check_rollout(rollout)
        if self.store is not None:
            self.store.save(rollout)
            self._seen = self.store.version()
        before = self.models.set_rollout(rollout)
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
        removed = self.models.remove_rollout(name)
        if removed is not None:
            if self.store is not None:
                self.store.delete(name)
                self._seen = self.store.version()
            self.audit.record(
                "rollout removed", actor=actor, subject=f"rollout:{name}", rollout=name
            )
        return removed

    def _rolled_back(self, rollout: Rollout, event: RolledBack) -> None:
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

    def sync(self) -> bool:
        """Serve the store's rollouts if another server changed them; whether it did."""
        if self.store is None:
            return False
        version = self.store.version()
        if version == self._seen:
            return False
        self._serve(self.store.load())
        self._seen = version
        return True

    def _serve(self, stored: list[Rollout]) -> None:
        names = {r.name for r in stored}
        for rollout in stored:
            if rollout in self.models.rollouts():
                continue  # unchanged: its health kept
            try:
                self.models.set_rollout(rollout)
            except InvalidParameterError as e:  # another server's models
                log.warning(
                    "a stored rollout is not served here", rollout=rollout.name, error=str(e)
                )
        for rollout in self.models.rollouts():
            if rollout.name not in names:
                self.models.remove_rollout(rollout.name)

    async def watch(self, interval_s: float = DEFAULT_WATCH_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await asyncio.to_thread(self.sync)
            except Exception as e:
                log.error("rollouts not read from the store", error=str(e))
