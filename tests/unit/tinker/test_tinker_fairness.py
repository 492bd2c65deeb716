"""Issue 11 §5: Tinker work isolated per tenant — the FairScheduler (training pieces, tenants
taking turns), FairSlots (sampling requests in the engine) and the TrainingController's
per-key limits (runs, rank, tokens, waiting requests and bytes, seq_id bounds)."""

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from adapters.storage.checkpoints import FileCheckpointStorage
from application.tinker.checkpoints import CheckpointStore
from application.tinker.fair import FairScheduler, FairSlots
from application.tinker.futures import FutureStore
from application.tinker.training import TrainingController
from domain.observer import TrainingOpStats
from domain.tinker.batch import ForwardBackwardInput, ForwardBackwardResult
from domain.tinker.checks import check_adam
from domain.tinker.errors import InvalidTrainingRequest, RetryLaterError, SequenceConflictError
from domain.tinker.ports import Steps, TrainingBackend, one_step, run_steps
from domain.tinker.values import (
    AdamParams,
    BaseModelInfo,
    Datum,
    LoraSpec,
    TensorValue,
    TinkerLimits,
)

# --- FairScheduler ------------------------------------------------------------------------


def pieces(log: list[str], name: str, n: int) -> Steps[str]:
    for i in range(n):
        if i:
            yield
        log.append(f"{name}{i}")
    return name


async def test_a_long_job_takes_turns_with_other_tenants_piece_by_piece() -> None:
    scheduler, log = FairScheduler(), list[str]()
    long = asyncio.ensure_future(scheduler.run("tenant-a", pieces(log, "A", 20)))
    await asyncio.sleep(0)
    short = asyncio.ensure_future(scheduler.run("tenant-b", pieces(log, "B", 1)))
    assert await short == "B" and await long == "A"
    # B's one-piece step runs after at most a piece or two of A's twenty, not after all.
    assert log.index("B0") <= 2, log
    assert len(scheduler) == 0


async def test_tenants_take_turns_round_robin_and_jobs_within_a_tenant_too() -> None:
    scheduler, log = FairScheduler(), list[str]()
    jobs = [
        scheduler.run("a", pieces(log, "a1-", 3)),
        scheduler.run("a", pieces(log, "a2-", 3)),
        scheduler.run("b", pieces(log, "b1-", 3)),
    ]
    await asyncio.gather(*jobs)
    # Tenant a's two jobs share a's turns: b gets every other piece.
    assert log[:6] == ["a1-0", "b1-0", "a2-0", "b1-1", "a1-1", "b1-2"], log


async def test_a_failing_or_cancelled_job_does_not_stop_the_others() -> None:
    scheduler, log = FairScheduler(), list[str]()

    def bad() -> Steps[None]:
        yield
        raise InvalidTrainingRequest("bad data")

    failing = scheduler.run("a", bad())
    cancelled = asyncio.ensure_future(scheduler.run("a", pieces(log, "c", 10_000)))
    fine = scheduler.run("b", pieces(log, "f", 3))
    for _ in range(1000):  # bounded: until the long job has run a piece
        if "c0" in log:
            break
        await asyncio.sleep(0.001)
    cancelled.cancel()
    with pytest.raises(InvalidTrainingRequest):
        await failing
    assert await fine == "f"
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert len([p for p in log if p.startswith("c")]) < 10_000  # dropped before its end
    assert len(scheduler) == 0
    await scheduler.close()


async def test_pieces_never_run_at_the_same_time() -> None:
    scheduler, running, overlaps = FairScheduler(), [0], []
    lock = threading.Lock()

    def job() -> Steps[None]:
        for _ in range(5):
            with lock:
                running[0] += 1
                overlaps.append(running[0])
            threading.Event().wait(0.001)
            with lock:
                running[0] -= 1
            yield

    await asyncio.gather(*(scheduler.run(f"t{i}", job()) for i in range(4)))
    assert max(overlaps) == 1


def test_run_steps_and_one_step() -> None:
    log: list[str] = []
    assert run_steps(pieces(log, "x", 3)) == "x" and log == ["x0", "x1", "x2"]
    assert run_steps(one_step(lambda: 7)) == 7


# --- FairSlots ----------------------------------------------------------------------------


async def test_slots_bound_holders_and_tenants_take_turns_for_freed_ones() -> None:
    slots, order, most = FairSlots(2), [], [0]

    async def use(tenant: str, i: int) -> None:
        async with slots.slot(tenant):
            most[0] = max(most[0], slots.held)
            order.append(f"{tenant}{i}")
            await asyncio.sleep(0.001)

    # Tenant a asks for 6 slots first, then b for 2: b does not wait for all of a's.
    tasks = [asyncio.ensure_future(use("a", i)) for i in range(6)]
    await asyncio.sleep(0)
    tasks += [asyncio.ensure_future(use("b", i)) for i in range(2)]
    await asyncio.gather(*tasks)
    assert most[0] == 2
    assert order.index("b1") < order.index("a5"), order
    assert slots.held == 0


async def test_a_cancelled_waiter_gives_its_place_up() -> None:
    slots = FairSlots(1)
    async with slots.slot("a"):
        waiter = asyncio.ensure_future(slots._acquire("b"))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    assert slots.held == 0
    async with slots.slot("c"):
        assert slots.held == 1


# --- TrainingController limits ------------------------------------------------------------


class PiecewiseBackend(TrainingBackend):
    """One piece per datum; records each piece as (model id, datum index)."""

    def __init__(self) -> None:
        self.pieces: list[tuple[str, int]] = []

    @property
    def base_models(self) -> Sequence[BaseModelInfo]:
        return [BaseModelInfo("base", 4096, "toy", "")]

    def create(self, model_id: str, base_model: str, lora: LoraSpec) -> None:
        pass

    def forward_backward_steps(
        self, model_id: str, batch: ForwardBackwardInput, *, backward: bool
    ) -> Steps[ForwardBackwardResult]:
        for i in range(len(batch.data)):
            if i:
                yield
            self.pieces.append((model_id, i))
        outs = [{"logprobs": TensorValue.floats([0.0] * len(d.tokens))} for d in batch.data]
        return ForwardBackwardResult(outs, {"loss:sum": 0.0})

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        return {}

    def save(self, model_id: str, folder: Path, *, optimizer: bool) -> None:
        pass

    def load(self, model_id: str, folder: Path, *, optimizer: bool) -> None:
        pass

    def release(self, model_id: str) -> None:
        pass


def datum(n: int = 4) -> Datum:
    return Datum(list(range(1, n + 1)), {"target_tokens": TensorValue.ints(list(range(n)))})


def make(tmp_path: Path, **limits: int) -> tuple[TrainingController, PiecewiseBackend]:
    backend = PiecewiseBackend()
    store = CheckpointStore(FileCheckpointStorage(tmp_path))
    limit = TinkerLimits(**limits)
    return TrainingController(backend, store, FutureStore(), limits=limit), backend


async def new_run(training: TrainingController, owner: str, session: str) -> str:
    future = training.create(owner, session, 0, "base", LoraSpec(4), None)
    done = await training.futures.wait(owner, future.id, 5)
    assert done.error is None
    return f"{session}:train:0"


async def test_one_tenants_long_step_does_not_serialize_another_tenants(tmp_path: Path) -> None:
    training, backend = make(tmp_path)
    big = await new_run(training, "tenant-a", "sa")
    small = await new_run(training, "tenant-b", "sb")
    long = training.forward_backward(
        "tenant-a", big, 1, [datum() for _ in range(48)], "cross_entropy", {}, forward_only=False
    )
    await asyncio.sleep(0)
    short = training.forward_backward(
        "tenant-b", small, 1, [datum()], "cross_entropy", {}, forward_only=False
    )
    await training.futures.wait("tenant-b", short.id, 5)
    await training.futures.wait("tenant-a", long.id, 5)
    assert long.error is None and short.error is None
    # The other tenant's step ran after a few of the 48 pieces, not after all of them.
    assert backend.pieces.index((small, 0)) <= 3, backend.pieces[:6]


async def test_runs_per_key_and_lora_rank_are_capped(tmp_path: Path) -> None:
    training, _ = make(tmp_path, max_runs_per_key=2, max_lora_rank=16)
    with pytest.raises(InvalidTrainingRequest, match=r"rank must be in 1\.\.16"):
        training.create("me", "s", 0, "base", LoraSpec(32), None)
    await new_run(training, "me", "s1")
    await new_run(training, "me", "s2")
    with pytest.raises(InvalidTrainingRequest, match="training runs loaded"):
        training.create("me", "s3", 0, "base", LoraSpec(4), None)
    await new_run(training, "someone-else", "s4")  # the cap is per key
    training.end_session("s1", "finished")
    await new_run(training, "me", "s5")  # an ended run frees its place


async def test_tokens_per_forward_backward_are_capped(tmp_path: Path) -> None:
    training, _ = make(tmp_path, max_tokens_per_request=10)
    run = await new_run(training, "me", "s")
    with pytest.raises(InvalidTrainingRequest, match="12 tokens in one request"):
        training.forward_backward(
            "me", run, 1, [datum(6), datum(6)], "cross_entropy", {}, forward_only=False
        )
    training.forward_backward(
        "me", run, 1, [datum(5), datum(5)], "cross_entropy", {}, forward_only=False
    )


async def test_seq_ids_far_ahead_are_refused_not_parked(tmp_path: Path) -> None:
    training, _ = make(tmp_path, max_seq_ahead=100)
    run = await new_run(training, "me", "s")
    for seq_id in (10**30, 2**31, 101):
        with pytest.raises(SequenceConflictError, match="too far ahead"):
            training.optim_step("me", run, seq_id, AdamParams())
    # An unnumbered request is not queued behind a huge seq_id: it runs now.
    done = await training.futures.wait(
        "me", training.optim_step("me", run, None, AdamParams()).id, 5
    )
    assert done.finished and done.error is None
    assert training.optim_step("me", run, 100, AdamParams())  # within the window: waits


async def test_requests_waiting_per_run_are_capped_in_number_and_bytes(tmp_path: Path) -> None:
    training, _ = make(tmp_path, max_pending_requests=3, max_pending_bytes=1000)
    run = await new_run(training, "me", "s")
    for seq_id in (2, 3, 4):  # seq 1 has not come: these wait
        training.optim_step("me", run, seq_id, AdamParams())
    with pytest.raises(RetryLaterError, match="waiting"):
        training.optim_step("me", run, 5, AdamParams())
    first = training.optim_step("me", run, 1, AdamParams())  # the next in line is always taken
    await training.futures.wait("me", first.id, 5)
    other = await new_run(training, "me", "t")
    big = [datum(50)]  # 50 tokens: 4 * 50 + 8 * 50 = 600 estimated bytes
    training.forward_backward("me", other, 2, big, "cross_entropy", {}, forward_only=False)
    with pytest.raises(RetryLaterError, match="bytes"):
        training.forward_backward("me", other, 3, big, "cross_entropy", {}, forward_only=False)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("learning_rate", 1e38),
        ("learning_rate", float("nan")),
        ("learning_rate", float("inf")),
        ("learning_rate", -1e-4),
        ("beta1", 1.0),
        ("beta2", float("nan")),
        ("eps", float("inf")),
        ("weight_decay", 1e30),
        ("grad_clip_norm", float("inf")),
    ],
)
def test_adam_params_out_of_range_are_user_errors(field: str, value: float) -> None:
    params = AdamParams(**{field: value})
    with pytest.raises(InvalidTrainingRequest, match=field) as caught:
        check_adam(params)
    assert caught.value.category == "user"


def test_serve_flags_set_the_limits_and_refuse_nonsense() -> None:
    from domain.errors import InvalidParameterError
    from entrypoints.cli import _parser
    from entrypoints.config.tinker import tinker_limits

    defaults = tinker_limits(_parser().parse_args(["serve"]), max_num_seqs=6)
    assert defaults == TinkerLimits(max_sample_requests=6)
    flags = "--tinker-max-lora-rank 32 --tinker-max-pending-mib 2 "
    flags += "--tinker-max-sample-requests 3 --tinker-max-runs-per-key 1"
    args = _parser().parse_args(["serve", *flags.split()])
    limits = tinker_limits(args, max_num_seqs=6)
    assert (limits.max_lora_rank, limits.max_pending_bytes) == (32, 2 << 20)
    assert (limits.max_sample_requests, limits.max_runs_per_key) == (3, 1)
    with pytest.raises(InvalidParameterError, match="tinker_max_seq_ahead"):
        tinker_limits(_parser().parse_args(["serve", "--tinker-max-seq-ahead", "0"]), 6)


async def test_every_operation_that_ran_is_reported_to_the_observer(tmp_path: Path) -> None:
    training, _ = make(tmp_path)
    seen: list[TrainingOpStats] = []

    class Recorder:
        def on_training_op(self, stats: TrainingOpStats) -> None:
            seen.append(stats)

    training.futures.observer = Recorder()
    run = await new_run(training, "tenant-a", "sa")
    step = training.forward_backward(
        "tenant-a", run, 1, [datum(4), datum(6)], "cross_entropy", {}, forward_only=False
    )
    await training.futures.wait("tenant-a", step.id, 5)
    assert training.futures.pending() == 0
    create, fb = seen
    assert (create.op, create.ok, create.run_id, create.session_id) == (
        "CreateModel",
        True,
        run,
        "sa",
    )
    assert (fb.op, fb.tenant_id, fb.tokens, fb.ok) == ("ForwardBackward", "tenant-a", 10, True)
    assert fb.end_s >= fb.start_s
