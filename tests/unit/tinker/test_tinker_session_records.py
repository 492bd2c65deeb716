"""The bounded in-memory records behind the sampling-session and admin routes: completion
queues (cursors, acknowledgements, caps), the audit log, usage buckets and session traces."""

import asyncio
import json
from datetime import date

import pytest

from application.tinker.activity_log import AuditLog
from application.tinker.billing import HOUR_S, UsageMeter
from application.tinker.completions import CLONE_SPAN, Completions
from application.tinker.downloads import LinkRefusedError
from application.tinker.futures import FutureStore
from application.tinker.sampling import SamplerRecord
from application.tinker.traces import SessionTraces
from domain.observer import TrainingOpStats
from domain.tinker.errors import InvalidTrainingRequest, NotFoundError
from domain.tinker.values import WeightsSource

SAMPLER = SamplerRecord("s-1:sample:0", "alice", "s-1", WeightsSource("m"))


async def test_completions_go_to_their_clone_in_cursor_order() -> None:
    futures = FutureStore()
    completions = Completions(futures)
    assert completions.join(SAMPLER) == 1 and completions.join(SAMPLER) == 2
    made = [futures.create("alice", "Sample") for _ in range(3)]
    for seq_id, future in zip([0, CLONE_SPAN, 1], made, strict=True):
        completions.track(SAMPLER, seq_id, future)
    futures.resolve(made[2], "x")
    futures.resolve(made[1], "y")
    futures.fail(made[0], NotFoundError("gone"))
    clone0 = await completions.retrieve(SAMPLER, 0, 0, 0, [])
    assert [(c.request_id, c.ok) for c in clone0.completions] == [
        (made[2].id, True),
        (made[0].id, False),
    ]
    clone1 = await completions.retrieve(SAMPLER, 1, 0, 0, [])
    assert [c.request_id for c in clone1.completions] == [made[1].id]
    # Cursors are increasing across clones; seen events are dropped, acks drop futures.
    assert clone1.completions[0].cursor < clone0.completions[1].cursor
    again = await completions.retrieve(SAMPLER, 0, clone0.cursor, 0, [made[2].id, "req-x"])
    assert again.completions == [] and again.cursor == clone0.cursor
    assert completions.queued() == 1  # clone 1's, not yet seen
    with pytest.raises(NotFoundError):
        futures.get("alice", made[2].id)
    futures.get("alice", made[0].id)  # not acknowledged: kept
    # Another clone cannot acknowledge (drop) clone 0's futures.
    await completions.retrieve(SAMPLER, 1, 0, 0, [made[0].id])
    futures.get("alice", made[0].id)


async def test_a_long_poll_wakes_on_a_completion_and_on_the_session_end() -> None:
    futures = FutureStore()
    completions = Completions(futures)
    future = futures.create("alice", "Sample")
    completions.track(SAMPLER, 0, future)
    poll = asyncio.ensure_future(completions.retrieve(SAMPLER, 0, 0, 30, []))
    await asyncio.sleep(0.05)
    assert not poll.done()
    futures.resolve(future, "x")
    assert [c.request_id for c in (await asyncio.wait_for(poll, 5)).completions] == [future.id]
    waiting = asyncio.ensure_future(completions.retrieve(SAMPLER, 0, 99, 30, []))
    await asyncio.sleep(0.05)
    completions.end_session("s-1")
    assert (await asyncio.wait_for(waiting, 5)).completions == []
    assert completions.queued() == 0


async def test_completion_queues_are_bounded() -> None:
    futures = FutureStore()
    completions = Completions(futures, max_events=3, max_clones=2)
    for _ in range(5):
        future = futures.create("alice", "Sample")
        completions.track(SAMPLER, 0, future)
        futures.resolve(future, "x")
    assert completions.queued() == 3  # the oldest dropped
    for clone in (1, 2, 3):
        future = futures.create("alice", "Sample")
        completions.track(SAMPLER, clone * CLONE_SPAN, future)
        futures.resolve(future, "x")
    assert completions.queued() == 2  # clones 2 and 3 kept: 0 and 1 dropped


async def test_bad_polls_are_refused() -> None:
    completions = Completions(FutureStore())
    for clone, cursor, wait in [(-1, 0, 0.0), (CLONE_SPAN + 1, 0, 0.0), (0, -1, 0.0), (0, 0, -1.0)]:
        with pytest.raises(InvalidTrainingRequest):
            await completions.retrieve(SAMPLER, clone, cursor, wait, [])


async def test_a_cancelled_future_fails_even_before_its_task_starts() -> None:
    futures = FutureStore()
    started = False

    async def work() -> object:
        nonlocal started
        started = True
        return "x"

    future = futures.run("alice", "Sample", work)
    assert futures.cancel(future)
    assert future.finished and future.error is not None and future.error.category == "user"
    await asyncio.sleep(0)
    assert not started and not futures.cancel(future)


def test_the_audit_log_keeps_each_tenants_newest_entries_by_day() -> None:
    now = [86_400.0 * 20_000 + 10]  # 2024-10-04, 00:00:10 UTC
    audit = AuditLog(max_entries=3, max_tenants=2, wall_clock=lambda: now[0])
    for i in range(5):
        audit.record("alice", "checkpoint", "create", {"i": i})
    assert [e.details["i"] for e in audit.entries("alice")] == [2, 3, 4]
    assert audit.entries("alice", event_type="projects") == []
    assert audit.entries("alice", day=date(2024, 10, 3)) == []
    audit.record("bob", "session", "create")
    audit.record("carol", "session", "create")
    assert audit.entries("alice") == []  # the least recently active tenant dropped
    assert audit.entries("bob")[0].details["actor"] == "tml:user:bob"
    with pytest.raises(InvalidTrainingRequest):
        audit.entries("bob", event_type="sessions")


def test_usage_buckets_by_hour_drop_the_oldest_past_the_retention_or_the_cap() -> None:
    now = [100 * HOUR_S + 5.0]
    usage = UsageMeter(
        lambda _: None, retention_s=3 * HOUR_S, max_buckets=4, wall_clock=lambda: now[0]
    )
    usage.add("alice", "training", 10, base_model="m", session_id="s")
    usage.add("alice", "training", 5, base_model="m", session_id="s")
    usage.add("alice", "sampling_sample", 0, base_model="m", session_id="s")  # nothing
    [event] = usage.events("alice", 100 * HOUR_S, 101 * HOUR_S)
    assert (event.key.kind, event.quantity) == ("training", 15)
    now[0] += 4 * HOUR_S  # past the retention
    usage.add("alice", "checkpoint", 1, base_model="m", session_id="s")
    assert usage.events("alice", 100 * HOUR_S, 101 * HOUR_S) == []
    for i in range(5):  # five rows in one more hour: the cap drops the older hour
        usage.add("alice", "training", 1, base_model=f"m{i}", session_id=None)
    now[0] += HOUR_S
    usage.add("alice", "training", 1, base_model="m", session_id=None)
    assert usage.events("alice", 104 * HOUR_S, 105 * HOUR_S) == []
    assert len(usage.events("alice", 105 * HOUR_S, 106 * HOUR_S)) == 1
    usage.on_training_op(TrainingOpStats("Sample", "alice", 0, 1, True, 99))  # not training
    assert sum(e.quantity for e in usage.events("alice", 105 * HOUR_S, 106 * HOUR_S)) == 1
    with pytest.raises(InvalidTrainingRequest):
        usage.events("alice", 105 * HOUR_S + 1, 106 * HOUR_S)


def test_session_traces_are_bounded_and_their_links_signed() -> None:
    now = [1_000_000.0]
    traces = SessionTraces(
        lambda: b"k", max_ops=2, max_sessions=1, wall_clock=lambda: now[0], clock=lambda: 10.0
    )
    for op in ("CreateModel", "ForwardBackward", "OptimStep"):
        traces.on_training_op(TrainingOpStats(op, "alice", 9.0, 9.5, True, 7, "r", "s-1"))
    link = traces.link("s-1")
    trace = json.loads(traces.export("s-1", link.expires, link.signature))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["ForwardBackward", "OptimStep"]
    assert spans[0]["ts"] == round((1_000_000.0 - 1.0) * 1e6) and spans[0]["dur"] == 500_000
    with pytest.raises(LinkRefusedError):
        traces.export("s-2", link.expires, link.signature)  # another session's link
    traces.on_training_op(TrainingOpStats("Sample", "alice", 9.0, 9.5, True, 0, None, "s-2"))
    assert traces.ops("s-1") == []  # one session kept
    now[0] += 7200
    with pytest.raises(LinkRefusedError):
        traces.export("s-1", link.expires, link.signature)  # expired
