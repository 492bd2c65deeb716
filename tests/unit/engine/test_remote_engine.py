"""The fleet's ingress engine (:class:`RemoteEngine`) over in-process "replicas": each a
real :class:`AsyncEngine` on the fake runner, reached through a dispatch that runs the
replica's side (:func:`serve_call`) as Ray Serve would, minus the processes. Routing,
retries, losses and aborts are the ingress's; Ray is only the transport."""

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from application.engine.async_engine import AsyncEngine
from application.engine.engine_client import OwnedRequests
from application.engine.remote_engine import (
    CURRENT_NOTE,
    REPLICA_LOST,
    RemoteEngine,
    ReplicaAdapters,
    ReplicaLostError,
    ReplicaNote,
    Routed,
    serve_call,
)
from domain.breaker import Breakers, BreakerSettings, Transition
from domain.config import EngineConfig
from domain.request import AdmitCall, RequestContext, StepOutput
from domain.routing import ReplicaLoad, Router, RouteRequest, RouterSettings
from domain.sampling import SamplingParams
from domain.tinker.errors import InvalidTrainingRequest
from tests.fakes import fake_async_engine

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)
BLOCK = 16


class LocalFleet:
    """Replicas in this process, placed by the domain's router; ``lose`` makes the next
    call(s) to a replica fail as a dead one would, before or after its first batch."""

    def __init__(self, count: int, policy: str = "prefix", **config: object) -> None:
        self.replicas: dict[str, AsyncEngine] = {
            f"r{i}": fake_async_engine(kv_block_size=BLOCK, **config) for i in range(count)
        }
        self.router = Router(RouterSettings(policy=policy))  # type: ignore[arg-type]
        self.calls: list[tuple[str, AdmitCall]] = []
        self.lose: dict[str, str] = {}  # replica -> "before" | "after"
        self.failing: set[str] = set()  # replicas whose engine fails every call

    def start(self) -> None:
        for engine in self.replicas.values():
            engine.start()

    async def stop(self) -> None:
        for engine in self.replicas.values():
            await engine.stop()

    async def __call__(self, route: RouteRequest, call: AdmitCall, avoid: frozenset[str]) -> Routed:
        # as the Ray router: every replica avoided, any of them
        loads = [ReplicaLoad(r) for r in self.replicas if r not in avoid]
        loads = loads or [ReplicaLoad(r) for r in self.replicas]
        replica = self.router.route(route, loads).replica_id
        self.calls.append((replica, call))
        how = self.lose.pop(replica, None)
        if how == "before":
            raise ReplicaLostError(replica, "killed")
        return Routed(replica, self._outputs(replica, call, how))

    async def _outputs(
        self, replica: str, call: AdmitCall, how: str | None
    ) -> AsyncIterator[list[StepOutput]]:
        if replica in self.failing:  # as an engine whose every step fails
            error = "internal error: the engine step failed (details in the server log)"
            yield [
                StepOutput(rid, None, "", finished=True, error=error) for rid in call.request_ids
            ]
            return
        async for batch in serve_call(self.replicas[replica], call):
            yield batch
            if how == "after":
                raise ReplicaLostError(replica, "killed mid-stream")


def remote(fleet: LocalFleet, replicas: int | None = None, **options: Any) -> RemoteEngine:
    """A started RemoteEngine over ``fleet`` (``replicas``: how many serve, all by default;
    ``options``: RemoteEngine's)."""
    any_engine = next(iter(fleet.replicas.values()))
    engine = RemoteEngine(
        EngineConfig(kv_block_size=BLOCK),
        any_engine.inputs.tokenizer,
        fleet,
        replicas=len(fleet.replicas) if replicas is None else replicas,
        **options,
    )
    engine.start()
    return engine


async def read_all(stream: AsyncIterator[StepOutput]) -> list[StepOutput]:
    return [o async for o in stream]


def hold_r0(fleet: LocalFleet) -> OwnedRequests:
    """Replica r0's one slot and one waiting place taken by two long sequences; their
    group (close it to free them)."""
    hold = fleet.replicas["r0"].group()
    long = SamplingParams(max_tokens=10_000, ignore_eos=True)
    hold.admit(AdmitCall(("held-0", "held-1"), ([1, 2, 3], [1, 2, 4]), long))
    return hold


@pytest.fixture
async def fleet():
    fleet = LocalFleet(2)
    fleet.start()
    yield fleet
    await fleet.stop()


async def test_each_choice_streams_what_a_local_engine_gives(fleet: LocalFleet) -> None:
    engine = remote(fleet)
    prompt = await engine.inputs.prepare("hello there", PARAMS)
    group = engine.group()
    streams = group.admit(AdmitCall(("a-0", "a-1"), (prompt,), PARAMS, 2))
    outputs = await asyncio.gather(*(read_all(s) for s in streams))

    local = fake_async_engine(kv_block_size=BLOCK)
    local.start()
    expected = await read_all(await local.stream("x", prompt, PARAMS))
    await local.stop()
    for request_id, out in zip(["a-0", "a-1"], outputs, strict=True):
        assert [o.request_id for o in out] == [request_id] * len(expected)
        assert [o.token_id for o in out] == [o.token_id for o in expected]
        assert out[-1].finished and out[-1].error is None
    assert len(fleet.calls) == 1  # every choice of one admit on one replica
    await engine.stop()


async def test_prompts_sharing_a_prefix_go_to_the_replica_that_cached_it(
    fleet: LocalFleet,
) -> None:
    engine = remote(fleet)
    system = "You are a careful assistant. " * 4
    for user in ["first question", "second one", "a third"]:
        prompt = await engine.inputs.prepare(system + user, PARAMS)
        [stream] = engine.group().admit(AdmitCall((user,), (prompt,), PARAMS))
        await read_all(stream)
    assert len({replica for replica, _ in fleet.calls}) == 1
    await engine.stop()


async def test_a_replica_lost_before_any_output_is_retried_once_elsewhere(
    fleet: LocalFleet,
) -> None:
    engine = remote(fleet)
    fleet.lose = {"r0": "before", "r1": "before"}
    prompt = await engine.inputs.prepare("retry me", PARAMS)
    [stream] = engine.group().admit(AdmitCall(("x",), (prompt,), PARAMS))
    out = await read_all(stream)
    # Both replicas were lost once: the retry went to the other, which was lost too.
    first, second = (r for r, _ in fleet.calls)
    assert first != second
    assert out[-1].error == REPLICA_LOST

    fleet.lose = {"r0": "before"}
    fleet.router = Router(RouterSettings(policy="round-robin"))  # r0 first
    [stream] = engine.group().admit(AdmitCall(("y",), (prompt,), PARAMS))
    out = await read_all(stream)
    assert out[-1].finished and out[-1].error is None
    assert [r for r, _ in fleet.calls][-2:] == ["r0", "r1"]
    await engine.stop()


async def test_a_replica_lost_after_output_ends_the_stream_with_an_error(
    fleet: LocalFleet,
) -> None:
    engine = remote(fleet)
    fleet.router = Router(RouterSettings(policy="round-robin"))
    fleet.lose = {"r0": "after"}
    prompt = await engine.inputs.prepare("half an answer", PARAMS)
    [stream] = engine.group().admit(AdmitCall(("z",), (prompt,), PARAMS))
    out = await asyncio.wait_for(read_all(stream), 10)
    assert out[0].error is None and out[-1].error == REPLICA_LOST
    assert len(fleet.calls) == 1  # not retried: the client had output already
    await engine.stop()


async def test_a_full_replica_passes_the_call_to_another() -> None:
    fleet = LocalFleet(2, policy="round-robin", max_num_seqs=1, max_waiting_requests=1)
    fleet.start()
    engine = remote(fleet)
    hold = hold_r0(fleet)
    [stream] = engine.group().admit(AdmitCall(("passed",), ([4, 5, 6],), PARAMS))
    out = await asyncio.wait_for(read_all(stream), 10)
    assert out[-1].finished and out[-1].error is None
    assert [r for r, _ in fleet.calls] == ["r0", "r1"]
    hold.close()
    await engine.stop()
    await fleet.stop()


async def test_a_replicas_refusal_ends_the_streams_with_its_error() -> None:
    fleet = LocalFleet(1, max_num_seqs=1, max_waiting_requests=1)
    fleet.start()
    engine = remote(fleet)
    hold = hold_r0(fleet)
    [stream] = engine.group().admit(AdmitCall(("refused",), ([4, 5, 6],), PARAMS))
    out = await asyncio.wait_for(read_all(stream), 10)
    assert out[-1].error is not None and out[-1].error.startswith("the engine is full")
    hold.close()
    await engine.stop()
    await fleet.stop()


async def test_closing_the_group_aborts_the_call_on_its_replica(fleet: LocalFleet) -> None:
    engine = remote(fleet)
    group = engine.group()
    long = SamplingParams(max_tokens=10_000, ignore_eos=True)
    [stream] = group.admit(AdmitCall(("long",), ([1, 2, 3, 4, 5],), long))
    first = await anext(stream)
    assert first.error is None
    [(replica, _)] = fleet.calls
    group.close()
    for _ in range(200):
        await asyncio.sleep(0.01)
        if not fleet.replicas[replica].engine.has_work():
            break
    assert not fleet.replicas[replica].engine.has_work()
    assert engine.room() == engine.capacity
    await engine.stop()


async def test_the_note_names_the_replica_each_call_went_to(fleet: LocalFleet) -> None:
    engine = remote(fleet)
    note = ReplicaNote()
    token = CURRENT_NOTE.set(note)
    try:
        [stream] = engine.group().admit(AdmitCall(("n",), ([7, 8, 9],), PARAMS))
    finally:
        CURRENT_NOTE.reset(token)
    await asyncio.wait_for(note.routed.wait(), 5)
    assert note.replicas == [fleet.calls[0][0]]
    await read_all(stream)
    await engine.stop()


async def test_the_note_names_the_replica_that_answered_a_call_run_again(
    fleet: LocalFleet,
) -> None:
    """A call its first replica failed before any output ran again on the other: the note
    (``x-infer-replica``) names the one that answered, not the one that failed."""
    engine = remote(fleet, 2)
    fleet.failing.add("r0")  # the router's first choice on a tie
    note = ReplicaNote()
    token = CURRENT_NOTE.set(note)
    try:
        prompt = await engine.inputs.prepare("note me", PARAMS)
        [stream] = engine.group().admit(AdmitCall.one("n", prompt, PARAMS))
    finally:
        CURRENT_NOTE.reset(token)
    out = await read_all(stream)
    assert out[-1].error is None and out[-1].finished
    assert [replica for replica, _ in fleet.calls] == ["r0", "r1"]
    assert note.replicas == ["r1"]
    await engine.stop()


async def test_the_callers_context_and_trace_travel_with_the_call(fleet: LocalFleet) -> None:
    engine = remote(fleet)
    trace = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)
    context = RequestContext(tenant_id="acme", priority=2, trace=trace)
    [stream] = engine.group(context).admit(AdmitCall(("t",), ([1, 2, 3],), PARAMS, context=context))
    await read_all(stream)
    [(_, call)] = fleet.calls
    assert call.context == context  # the replica's engine spans continue the caller's trace
    await engine.stop()


class RecordingAdapters:
    """A replica's LoRA serving as far as a call needs it: what it holds, pins and loads."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.pinned_now: set[str] = set()
        self.loads: list[tuple[str, Path]] = []

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self.held

    def load_folder(self, adapter_id: str, folder: Path) -> None:
        self.loads.append((adapter_id, folder))
        self.held.add(adapter_id)

    @contextmanager
    def pinned(self, adapter_id: str) -> Iterator[None]:
        self.pinned_now.add(adapter_id)
        try:
            yield
        finally:
            self.pinned_now.discard(adapter_id)


async def test_a_call_names_its_adapters_folder_for_a_replica_to_load(
    fleet: LocalFleet, tmp_path: Path
) -> None:
    served = ReplicaAdapters("adapter_model.safetensors")
    served.load_folder("path:ckpt", tmp_path)  # as ServedModels.use does for a checkpoint
    engine = remote(fleet, 2, adapters=served)
    [stream] = engine.group().admit(AdmitCall(("x",), ([1, 2, 3],), PARAMS, adapter_id="path:ckpt"))
    assert (await read_all(stream))[-1].error is None
    [(_, call)] = fleet.calls
    assert call.adapter_folder == tmp_path
    assert engine.route_of(call).adapter == "path:ckpt"  # routing prefers its holders
    await engine.stop()

    # The replica's side loads it where it is not held, pinned while the call runs.
    replica = RecordingAdapters()
    plain = AdmitCall(("y",), ([1, 2, 3],), PARAMS)
    batches = 0
    async for _ in serve_call(fleet.replicas["r0"], replace(call, request_ids=("z",)), replica):
        assert replica.pinned_now == {"path:ckpt"}
        batches += 1
    assert batches > 0
    assert replica.loads == [("path:ckpt", tmp_path)] and not replica.pinned_now
    async for _ in serve_call(fleet.replicas["r0"], plain, replica):
        pass
    assert replica.loads == [("path:ckpt", tmp_path)]  # no adapter: nothing loaded


def test_the_ingress_checks_a_folder_at_its_load(tmp_path: Path) -> None:
    """What a replica's load would refuse is refused at the ingress's load, nothing noted."""
    checked: list[Path] = []

    def check(folder: Path) -> None:
        checked.append(folder)
        if folder.name == "bad":
            raise InvalidTrainingRequest("an adapter of another base model")

    adapters = ReplicaAdapters("adapter_model.safetensors", check)
    with pytest.raises(InvalidTrainingRequest, match="another base model"):
        adapters.load_folder("lora:bad", tmp_path / "bad")
    adapters.load_folder("lora:good", tmp_path)
    assert "lora:bad" not in adapters and adapters.folder_of("lora:good") == tmp_path
    assert checked == [tmp_path / "bad", tmp_path]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_replica_failing_every_call_is_broken_out_and_nothing_is_lost(
    fleet: LocalFleet,
) -> None:
    """Each call its engine fails before any output runs again on the other replica; after
    ``failure_threshold`` failures its breaker opens and routing leaves it out; after the
    cool-down a probe finds it well again and it is put back."""
    clock = Clock()
    told: list[Transition] = []
    breakers = Breakers(BreakerSettings(failure_threshold=2, cooldown_s=30), clock)
    engine = remote(fleet, 2, breakers=breakers, on_breaker=told.append)
    fleet.failing.add("r0")  # the router's first choice on a tie
    for i in range(6):
        prompt = await engine.inputs.prepare(f"request {i}", PARAMS)
        [stream] = engine.group().admit(AdmitCall.one(f"q{i}", prompt, PARAMS))
        out = await read_all(stream)
        assert out[-1].error is None and out[-1].finished  # 0 lost
    sent = [replica for replica, _ in fleet.calls]
    assert sent[:4] == ["r0", "r1", "r0", "r1"]  # failed, retried elsewhere, twice
    assert set(sent[4:]) == {"r1"}  # open: left out
    assert [(t.replica_id, t.state) for t in told] == [("r0", "open")]
    fleet.failing.clear()
    clock.now = 31.0
    assert breakers.due_probes() == ["r0"]
    assert await engine.probe("r0")
    told.append(breakers.probed("r0", True))
    assert breakers.avoided() == frozenset() and told[-1].state == "closed"
    fleet.failing.add("r1")
    assert not await engine.probe("r1")  # a probe of a failing replica fails
    await engine.stop()


async def test_a_warm_standby_takes_calls_only_while_a_breaker_keeps_the_replica_out(
    fleet: LocalFleet,
) -> None:
    """One serving replica (r1) and a standby (r0, the router's first choice on a tie):
    the standby gets nothing while r1 serves; r1 failing, its calls run again on the
    standby, and once its breaker opens every call goes there."""
    breakers = Breakers(BreakerSettings(failure_threshold=2, cooldown_s=30), Clock())
    # r1 joined first: it serves
    engine = remote(fleet, 1, breakers=breakers, joined=lambda: ["r1", "r0"])

    async def call(i: int) -> None:
        prompt = await engine.inputs.prepare(f"request {i}", PARAMS)
        [stream] = engine.group().admit(AdmitCall.one(f"s{i}", prompt, PARAMS))
        out = await read_all(stream)
        assert out[-1].error is None and out[-1].finished  # 0 lost

    for i in range(3):
        await call(i)
    assert [r for r, _ in fleet.calls] == ["r1"] * 3 and engine.avoided() == {"r0"}
    fleet.failing.add("r1")
    for i in range(3, 7):
        await call(i)
    assert [r for r, _ in fleet.calls[3:]] == ["r1", "r0", "r1", "r0", "r0", "r0"]
    assert engine.avoided() == {"r1"}  # open: the standby serves
    await engine.stop()
