"""What ``retrieve_future`` says an unfinished request waits for (Tinker's queue_state)."""

import asyncio
import threading
from pathlib import Path

from application.tinker.fair import FairScheduler, FairSlots
from domain.tinker.ports import Steps
from tests.support.tinker_server import toy_service


def blocked(gate: threading.Event) -> Steps[str]:
    gate.wait(5)  # the first piece runs until the test opens the gate
    yield from ()
    return "done"


async def test_the_scheduler_counts_other_tenants_with_work_running_or_waiting() -> None:
    scheduler, gate = FairScheduler(), threading.Event()
    running = asyncio.ensure_future(scheduler.run("bob", blocked(gate)))
    await asyncio.sleep(0.05)
    assert (scheduler.others("alice"), scheduler.others("bob")) == (1, 0)  # bob's piece runs
    queued = asyncio.ensure_future(scheduler.run("carol", blocked(gate)))
    await asyncio.sleep(0)
    assert scheduler.others("alice") == 2
    gate.set()
    await asyncio.gather(running, queued)
    assert scheduler.others("alice") == 0


async def test_slots_count_a_tenants_waiters() -> None:
    slots, release = FairSlots(1), asyncio.Event()

    async def hold(tenant: str) -> None:
        async with slots.slot(tenant):
            await release.wait()

    tasks = [asyncio.ensure_future(hold(t)) for t in ("a", "b", "b")]
    await asyncio.sleep(0)
    assert (slots.waiting("a"), slots.waiting("b")) == (0, 2)
    release.set()
    await asyncio.gather(*tasks)
    assert slots.waiting("b") == 0


async def test_queue_state_is_paused_capacity_while_other_keys_use_the_trainer(
    tmp_path: Path,
) -> None:
    service, gate = toy_service(tmp_path), threading.Event()
    future = service.futures.create("alice", "ForwardBackward")
    assert service.queue_state("alice", future) == ("active", None)
    busy = asyncio.ensure_future(service.scheduler.run("bob", blocked(gate)))
    await asyncio.sleep(0.05)
    state, reason = service.queue_state("alice", future)
    assert state == "paused_capacity" and reason and "1 other key" in reason
    assert service.queue_state("bob", future)[0] == "active"  # its own work: not a pause
    gate.set()
    await busy
    assert service.queue_state("alice", future) == ("active", None)
