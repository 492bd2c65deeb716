"""TrainingController: training runs and their requests, executed in ``seq_id`` order.

The SDK numbers every request of a training client (each forward/backward chunk, optim
step, save, load) from 1 and sends chunks of one call in parallel, the first one last. The
sequence guard runs a run's requests strictly in ``seq_id`` order and holds later ones
until the gap before them fills; a repeated ``seq_id`` (a client retry) gets the future of
the first. Backend work runs through the :class:`FairScheduler`, one request per run at a
time, tenants (API keys) taking turns piece by piece (a long forward/backward runs in
micro-batches), so one tenant's long step does not hold up the others'.

Per-key limits (:class:`~domain.tinker.values.TinkerLimits`): live runs, LoRA rank, tokens per
forward/backward, requests (and their bytes) waiting per run, and how far ahead of the
next expected ``seq_id`` a request may be numbered.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import structlog

from application.tinker.checkpoints import CheckpointStore
from application.tinker.curves import TrainingCurves
from application.tinker.custom_losses import CustomLossStore
from application.tinker.fair import FairScheduler
from application.tinker.futures import Future, FutureStore
from application.tinker.stability import SequenceRecords
from domain.tinker.batch import ForwardBackwardInput, ForwardBackwardResult
from domain.tinker.checks import (
    check_adam,
    check_checkpoint_name,
    check_data,
    check_dimuon,
    data_bytes,
    data_tokens,
    loss_config,
)
from domain.tinker.custom_loss import check_custom_data, split_loss_config
from domain.tinker.errors import (
    InvalidTrainingRequest,
    NotFoundError,
    RetryLaterError,
    SequenceConflictError,
    SessionClosedError,
)
from domain.tinker.ports import Steps, TrainingBackend, one_step
from domain.tinker.provenance import resolve_provenance
from domain.tinker.values import (
    AdamParams,
    BaseModelInfo,
    CheckpointKind,
    CheckpointRecord,
    Datum,
    DimuonParams,
    LoraSpec,
    OptimizerFamily,
    RunRecord,
    TinkerLimits,
    optimizer_of,
)

log = structlog.get_logger(__name__)

Work = Callable[[], Awaitable[object]]
T = TypeVar("T")


@dataclass(eq=False)
class _Sequencer:
    """Runs submitted work in ``seq_id`` order, one at a time."""

    last: int  # the seq_id of the last request started
    waiting: dict[int, tuple[Future, Work, int]] = field(default_factory=dict)  # + its bytes
    waiting_bytes: int = 0
    seen: dict[int, Future] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None


@dataclass(eq=False)
class _Live:
    record: RunRecord
    seq: _Sequencer
    loaded: bool = False


# What the futures of training requests resolve to (besides ForwardBackwardResult).
@dataclass(frozen=True, slots=True)
class ModelReady:
    model_id: str
    path: str | None = None  # the checkpoint it was loaded from


@dataclass(frozen=True, slots=True)
class OptimStepped:
    metrics: dict[str, float]


@dataclass(frozen=True, slots=True)
class SavedCheckpoint:
    record: CheckpointRecord


# The SDK's hyperparameter type of each optimizer family.
_PARAMS: dict[OptimizerFamily, str] = {"adamw": "AdamParams", "dimuon": "DimuonParams"}


def run_id_of(session_id: str, model_seq_id: int) -> str:
    """The id of a session's ``model_seq_id``-th training run (the SDK's model id)."""
    return f"{session_id}:train:{model_seq_id}"


class TrainingController:
    def __init__(
        self,
        backend: TrainingBackend,
        checkpoints: CheckpointStore,
        futures: FutureStore,
        *,
        limits: TinkerLimits | None = None,
        scheduler: FairScheduler | None = None,
        max_seen: int = 4096,
        wall_clock: Callable[[], float] = time.time,
        records: SequenceRecords | None = None,
        custom_losses: CustomLossStore | None = None,
        curves: TrainingCurves | None = None,
    ) -> None:
        """``records``: the sampled sequences ``stable_reinforce`` data name;
        ``custom_losses``: the stored losses loss_fn ``custom`` runs; ``curves``: where
        each run's step metrics are kept (the console's loss curves)."""
        self.backend = backend
        self.curves = curves if curves is not None else TrainingCurves()
        self.custom_losses = custom_losses if custom_losses is not None else CustomLossStore()
        self.records = records if records is not None else SequenceRecords()
        self.checkpoints = checkpoints
        self.futures = futures
        self.limits = limits or TinkerLimits()
        self.scheduler = scheduler or FairScheduler()
        self._live: dict[str, _Live] = {}
        self._max_seen = max_seen
        self._clock = wall_clock
        self._auto_names = 0
        self._releases: set[asyncio.Task[None]] = set()

    # --- base models ------------------------------------------------------------------

    @property
    def base_models(self) -> Sequence[BaseModelInfo]:
        return self.backend.base_models

    def base_model(self, name: str) -> BaseModelInfo:
        for info in self.backend.base_models:
            if name == info.name or name in info.aliases:
                return info
        served = ", ".join(m.name for m in self.backend.base_models)
        raise InvalidTrainingRequest(f"base model {name!r} is not served (serving: {served})")

    # --- run lifecycle ----------------------------------------------------------------

    def create(
        self,
        owner: str,
        session_id: str,
        model_seq_id: int,
        base_model: str,
        lora: LoraSpec,
        user_metadata: Mapping[str, Any] | None,
        optimizer: OptimizerFamily = "adamw",
    ) -> Future:
        """A new run (``{session}:train:{n}``) with a fresh adapter, stepping with
        ``optimizer`` for its lifetime; the future's result is the model id."""
        info = self.base_model(base_model)
        self._check_lora(lora)
        live = self._new_run(
            owner, session_id, model_seq_id, info.name, lora, user_metadata, optimizer
        )
        run_id = live.record.run_id

        async def work() -> object:
            await self._run(live, one_step(lambda: self.backend.create(run_id, info.name, lora)))
            live.loaded = True
            return ModelReady(run_id)

        return self._submit(live, 0, "CreateModel", work)

    def create_from_checkpoint(
        self,
        owner: str,
        session_id: str,
        model_seq_id: int,
        path: str,
        *,
        optimizer: bool,
        user_metadata: Mapping[str, Any] | None,
        optimizer_config: OptimizerFamily | None = None,
    ) -> Future:
        """A new run starting from a saved checkpoint (weights, and optimizer state when
        ``optimizer``: then it steps with the checkpoint's optimizer, else with
        ``optimizer_config``, AdamW by default); the next request of its client is seq 1."""
        ckpt, folder = self.checkpoints.resolve(owner, path)
        if optimizer and ckpt.kind != "training":
            raise InvalidTrainingRequest(
                f"{path} is a sampler checkpoint (weights only): optimizer state is only "
                "saved by save_state"
            )
        if optimizer and optimizer_config not in (None, ckpt.optimizer):
            raise InvalidTrainingRequest(
                f"optimizer_config {optimizer_config!r} cannot override the optimizer state "
                f"of {path} ({ckpt.optimizer}): leave it out, or load the weights only"
            )
        family = ckpt.optimizer if optimizer else optimizer_config or "adamw"
        self._check_lora(ckpt.lora)
        live = self._new_run(
            owner, session_id, model_seq_id, ckpt.base_model, ckpt.lora, user_metadata, family
        )
        run_id = live.record.run_id

        async def work() -> object:
            def create_and_load() -> None:
                self.backend.create(run_id, ckpt.base_model, ckpt.lora)
                self.backend.load(run_id, folder, optimizer=optimizer)

            await self._run(live, one_step(create_and_load))
            live.loaded = True
            return ModelReady(run_id, path)

        return self._submit(live, 0, "LoadWeights", work)

    def _new_run(
        self,
        owner: str,
        session_id: str,
        model_seq_id: int,
        base_model: str,
        lora: LoraSpec,
        user_metadata: Mapping[str, Any] | None,
        optimizer: OptimizerFamily,
    ) -> _Live:
        run_id = run_id_of(session_id, model_seq_id)
        if run_id in self._live or run_id in self.checkpoints.runs:
            raise SequenceConflictError(f"training run {run_id!r} exists (model_seq_id reused)")
        owned = sum(1 for live in self._live.values() if live.record.owner == owner)
        if owned >= self.limits.max_runs_per_key:
            raise InvalidTrainingRequest(
                f"this API key has {owned} training runs loaded, the most allowed "
                f"({self.limits.max_runs_per_key}): unload_model one, or end its session"
            )
        now = self._clock()
        record = RunRecord(
            run_id=run_id,
            owner=owner,
            session_id=session_id,
            base_model=base_model,
            lora=lora,
            created_at=now,
            last_request_at=now,
            user_metadata={str(k): str(v) for k, v in (user_metadata or {}).items()},
            optimizer=optimizer,
        )
        self.checkpoints.save_run(record)
        live = _Live(record, _Sequencer(last=-1))
        self._live[run_id] = live
        log.info("tinker_run_created", run_id=run_id, base_model=base_model, rank=lora.rank)
        return live

    def live_run(self, owner: str, model_id: str) -> RunRecord:
        live = self._live.get(model_id)
        if live is None or live.record.owner != owner:
            if model_id in self.checkpoints.runs and self.checkpoints.runs[model_id].owner == owner:
                raise NotFoundError(
                    f"training run {model_id!r} is not loaded (its session ended or the server "
                    "restarted): continue from a checkpoint with create_training_client_from_state"
                )
            raise NotFoundError(f"no training run {model_id!r}")
        return live.record

    def is_live(self, model_id: str) -> bool:
        live = self._live.get(model_id)
        return live is not None and live.loaded

    def unload(self, owner: str, model_id: str) -> None:
        self.live_run(owner, model_id)
        self._unload(model_id, "unloaded")

    def end_session(self, session_id: str, why: str) -> None:
        """Unload every run of a finished or expired session (waiting requests fail)."""
        for run_id in [r for r, live in self._live.items() if live.record.session_id == session_id]:
            self._unload(run_id, f"session {why}")

    def _unload(self, run_id: str, why: str) -> None:
        live = self._live.pop(run_id)
        for future, _, _ in live.seq.waiting.values():
            self.futures.fail(future, SessionClosedError(f"training run {run_id!r} {why}"))
        live.seq.waiting.clear()
        live.seq.waiting_bytes = 0
        live.seq.seen.clear()

        async def release() -> None:
            if live.seq.task is not None:  # let a running step finish first
                await asyncio.gather(live.seq.task, return_exceptions=True)
            await asyncio.to_thread(self.backend.release, run_id)

        task = asyncio.get_running_loop().create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        log.info("tinker_run_unloaded", run_id=run_id, why=why)

    # --- training requests ------------------------------------------------------------

    def forward_backward(
        self,
        owner: str,
        model_id: str,
        seq_id: int | None,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str],
        *,
        forward_only: bool,
    ) -> Future:
        live = self._get(owner, model_id)
        numbers, loss_id = split_loss_config(loss_fn, loss_fn_config)
        custom = None
        if loss_id is not None:  # loss_fn custom: a loss this run's session stored
            custom = self.custom_losses.get(owner, live.record.session_id, loss_id)
        if loss_fn == "stable_reinforce":  # the recorded sampler logprobs, not the client's
            recorded = self.records.lookup(owner, live.record.session_id)
            data = resolve_provenance(data, recorded)
        check_data(data, loss_fn)
        if custom is not None:
            check_custom_data(data, custom)
        config = loss_config(loss_fn, numbers)
        tokens = data_tokens(data)
        if tokens > self.limits.max_tokens_per_request:
            raise InvalidTrainingRequest(
                f"forward_backward: {tokens} tokens in one request, the most allowed is "
                f"{self.limits.max_tokens_per_request} (send the data in smaller chunks)"
            )

        async def work() -> ForwardBackwardResult:
            batch = ForwardBackwardInput(data, loss_fn, config, custom_loss=custom)
            steps = self.backend.forward_backward_steps(model_id, batch, backward=not forward_only)
            result = await self._run(live, steps)
            self.curves.forward_backward(model_id, result.metrics, forward_only=forward_only)
            return result

        kind = "Forward" if forward_only else "ForwardBackward"
        future = self._submit(live, seq_id, kind, work, size=data_bytes(data))
        future.tokens = tokens
        return future

    def optim_step(
        self, owner: str, model_id: str, seq_id: int | None, params: AdamParams | DimuonParams
    ) -> Future:
        """One step of the run's optimizer: ``params`` must be of its family (AdamParams
        for AdamW, DimuonParams for Dimuon)."""
        live = self._get(owner, model_id)
        family = live.record.optimizer
        if optimizer_of(params) != family:
            raise InvalidTrainingRequest(
                f"training run {model_id!r} was created with the {family} optimizer "
                f"(optimizer_config type {family!r}): optim_step takes "
                f"{_PARAMS[family]}, got {_PARAMS[optimizer_of(params)]}"
            )
        if isinstance(params, DimuonParams):
            check_dimuon(params)
        else:
            check_adam(params)

        async def work() -> OptimStepped:
            steps = one_step(lambda: self.backend.optim_step(model_id, params))
            metrics = await self._run(live, steps)
            self.curves.optim_step(model_id, metrics)
            return OptimStepped(metrics)

        return self._submit(live, seq_id, "OptimStep", work)

    def save(
        self,
        owner: str,
        model_id: str,
        seq_id: int | None,
        kind: CheckpointKind,
        name: str | None,
        *,
        ttl_seconds: int | None = None,
        user_metadata: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> Future:
        """``save_weights`` (kind training: weights + optimizer state),
        ``save_weights_for_sampler`` (sampler) or ``save_weights_external`` (external): the
        future resolves to a :class:`SavedCheckpoint`."""
        live = self._get(owner, model_id)
        if name is None:
            self._auto_names += 1
            name = f"ckpt-{int(self._clock())}-{self._auto_names}"
        check_checkpoint_name(name)
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise InvalidTrainingRequest("ttl_seconds must be positive")
        self.checkpoints.reserve(live.record, kind, name, overwrite=overwrite)
        meta = {str(k): str(v) for k, v in (user_metadata or {}).items()}

        def write(folder: Path) -> None:
            self.backend.save(model_id, folder, optimizer=kind == "training")

        async def work() -> SavedCheckpoint:
            def save() -> CheckpointRecord:
                return self.checkpoints.write(
                    live.record,
                    kind,
                    name,
                    write,
                    ttl_seconds=ttl_seconds,
                    user_metadata=meta,
                    overwrite=overwrite,
                )

            return SavedCheckpoint(await self._run(live, one_step(save)))

        try:
            return self._submit(live, seq_id, "SaveWeights", work)
        except BaseException:
            self.checkpoints.release_reservation(live.record, kind, name)
            raise

    def snapshot(
        self,
        owner: str,
        model_id: str,
        seq_id: int | None,
        folder: Path,
        then: Callable[[], object],
    ) -> Future:
        """Write the current adapter weights into ``folder`` (an unnamed sampler snapshot);
        the future resolves to ``then()``, called once the weights are written."""
        live = self._get(owner, model_id)

        async def work() -> object:
            await self._run(
                live, one_step(lambda: self.backend.save(model_id, folder, optimizer=False))
            )
            return then()

        return self._submit(live, seq_id, "SaveWeightsForSampler", work)

    def load(
        self,
        owner: str,
        model_id: str,
        seq_id: int | None,
        path: str,
        *,
        optimizer: bool,
        optimizer_config: OptimizerFamily | None = None,
    ) -> Future:
        """``load_state`` into an existing run: its base model and LoRA shape must match, and
        its optimizer the checkpoint's state's (``optimizer_config``, if given, the run's)."""
        live = self._get(owner, model_id)
        family = live.record.optimizer
        if optimizer_config not in (None, family):
            raise InvalidTrainingRequest(
                f"optimizer_config {optimizer_config!r}: training run {model_id!r} steps with "
                f"{family} for its lifetime"
            )
        ckpt, folder = self.checkpoints.resolve(owner, path)
        if ckpt.base_model != live.record.base_model or ckpt.lora.rank != live.record.lora.rank:
            raise InvalidTrainingRequest(
                f"{path} is a rank-{ckpt.lora.rank} adapter of {ckpt.base_model!r}; run "
                f"{model_id!r} is rank {live.record.lora.rank} on {live.record.base_model!r}"
            )
        if optimizer and ckpt.kind != "training":
            raise InvalidTrainingRequest(f"{path} holds no optimizer state (a sampler checkpoint)")
        if optimizer and ckpt.optimizer != family:
            raise InvalidTrainingRequest(
                f"{path} holds {ckpt.optimizer} optimizer state; training run {model_id!r} "
                f"steps with {family} (load the weights only, or resume in a new run)"
            )

        async def work() -> object:
            await self._run(
                live, one_step(lambda: self.backend.load(model_id, folder, optimizer=optimizer))
            )
            return ModelReady(model_id, path)

        return self._submit(live, seq_id, "LoadWeights", work)

    # --- the sequence guard -----------------------------------------------------------

    def _get(self, owner: str, model_id: str) -> _Live:
        self.live_run(owner, model_id)
        return self._live[model_id]

    def _run(self, live: _Live, steps: Steps[T]) -> Awaitable[T]:
        """Backend work of ``live``'s run, taking turns with other tenants' work."""
        return self.scheduler.run(live.record.owner, steps)

    def _check_lora(self, lora: LoraSpec) -> None:
        top = self.limits.max_lora_rank
        if not 1 <= lora.rank <= top:
            raise InvalidTrainingRequest(f"lora_config.rank must be in 1..{top}, got {lora.rank}")
        if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
            raise InvalidTrainingRequest(
                "lora_config: at least one of train_attn, train_mlp, train_unembed must be true"
            )

    def _submit(
        self, live: _Live, seq_id: int | None, kind: str, work: Work, *, size: int = 0
    ) -> Future:
        seq = live.seq
        run_id = live.record.run_id
        if seq_id is None:  # not numbered: after everything submitted so far
            seq_id = max([seq.last, *seq.waiting]) + 1
        if seq_id in seq.seen:
            earlier = seq.seen[seq_id]
            if earlier.kind != kind:
                raise SequenceConflictError(
                    f"seq_id {seq_id} of {run_id!r} was used by a {earlier.kind} "
                    f"request; this {kind} request needs a new, increasing seq_id"
                )
            return earlier  # a retry of a request already accepted
        if seq_id <= seq.last:
            raise SequenceConflictError(
                f"seq_id {seq_id} of {run_id!r} is behind the last one run "
                f"({seq.last}); each training request needs a new, increasing seq_id"
            )
        limits = self.limits
        if seq_id > seq.last + limits.max_seq_ahead:
            raise SequenceConflictError(
                f"seq_id {seq_id} of {run_id!r} is too far ahead: the next expected is "
                f"{seq.last + 1} and at most {limits.max_seq_ahead} may be outstanding"
            )
        # The next request in line is always taken (it is never stuck behind a gap).
        if seq_id != seq.last + 1 and (
            len(seq.waiting) >= limits.max_pending_requests
            or seq.waiting_bytes + size > limits.max_pending_bytes
        ):
            raise RetryLaterError(
                f"run {run_id!r} has {len(seq.waiting)} requests ({seq.waiting_bytes} bytes) "
                f"waiting for seq_id {seq.last + 1}, the most allowed "
                f"({limits.max_pending_requests} requests, {limits.max_pending_bytes} bytes): "
                "retry once earlier ones have run"
            )
        future = self.futures.create(live.record.owner, kind)
        future.run_id, future.session_id = run_id, live.record.session_id
        seq.waiting[seq_id] = (future, work, size)
        seq.waiting_bytes += size
        if seq_id > 0:  # 0 is the run's creation, never a client's request
            seq.seen[seq_id] = future
        if len(seq.seen) > self._max_seen:
            for old in sorted(seq.seen)[: len(seq.seen) - self._max_seen]:
                del seq.seen[old]
        live.record.last_request_at = self._clock()
        if seq.task is None or seq.task.done():
            seq.task = asyncio.get_running_loop().create_task(self._drain(live))
        return future

    async def _drain(self, live: _Live) -> None:
        seq = live.seq
        while seq.last + 1 in seq.waiting:
            seq.last += 1
            future, work, size = seq.waiting.pop(seq.last)
            seq.waiting_bytes -= size
            await self.futures.settle(future, work)
