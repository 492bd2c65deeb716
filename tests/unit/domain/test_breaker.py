"""Per-replica circuit breakers: consecutive failures or a failure rate over a window open
one; its replica is probed after the cool-down (half-open) and put back when it answers."""

import pytest

from domain.breaker import CLOSED, HALF_OPEN, OPEN, Breakers, BreakerSettings, standby
from domain.errors import InvalidParameterError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def breakers(**settings: object) -> tuple[Breakers, Clock]:
    clock = Clock()
    return Breakers(BreakerSettings(**settings), clock), clock  # type: ignore[arg-type]


def test_consecutive_failures_open_it_and_a_success_resets_the_count() -> None:
    b, _ = breakers(failure_threshold=3, min_requests=100)
    assert b.record("r1", True) is None and b.record("r1", True) is None
    assert b.record("r1", False) is None  # the run broken
    assert b.record("r1", True) is None and b.record("r1", True) is None
    opened = b.record("r1", True)
    assert opened is not None and opened.state == OPEN and "3 calls failed" in opened.reason
    assert b.avoided() == {"r1"} and b.states() == {"r1": OPEN}


def test_a_failure_rate_over_the_window_opens_it_and_old_outcomes_age_out() -> None:
    b, clock = breakers(failure_threshold=100, failure_rate=0.5, min_requests=4, window_s=10)
    for failed in (False, True, False, True):
        clock.now += 1
        transition = b.record("r1", failed)
    assert transition is not None and "50% of 4 calls" in transition.reason
    c, clock = breakers(failure_threshold=100, failure_rate=0.5, min_requests=4, window_s=10)
    for failed in (True, True, True):
        c.record("r2", failed)
    clock.now = 20.0  # the three failures aged out of the window
    for _ in range(3):
        assert c.record("r2", False) is None
    assert c.record("r2", True) is None  # 1 of 4
    assert c.avoided() == frozenset()


def test_after_the_cooldown_it_is_probed_then_closed_or_opened_again() -> None:
    b, clock = breakers(failure_threshold=1, cooldown_s=30)
    b.record("r1", True)
    clock.now = 29.0
    assert b.due_probes() == []
    clock.now = 30.0
    assert b.due_probes() == ["r1"] and b.states() == {"r1": HALF_OPEN}
    assert b.due_probes() == []  # one probe at a time
    assert b.avoided() == {"r1"}  # no traffic while it is probed
    again = b.probed("r1", ok=False)
    assert again.state == OPEN and b.opens() == {"r1": 2}
    clock.now = 60.0
    assert b.due_probes() == ["r1"]
    closed = b.probed("r1", ok=True)
    assert closed.state == CLOSED and b.avoided() == frozenset()
    assert b.record("r1", False) is None


def test_disabled_breakers_never_open() -> None:
    b, _ = breakers(enabled=False, failure_threshold=1)
    assert b.record("r1", True) is None and b.avoided() == frozenset()


@pytest.mark.parametrize(
    "bad", [{"failure_threshold": 0}, {"failure_rate": 0.0}, {"cooldown_s": 0}, {"min_requests": 0}]
)
def test_bad_settings_name_their_flag(bad: dict[str, float]) -> None:
    with pytest.raises(InvalidParameterError, match="cb_"):
        BreakerSettings(**bad)  # type: ignore[arg-type]


def test_standbys_take_calls_only_while_breakers_keep_serving_replicas_out() -> None:
    joined = ["r0", "r1", "r2"]  # 2 serving, 1 warm standby
    assert standby(joined, 2, frozenset()) == {"r2"}
    assert standby(joined, 2, frozenset({"r0"})) == frozenset()  # r2 steps in for r0
    assert standby(joined, 2, frozenset({"r0", "r1"})) == frozenset()
    assert standby(joined, 3, frozenset()) == frozenset()
