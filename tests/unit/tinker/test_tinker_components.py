"""FutureStore, SessionManager, CheckpointStore and the TrainingController's
sequence guard, with a recording fake backend (no torch, no HTTP)."""

import asyncio
import os
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from adapters.storage.checkpoints import FileCheckpointStorage
from application.tinker.checkpoints import CheckpointStore
from application.tinker.futures import FutureStore
from application.tinker.sessions import SessionManager
from application.tinker.training import ModelReady, SavedCheckpoint, TrainingController
from domain.tinker.batch import ForwardBackwardInput, ForwardBackwardResult
from domain.tinker.errors import (
    InvalidTrainingRequest,
    NotFoundError,
    SequenceConflictError,
    SessionClosedError,
)
from domain.tinker.ports import Steps, TrainingBackend, one_step
from domain.tinker.values import (
    AdamParams,
    BaseModelInfo,
    CheckpointRef,
    Datum,
    LoraSpec,
    TensorValue,
)
from tests.fakes import ManualClock


class RecordingBackend(TrainingBackend):
    """Records the calls it gets; each forward_backward reports the datum lengths."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.gate: asyncio.Event | None = None

    @property
    def base_models(self) -> Sequence[BaseModelInfo]:
        return [BaseModelInfo("base", 128, "toy", "", ("alias/base",))]

    def create(self, model_id: str, base_model: str, lora: LoraSpec) -> None:
        self.calls.append(("create", model_id, base_model, str(lora.rank)))

    def forward_backward_steps(
        self, model_id: str, batch: ForwardBackwardInput, *, backward: bool
    ) -> Steps[ForwardBackwardResult]:
        def run() -> ForwardBackwardResult:
            data = batch.data
            tag = ",".join(str(len(d.tokens)) for d in data)
            self.calls.append(("fb" if backward else "fwd", model_id, tag))
            outs = [{"logprobs": TensorValue.floats([0.0] * len(d.tokens))} for d in data]
            return ForwardBackwardResult(outs, {"loss:sum": float(len(data))})

        return one_step(run)

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        self.calls.append(("optim", model_id, str(params.learning_rate)))
        return {"grad_norm:mean": 1.0}

    def save(self, model_id: str, folder: Path, *, optimizer: bool) -> None:
        (folder / "adapter.bin").write_bytes(b"w" * 10)
        if optimizer:
            (folder / "optimizer.bin").write_bytes(b"o" * 5)
        self.calls.append(("save", model_id, str(optimizer)))

    def load(self, model_id: str, folder: Path, *, optimizer: bool) -> None:
        self.calls.append(("load", model_id, folder.name, str(optimizer)))

    def release(self, model_id: str) -> None:
        self.calls.append(("release", model_id))


def datum(n: int) -> Datum:
    return Datum(list(range(1, n + 1)), {"target_tokens": TensorValue.ints(list(range(n)))})


@pytest.fixture
def controller(tmp_path: Path) -> tuple[TrainingController, RecordingBackend]:
    backend = RecordingBackend()
    store = CheckpointStore(FileCheckpointStorage(tmp_path))
    return TrainingController(backend, store, FutureStore()), backend


# --- FutureStore ----------------------------------------------------------------------


async def test_future_lifecycle_pending_then_ready() -> None:
    store = FutureStore()
    gate = asyncio.Event()

    async def work() -> object:
        await gate.wait()
        return 42

    future = store.run("me", "Test", work)
    polled = await store.wait("me", future.id, timeout_s=0.01)
    assert not polled.finished  # the HTTP layer answers try_again
    gate.set()
    done = await store.wait("me", future.id, timeout_s=5)
    assert done.finished and done.result == 42 and done.error is None


async def test_future_errors_are_kept_with_their_category() -> None:
    store = FutureStore()

    async def bad_input() -> object:
        raise InvalidTrainingRequest("nope")

    async def crash() -> object:
        raise RuntimeError("boom")

    user = await store.wait("me", store.run("me", "T", bad_input).id, 5)
    server = await store.wait("me", store.run("me", "T", crash).id, 5)
    assert isinstance(user.error, InvalidTrainingRequest) and user.error.category == "user"
    assert server.error is not None and server.error.category == "server"
    # The client learns that it failed, not the server's exception text (logged instead).
    assert "boom" not in str(server.error) and "RuntimeError" not in str(server.error)
    assert server.id in str(server.error)


async def test_future_belongs_to_its_owner_and_expires() -> None:
    clock = ManualClock(1000.0)
    store = FutureStore(ttl_s=60, clock=clock)

    async def work() -> object:
        return 1

    future = store.run("me", "T", work)
    await store.wait("me", future.id, 5)
    with pytest.raises(NotFoundError):
        store.get("someone-else", future.id)
    clock.now += 61
    store.evict_expired()
    assert len(store) == 0
    with pytest.raises(NotFoundError):
        store.get("me", future.id)


# --- SessionManager -------------------------------------------------------------------


def test_heartbeats_keep_a_session_alive_and_silence_expires_it() -> None:
    clock = ManualClock(1000.0)
    sessions = SessionManager(timeout_s=30, clock=clock)
    a = sessions.create("me", tags=["x"])
    b = sessions.create("me")
    clock.now += 20
    sessions.heartbeat("me", a.id)
    before = a.last_heartbeat
    clock.now += 20
    expired = sessions.expire_stale()
    assert expired == [b] and b.ended == "expired" and a.ended is None
    assert a.last_heartbeat == before
    with pytest.raises(SessionClosedError):
        sessions.heartbeat("me", b.id)
    with pytest.raises(NotFoundError):
        sessions.heartbeat("other", a.id)
    sessions.finish("me", a.id)
    with pytest.raises(SessionClosedError):
        sessions.live("me", a.id)
    # Ended sessions are forgotten after a retention period (nothing grows forever).
    clock.now += 100
    c = sessions.create("me")
    assert sessions.forget_ended(older_than_s=50) == 2
    assert sessions.owned_by("me") == [c]
    with pytest.raises(NotFoundError):
        sessions.get("me", a.id)


# --- CheckpointStore ------------------------------------------------------------------


def test_tinker_paths_parse_and_format() -> None:
    ref = CheckpointRef.parse("tinker://s1:train:0/sampler_weights/step-2")
    assert (ref.run_id, ref.kind, ref.name) == ("s1:train:0", "sampler", "step-2")
    assert CheckpointRef.from_id("r", "weights/a").kind == "training"
    for bad in [
        "s3://x/weights/a",
        "tinker://r/weights",
        "tinker://r/other/a",
        "tinker://r/weights/",
    ]:
        with pytest.raises(InvalidTrainingRequest):
            CheckpointRef.parse(bad)


async def test_checkpoints_are_owned_listed_and_survive_a_restart(
    tmp_path: Path, controller: tuple[TrainingController, RecordingBackend]
) -> None:
    training, _ = controller
    created = training.create("me", "s1", 0, "alias/base", LoraSpec(rank=8), {"k": 1})
    assert (await training.futures.wait("me", created.id, 5)).result == ModelReady("s1:train:0")
    saved = training.save("me", "s1:train:0", 1, "training", "first", user_metadata={"a": "b"})
    record = (await training.futures.wait("me", saved.id, 5)).result
    assert isinstance(record, SavedCheckpoint)
    ckpt = record.record
    assert ckpt.tinker_path == "tinker://s1:train:0/weights/first"
    assert ckpt.size_bytes == 15 and ckpt.lora.rank == 8 and ckpt.base_model == "base"
    with pytest.raises(NotFoundError):
        training.checkpoints.resolve("other", ckpt.tinker_path)
    with pytest.raises(InvalidTrainingRequest, match="exists"):
        training.save("me", "s1:train:0", 2, "training", "first")

    reopened = CheckpointStore(FileCheckpointStorage(tmp_path))
    again, folder = reopened.resolve("me", ckpt.tinker_path)
    assert again == ckpt and (folder / "adapter.bin").is_file()
    assert [r.run_id for r in reopened.runs_of("me")] == ["s1:train:0"]
    assert reopened.runs_of("other") == []
    assert not [p for p in (tmp_path / ".scratch").rglob("*") if not p.is_dir()]

    # Another process on the same folder (a fleet's replica) finds it, saved after its start.
    elsewhere = CheckpointStore(FileCheckpointStorage(tmp_path))
    later = training.save("me", "s1:train:0", 2, "sampler", "later")
    assert isinstance((await training.futures.wait("me", later.id, 5)).result, SavedCheckpoint)
    record_there, _ = elsewhere.resolve("me", "tinker://s1:train:0/sampler_weights/later")
    assert record_there.name == "later"
    with pytest.raises(NotFoundError):
        elsewhere.resolve("other", "tinker://s1:train:0/sampler_weights/later")
    with pytest.raises(NotFoundError):  # never a path out of the storage
        elsewhere.resolve("me", "tinker://../sampler_weights/later")


def test_a_storage_opened_on_a_shared_folder_leaves_live_processes_scratch(
    tmp_path: Path,
) -> None:
    host = socket.gethostname()
    dead = subprocess.Popen(["true"])  # its pid: no longer running
    dead.wait()
    live = tmp_path / ".scratch" / f"{host}-{os.getppid()}"
    stale = tmp_path / ".scratch" / f"{host}-{dead.pid}"
    remote = tmp_path / ".scratch" / "another-host-1"
    for folder in (live, stale, remote):
        (folder / "part").mkdir(parents=True)
    storage = FileCheckpointStorage(tmp_path)
    assert (live / "part").is_dir() and (remote / "part").is_dir()  # someone is writing
    assert not stale.exists()
    assert storage.scratch().parent.name == f"{host}-{os.getpid()}"


async def test_checkpoint_ttl_deletes_it(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    storage = FileCheckpointStorage(tmp_path)
    store = CheckpointStore(storage, wall_clock=clock)
    backend = RecordingBackend()
    training = TrainingController(backend, store, FutureStore(), wall_clock=clock)
    await create_model(training)
    fut = training.save("me", "s:train:0", 1, "sampler", "t", ttl_seconds=10)
    await training.futures.wait("me", fut.id, 5)
    folder = storage.folder("s:train:0", "sampler", "t")
    assert folder.is_dir()
    clock.now += 11
    assert [c.name for c in store.delete_expired()] == ["t"]
    assert not folder.exists() and store.find("me") == []


async def create_model(training: TrainingController) -> None:
    """Tenant ``me``'s model ``s:train:0`` (session ``s``, seq 0) created, rank 4."""
    await training.futures.wait(
        "me", training.create("me", "s", 0, "base", LoraSpec(4), None).id, 5
    )


# --- TrainingController: the sequence guard -------------------------------------------


async def test_requests_run_in_seq_id_order_and_wait_for_gaps(
    controller: tuple[TrainingController, RecordingBackend],
) -> None:
    training, backend = controller
    await create_model(training)
    # Chunks arrive out of order (the SDK sends the first chunk last), then an optim step.
    f3 = training.forward_backward(
        "me", "s:train:0", 3, [datum(3)], "cross_entropy", {}, forward_only=False
    )
    f2 = training.forward_backward(
        "me", "s:train:0", 2, [datum(2)], "cross_entropy", {}, forward_only=False
    )
    f4 = training.optim_step("me", "s:train:0", 4, AdamParams(learning_rate=0.5))
    await asyncio.sleep(0.05)
    assert not f2.finished and not f3.finished  # held: seq 1 has not arrived
    f1 = training.forward_backward(
        "me", "s:train:0", 1, [datum(1)], "cross_entropy", {}, forward_only=True
    )
    for f in (f1, f2, f3, f4):
        await training.futures.wait("me", f.id, 5)
    assert [c[0] + (c[2] if c[0] != "create" else "") for c in backend.calls] == [
        "create",
        "fwd1",
        "fb2",
        "fb3",
        "optim0.5",
    ]
    # A retried seq_id gets the first future back; one behind the last run is refused.
    assert training.optim_step("me", "s:train:0", 4, AdamParams()) is f4
    with pytest.raises(SequenceConflictError, match="used by a OptimStep"):
        training.forward_backward(
            "me", "s:train:0", 4, [datum(1)], "cross_entropy", {}, forward_only=True
        )
    with pytest.raises(SequenceConflictError):
        training.optim_step("me", "s:train:0", 0, AdamParams())


async def test_ending_a_session_fails_requests_waiting_on_a_gap_and_frees_the_model(
    controller: tuple[TrainingController, RecordingBackend],
) -> None:
    training, backend = controller
    await create_model(training)
    waiting = training.optim_step("me", "s:train:0", 2, AdamParams())
    training.end_session("s", "expired")
    done = await training.futures.wait("me", waiting.id, 5)
    assert isinstance(done.error, SessionClosedError)
    await asyncio.sleep(0.05)
    assert backend.calls[-1] == ("release", "s:train:0")
    with pytest.raises(NotFoundError, match="not loaded"):
        training.optim_step("me", "s:train:0", 3, AdamParams())


async def test_bad_requests_are_refused_before_queueing(
    controller: tuple[TrainingController, RecordingBackend],
) -> None:
    training, _ = controller
    with pytest.raises(InvalidTrainingRequest, match="not served"):
        training.create("me", "s", 0, "nope", LoraSpec(4), None)
    with pytest.raises(InvalidTrainingRequest, match="rank"):
        training.create("me", "s", 0, "base", LoraSpec(0), None)
    await create_model(training)
    with pytest.raises(SequenceConflictError):
        training.create("me", "s", 0, "base", LoraSpec(4), None)
    with pytest.raises(InvalidTrainingRequest, match="loss_fn"):
        training.forward_backward("me", "s:train:0", 1, [datum(2)], "mse", {}, forward_only=False)
    with pytest.raises(InvalidTrainingRequest, match="learning_rate"):
        training.optim_step("me", "s:train:0", 1, AdamParams(learning_rate=-1))
    with pytest.raises(NotFoundError):
        training.optim_step("other", "s:train:0", 1, AdamParams())
    assert len(training.futures) == 1  # only the create: nothing queued for the refusals
