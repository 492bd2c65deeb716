"""Rollouts (``domain/rollout.py``) and their names among the served models: a weighted,
sticky pick; tenants pinned to a target; the checks on a rollout; ``--model-rollout``'s
form; ``ServedModels`` resolving a rollout's name to its pick and listing it."""

from collections import Counter

import pytest

from application.serving.rollouts import RolloutBook
from application.serving.served_models import ServedModels
from domain.errors import InvalidParameterError, ModelNotFoundError
from domain.rollout import RollbackPolicy, Rollout, RolloutTarget, parse_rollout

CANARY = Rollout("support", (RolloutTarget("v1", 90), RolloutTarget("v2", 10)))


def test_picks_follow_the_weights() -> None:
    picks = Counter(CANARY.pick(sticky=f"user-{i}") for i in range(20_000))
    assert abs(picks["v2"] / 20_000 - 0.10) < 0.01
    unkeyed = Counter(CANARY.pick() for _ in range(20_000))
    assert abs(unkeyed["v2"] / 20_000 - 0.10) < 0.01


def test_a_sticky_key_keeps_its_target() -> None:
    for i in range(200):
        first = CANARY.pick(sticky=f"user-{i}")
        assert all(CANARY.pick(sticky=f"user-{i}") == first for _ in range(5))
    # Growing the canary's share moves only users to it, never away from it.
    grown = Rollout("support", (RolloutTarget("v1", 50), RolloutTarget("v2", 50)))
    for i in range(2_000):
        if CANARY.pick(sticky=f"user-{i}") == "v2":
            assert grown.pick(sticky=f"user-{i}") == "v2"


def test_pinned_tenants_always_get_their_target() -> None:
    rollout = Rollout(
        "support",
        (RolloutTarget("v1", 1), RolloutTarget("v2", 0, frozenset({"beta", "gamma"}))),
    )
    assert {rollout.pick("beta", f"u{i}") for i in range(100)} == {"v2"}
    assert {rollout.pick("acme", f"u{i}") for i in range(100)} == {"v1"}  # weight 0: pinned only
    assert {rollout.pick(None) for _ in range(100)} == {"v1"}
    assert rollout.shares() == {"v1": 1.0, "v2": 0.0}


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        ((), "1 to 16 targets"),
        ((RolloutTarget("v1", 1), RolloutTarget("v1", 2)), "listed twice"),
        ((RolloutTarget("support", 1),), "cannot target itself"),
        ((RolloutTarget("v1", -1),), "0 or more"),
        ((RolloutTarget("v1", float("nan")),), "0 or more"),
        ((RolloutTarget("v1", float("inf")),), "0 or more"),
        ((RolloutTarget("v1", 0),), "not all be 0"),
        (
            (
                RolloutTarget("v1", 1, frozenset({"beta"})),
                RolloutTarget("v2", 1, frozenset({"beta"})),
            ),
            "pinned twice",
        ),
        (tuple(RolloutTarget(f"m{i}", 1) for i in range(17)), "1 to 16 targets"),
    ],
)
def test_a_bad_rollout_is_refused(targets: tuple[RolloutTarget, ...], message: str) -> None:
    with pytest.raises(InvalidParameterError, match=message):
        Rollout("support", targets)


def test_the_flags_form() -> None:
    assert parse_rollout("support=v1:90,v2:10") == CANARY
    assert parse_rollout("s=v1:1,v2") == Rollout("s", (RolloutTarget("v1", 1), RolloutTarget("v2")))
    assert parse_rollout("s=org/model:v3:2").targets == (RolloutTarget("org/model:v3", 2),)
    for bad in ("support", "support=", "s=v1:lots", "s=v1:0"):
        with pytest.raises(InvalidParameterError) as e:
            parse_rollout(bad)
        assert e.value.param == "model_rollout"


def served(*rollouts: Rollout) -> ServedModels:
    return ServedModels(["base", "v1", "v2"], "weights", rollouts=rollouts)


def test_served_models_resolve_a_rollout_to_its_pick() -> None:
    models = served(CANARY)
    entry = models.resolve("support", tenant="acme", sticky="user-1")
    assert entry.id in ("v1", "v2") and entry.rollout == "support"
    assert entry.grants == ("support", "base") and entry.root == "weights"
    assert models.resolve("v1").rollout is None
    assert [e.id for e in models.entries()] == ["base", "v1", "v2", "support"]
    assert models.remove_rollout("support") == CANARY
    with pytest.raises(ModelNotFoundError):
        models.resolve("support")
    assert models.remove_rollout("support") is None


def test_a_rollout_must_name_served_models() -> None:
    models = served()
    with pytest.raises(InvalidParameterError, match="not a served model name"):
        models.set_rollout(Rollout("s", (RolloutTarget("v9", 1),)))
    with pytest.raises(InvalidParameterError, match="is a served model's"):
        models.set_rollout(Rollout("v1", (RolloutTarget("v2", 1),)))
    models.set_rollout(Rollout("s", (RolloutTarget("v1", 1),)))
    with pytest.raises(InvalidParameterError, match="is a rollout"):
        models.set_rollout(Rollout("t", (RolloutTarget("s", 1),)))
    with pytest.raises(InvalidParameterError) as e:  # at start-up: the flag is named
        served(Rollout("s", (RolloutTarget("v9", 1),)))
    assert e.value.param == "model_rollout"
    # Replacing a rollout gives the one it replaced (a rollback).
    back = Rollout("s", (RolloutTarget("v2", 1),))
    assert models.set_rollout(back) == Rollout("s", (RolloutTarget("v1", 1),))
    assert models.resolve("s").id == "v2"


def feed(book: RolloutBook, target: str, failures: int, successes: int) -> list[object]:
    events = [book.outcome("support", target, True) for _ in range(failures)]
    events += [book.outcome("support", target, False) for _ in range(successes)]
    return [e for e in events if e is not None]


def test_a_failing_canary_is_rolled_back_by_itself() -> None:
    models = served(CANARY)
    book = RolloutBook(models)
    assert feed(book, "v1", 0, 30) == []
    assert feed(book, "v2", 4, 15) == []  # 19 requests: not enough to judge
    (event,) = feed(book, "v2", 1, 0)  # the 20th: 5 of 20 failed, 25 %
    assert (event.rollout, event.target, event.requests) == ("support", "v2", 20)  # type: ignore[attr-defined]
    assert event.error_rate == 0.25  # type: ignore[attr-defined]
    (rollout,) = models.rollouts()
    assert rollout.shares() == {"v1": 1.0, "v2": 0.0}
    assert {models.resolve("support", sticky=f"u{i}").id for i in range(50)} == {"v1"}
    assert book.rollbacks("support") == [event]
    assert feed(book, "v2", 30, 0) == []  # already out
    # Set again (a new decision): the history starts afresh.
    book.set(CANARY)
    assert book.rollbacks("support") == [] and feed(book, "v2", 10, 9) == []


def test_no_rollback_without_a_healthier_target_or_with_the_policy_off() -> None:
    models = served(CANARY)
    book = RolloutBook(models)
    feed(book, "v1", 20, 0)  # the baseline fails as badly
    assert feed(book, "v2", 20, 0) == []
    off = Rollout("support", CANARY.targets, rollback=None)
    book.set(off)
    assert feed(book, "v2", 50, 0) == []
    # A pinned-only target (weight 0) is rolled back too: its tenants go by weight.
    pinned = Rollout(
        "support",
        (RolloutTarget("v1", 1), RolloutTarget("v2", 0, frozenset({"beta"}))),
        RollbackPolicy(max_error_rate=0.5, min_requests=4, window=10),
    )
    book.set(pinned)
    assert len(feed(book, "v2", 2, 2)) == 1
    assert models.resolve("support", tenant="beta").id == "v1"


@pytest.mark.parametrize(
    ("rate", "least", "window"), [(0, 20, 100), (1.5, 20, 100), (0.2, 0, 100), (0.2, 50, 10)]
)
def test_a_bad_rollback_policy_is_refused(rate: float, least: int, window: int) -> None:
    with pytest.raises(InvalidParameterError):
        RollbackPolicy(rate, least, window)


class ListStore:
    """A rollout store in a dict (the port's contract is held in tests/contract)."""

    def __init__(self, *rollouts: Rollout) -> None:
        self.rollouts = {r.name: r for r in rollouts}
        self.changes = 0

    def load(self) -> list[Rollout]:
        return sorted(self.rollouts.values(), key=lambda r: r.name)

    def save(self, rollout: Rollout) -> None:
        self.rollouts[rollout.name] = rollout
        self.changes += 1

    def delete(self, name: str) -> None:
        self.rollouts.pop(name, None)
        self.changes += 1

    def version(self) -> int:
        return self.changes


def test_the_book_serves_the_store_over_the_flags_and_stores_rollbacks() -> None:
    flag = Rollout("support", (RolloutTarget("v1", 1),))
    other_flag = Rollout("other", (RolloutTarget("v2", 1),))
    store = ListStore(CANARY)
    models = served(flag, other_flag)
    book = RolloutBook(models, store)
    book.start()
    assert models.rollouts() == [other_flag, CANARY]  # the stored one won; the new flag kept
    assert store.rollouts["other"] == other_flag
    feed(book, "v1", 0, 30)
    feed(book, "v2", 20, 0)
    assert store.rollouts["support"].shares() == {"v1": 1.0, "v2": 0.0}  # stored as it happened
    # A stored rollout this server cannot serve (another server's models) is skipped.
    store.save(Rollout("foreign", (RolloutTarget("their-model", 1),)))
    assert book.sync() and "foreign" not in [r.name for r in models.rollouts()]
    with pytest.raises(InvalidParameterError):
        book.set(Rollout("bad", (RolloutTarget("v9", 1),)))
    assert "bad" not in store.rollouts  # checked before it is stored
