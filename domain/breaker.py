"""Circuit breakers, one per engine replica of a fleet: a replica whose recent calls fail is
taken out of routing (open), tried again with a probe after a cool-down (half-open), and
put back when the probe answers (closed) — sglang-router's and vllm-router's ``--cb-*``
breakers. Pure state: the caller reports outcomes and asks which replicas to avoid.

A call *fails* when its replica was lost or its engine failed it (a server error); a
refusal for the caller's own mistake or a full queue is not the replica's failure.
"""

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from domain.errors import InvalidParameterError

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """``failure_threshold``: consecutive failed calls that open a breaker; ``failure_rate``
    over the last ``window_s`` seconds (at least ``min_requests`` calls) opens it too;
    ``cooldown_s``: how long an open breaker waits before its replica is probed;
    ``enabled``: False: no breaker ever opens."""

    enabled: bool = True
    failure_threshold: int = 5
    failure_rate: float = 0.5
    window_s: float = 60.0
    min_requests: int = 10
    cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise InvalidParameterError("cb_failure_threshold", "must be at least 1")
        if not 0.0 < self.failure_rate <= 1.0:
            raise InvalidParameterError("cb_failure_rate", "must be in (0, 1]")
        if self.window_s <= 0:
            raise InvalidParameterError("cb_window_duration_secs", "must be > 0")
        if self.cooldown_s <= 0:
            raise InvalidParameterError("cb_timeout_duration_secs", "must be > 0")
        if self.min_requests < 1:
            raise InvalidParameterError("cb_min_requests", "must be at least 1")


@dataclass(slots=True)
class _Breaker:
    state: str = CLOSED
    consecutive: int = 0
    outcomes: deque[tuple[float, bool]] = field(default_factory=deque)  # (time, failed)
    opened_at: float = 0.0
    opens: int = 0


@dataclass(frozen=True, slots=True)
class Transition:
    """A breaker that changed state (for the audit trail and the logs)."""

    replica_id: str
    state: str
    reason: str


class Breakers:
    """Every replica's breaker (created at its first outcome). ``clock``: monotonic."""

    def __init__(self, settings: BreakerSettings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self._clock = clock
        self._breakers: dict[str, _Breaker] = {}

    def _of(self, replica_id: str) -> _Breaker:
        return self._breakers.setdefault(replica_id, _Breaker())

    def record(self, replica_id: str, failed: bool) -> Transition | None:
        """A call on ``replica_id`` ended (``failed``: by the replica's fault); the breaker's
        change, if any."""
        if not self.settings.enabled:
            return None
        breaker, now, s = self._of(replica_id), self._clock(), self.settings
        breaker.outcomes.append((now, failed))
        while breaker.outcomes and breaker.outcomes[0][0] < now - s.window_s:
            breaker.outcomes.popleft()
        breaker.consecutive = breaker.consecutive + 1 if failed else 0
        if breaker.state != CLOSED or not failed:
            return None
        count = len(breaker.outcomes)
        rate = sum(f for _, f in breaker.outcomes) / count
        if breaker.consecutive >= s.failure_threshold:
            return self._open(replica_id, f"{breaker.consecutive} calls failed in a row")
        if count >= s.min_requests and rate >= s.failure_rate:
            return self._open(replica_id, f"{rate:.0%} of {count} calls failed in {s.window_s:g} s")
        return None

    def _open(self, replica_id: str, reason: str) -> Transition:
        breaker = self._of(replica_id)
        breaker.state, breaker.opened_at = OPEN, self._clock()
        breaker.opens += 1
        return Transition(replica_id, OPEN, reason)

    def due_probes(self) -> list[str]:
        """Open breakers whose cool-down is over: now half-open, their replicas to probe."""
        now, due = self._clock(), []
        for replica_id, breaker in self._breakers.items():
            if breaker.state == OPEN and now - breaker.opened_at >= self.settings.cooldown_s:
                breaker.state = HALF_OPEN
                due.append(replica_id)
        return due

    def probed(self, replica_id: str, ok: bool) -> Transition:
        """A half-open replica's probe answered (``ok``) or not: closed, or open again."""
        breaker = self._of(replica_id)
        if not ok:
            return self._open(replica_id, "its probe failed")
        breaker.state, breaker.consecutive = CLOSED, 0
        breaker.outcomes.clear()
        return Transition(replica_id, CLOSED, "its probe answered")

    def avoided(self) -> frozenset[str]:
        """The replicas routing leaves out: open and half-open ones."""
        return frozenset(r for r, b in self._breakers.items() if b.state != CLOSED)

    def forget(self, replica_id: str) -> None:
        """A replica gone (replaced by Ray): a new one starts closed."""
        self._breakers.pop(replica_id, None)

    def states(self) -> dict[str, str]:
        return {r: b.state for r, b in self._breakers.items()}

    def opens(self) -> dict[str, int]:
        """How many times each replica's breaker opened."""
        return {r: b.opens for r, b in self._breakers.items()}


def standby(ordered: Sequence[str], active: int, avoided: frozenset[str]) -> frozenset[str]:
    """The warm standby replicas routing leaves out: of the replicas in the order they
    joined (``ordered``), the first ``active`` whose breakers are closed serve, and the
    other closed ones wait (``--standby-replicas``) until a breaker opens."""
    healthy = [r for r in ordered if r not in avoided]
    return frozenset(healthy[active:])
