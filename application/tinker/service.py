"""TinkerService: the one object the HTTP adapter talks to.

It holds the components, checks that a session is live before work is accepted for it,
orchestrates what spans components (a save for a sampler, loading into a new run, a
session's listing, a run's summary), and ends what hangs off a session when the session
finishes or stops sending heartbeats. Every lookup takes the caller's tenant (``owner``):
another tenant's session, run, sampler, checkpoint or future is a ``NotFoundError``.
"""

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from application.engine.observers import TrainingObserverGroup
from application.tinker.activity_log import AuditedCheckpoints, AuditedSessions, AuditLog
from application.tinker.admin import TinkerAdmin
from application.tinker.billing import UsageMeter
from application.tinker.checkpoints import CheckpointStore
from application.tinker.completions import Completions, Retrieved
from application.tinker.custom_losses import CustomLossCreated, CustomLossStore
from application.tinker.downloads import CheckpointDownloads, DownloadableStorage
from application.tinker.fair import FairScheduler, FairSlots
from application.tinker.futures import Future, FutureStore
from application.tinker.sampling import SamplerReady, SamplerRecord, SamplingController
from application.tinker.sessions import Session, SessionManager
from application.tinker.stability import SequenceRecords
from application.tinker.traces import SessionTraces
from application.tinker.training import ModelReady, TrainingController, run_id_of
from domain.observer import TrainingObserver
from domain.tinker.custom_loss import RawNode, parse_custom_loss
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.ports import SamplingBackend, TrainingBackend
from domain.tinker.values import (
    BaseModelInfo,
    CheckpointRecord,
    LoraSpec,
    OptimizerFamily,
    RunRecord,
    TinkerLimits,
    TinkerSampleResult,
    WeightsSource,
)

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A model name (a base model's, or an alias) clients may train and sample."""

    name: str
    max_context_length: int
    trainable: bool = True
    sampleable: bool = True


@dataclass(frozen=True, slots=True)
class SessionInfo:
    session: Session
    training_run_ids: list[str]
    sampler_ids: list[str]


@dataclass(frozen=True, slots=True)
class RunSummary:
    """A training run as listed: with its newest checkpoint of each kind."""

    run: RunRecord
    last_checkpoint: CheckpointRecord | None
    last_sampler_checkpoint: CheckpointRecord | None


@dataclass(frozen=True, slots=True)
class SampleTarget:
    """What an ``asample`` samples, and the context its prompt and tokens must fit."""

    source: WeightsSource
    max_context_length: int


class TinkerService:
    def __init__(
        self,
        backend: TrainingBackend,
        sampler: SamplingBackend,
        storage: DownloadableStorage,
        *,
        session_timeout_s: float = 120.0,
        future_ttl_s: float = 900.0,
        maintenance_interval_s: float = 5.0,
        long_poll_s: float = 30.0,
        ended_session_retention_s: float = 24 * 3600.0,
        limits: TinkerLimits | None = None,
        observer: TrainingObserver | None = None,
        id_tag: str = "",
    ) -> None:
        """``observer``: told of every Tinker operation that ran (metrics, traces);
        ``id_tag``: in the ids of sessions (so of runs and samplers) and futures: a fleet's
        replica id, by which the ingress routes each call to the replica holding it."""
        self.storage = storage
        self.limits = limits or TinkerLimits()
        # What a tenant may ask about its own work: audit log, usage, session traces.
        self.audit = AuditLog()
        self.usage = UsageMeter(lambda run_id: self.checkpoints.runs.get(run_id))
        self.traces = SessionTraces(storage.secret)
        observers: list[TrainingObserver] = [self.usage, self.traces]
        if observer is not None:
            observers.append(observer)
        self.futures = FutureStore(
            ttl_s=future_ttl_s, observer=TrainingObserverGroup(observers), id_tag=id_tag
        )
        self.sessions: SessionManager = AuditedSessions(
            self.audit, timeout_s=session_timeout_s, id_tag=id_tag
        )
        self.checkpoints: CheckpointStore = AuditedCheckpoints(
            storage, self.audit, on_saved=self._checkpoint_saved
        )
        self.admin = TinkerAdmin(self.sessions, self.checkpoints, self.usage)
        self.completions = Completions(self.futures)
        self.downloads = CheckpointDownloads(self.checkpoints, storage)
        self.scheduler = FairScheduler()
        self.records = SequenceRecords(max_tokens=self.limits.max_recorded_tokens)
        self.custom_losses = CustomLossStore()
        self.training = TrainingController(
            backend,
            self.checkpoints,
            self.futures,
            limits=self.limits,
            scheduler=self.scheduler,
            records=self.records,
            custom_losses=self.custom_losses,
        )
        self.sampling = SamplingController(
            sampler, self.training, self.checkpoints, self.futures, discard_folder=storage.discard
        )
        self.long_poll_s = long_poll_s
        self.ended_session_retention_s = ended_session_retention_s
        self._interval_s = maintenance_interval_s
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._maintain())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for session in self.sessions.all():
            if session.ended is None:
                self._end(session, "stopped")
        self.completions.close()
        await self.scheduler.close()
        await self.futures.close()

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                self.maintain()
            except Exception:
                log.exception("tinker_maintenance_failed")

    def maintain(self) -> None:
        """Expire silent sessions and checkpoints past their ttl; drop old futures and
        recorded sequences."""
        for session in self.sessions.expire_stale(busy=self.futures.busy_sessions()):
            self._end(session, "expired")
        self.sessions.forget_ended(self.ended_session_retention_s)
        self.traces.forget(lambda session_id: self.sessions.known(session_id))
        self.checkpoints.delete_expired()
        self.futures.evict_expired()
        self.records.evict_expired()

    # --- the server ---------------------------------------------------------------------

    def pending_futures(self) -> int:
        """Futures created and not yet resolved (the metrics' gauge)."""
        return self.futures.pending()

    def queue_state(self, owner: str, future: Future) -> tuple[str, str | None]:
        """What an unfinished future waits for, as Tinker's ``queue_state`` (and its
        reason): ``paused_capacity`` while it waits for the shared trainer or the engine's
        sampling slots behind other work, ``active`` otherwise (running, or only behind
        its own run's earlier requests)."""
        if future.kind == "Sample":
            slots = getattr(self.sampling.backend, "slots", None)
            waiting = slots.waiting(owner) if isinstance(slots, FairSlots) else 0
            if waiting:
                return "paused_capacity", (
                    f"{waiting} sampling request(s) of this key wait for one of the "
                    f"{slots.size} sampling slots of the engine"  # type: ignore[union-attr]
                )
            return "active", None
        others = self.scheduler.others(owner)
        if others:
            return "paused_capacity", f"the trainer takes turns with {others} other key(s)"
        return "active", None

    def served_models(self) -> list[ServedModel]:
        """Every name a base model is served under (its own and its aliases)."""
        return [
            ServedModel(name, info.max_context_length)
            for info in self.training.base_models
            for name in (info.name, *info.aliases)
        ]

    # --- sessions ---------------------------------------------------------------------

    def live_session(self, owner: str, session_id: str) -> Session:
        return self.sessions.live(owner, session_id)

    def session_info(self, owner: str, session_id: str) -> SessionInfo:
        session = self.sessions.get(owner, session_id)
        runs = [r.run_id for r in self.checkpoints.runs.values() if r.session_id == session_id]
        return SessionInfo(session, runs, self.sampling.of_session(session_id))

    def finish_session(
        self, owner: str, session_id: str, *, reason: str | None = None, detail: str | None = None
    ) -> None:
        """End the session as its client asked (``reason``: its finish reason)."""
        session = self.sessions.get(owner, session_id)
        if session.ended is None:
            self.sessions.finish(owner, session_id, reason=reason, detail=detail)
            self._end(session, "finished")

    def _end(self, session: Session, why: str) -> None:
        self.sessions.end(session, why)
        self.training.end_session(session.id, why)
        self.sampling.end_session(session.id)
        self.completions.end_session(session.id)
        self.records.end_session(session.id)
        self.custom_losses.end_session(session.id)

    # --- custom losses ----------------------------------------------------------------

    def create_custom_loss(
        self,
        owner: str,
        session_id: str,
        seq_id: int,
        name: str,
        inputs: Sequence[tuple[str, int]],
        nodes: Sequence[RawNode],
        graph_format: int = 1,
    ) -> Future:
        """Check and store a traced loss for a live session (``parse_custom_loss``); a
        resolved future of its :class:`CustomLossCreated`."""
        self.live_session(owner, session_id)
        loss = parse_custom_loss(name, inputs, nodes, graph_format)
        loss_id = self.custom_losses.create(owner, session_id, seq_id, loss)
        future = self.futures.create(owner, "CreateCustomLoss")
        future.session_id = session_id
        self.futures.resolve(future, CustomLossCreated(loss_id))
        return future

    # --- training runs ----------------------------------------------------------------

    def create_model(
        self,
        owner: str,
        session_id: str,
        model_seq_id: int,
        base_model: str,
        lora: LoraSpec,
        user_metadata: Mapping[str, Any] | None,
        optimizer: OptimizerFamily = "adamw",
    ) -> tuple[Future, str]:
        """A new run in a live session: its future and its model id."""
        self.live_session(owner, session_id)
        future = self.training.create(
            owner, session_id, model_seq_id, base_model, lora, user_metadata, optimizer
        )
        return future, run_id_of(session_id, model_seq_id)

    def model_info(self, owner: str, model_id: str) -> tuple[RunRecord, BaseModelInfo]:
        run = self.checkpoints.run(owner, model_id)
        return run, self.training.base_model(run.base_model)

    def unload(self, owner: str, model_id: str) -> Future:
        """Unload a live run now (its waiting requests fail); a resolved future."""
        self.training.unload(owner, model_id)
        future = self.futures.create(owner, "UnloadModel")
        self.futures.resolve(future, ModelReady(model_id))
        return future

    def load_weights(
        self,
        owner: str,
        path: str,
        *,
        optimizer: bool,
        model_id: str | None = None,
        seq_id: int | None = None,
        session_id: str | None = None,
        model_seq_id: int | None = None,
        user_metadata: Mapping[str, Any] | None = None,
        optimizer_config: OptimizerFamily | None = None,
    ) -> tuple[Future, str]:
        """A checkpoint into the live run ``model_id``, or into a new run of a live session
        (``session_id`` + ``model_seq_id``; ``optimizer_config``: its optimizer when the
        checkpoint's state is not loaded): the future and the model id."""
        if model_id is not None:
            future = self.training.load(
                owner,
                model_id,
                seq_id,
                path,
                optimizer=optimizer,
                optimizer_config=optimizer_config,
            )
            return future, model_id
        if session_id is None or model_seq_id is None:
            raise InvalidTrainingRequest(
                "load_weights needs model_id, or session_id + model_seq_id"
            )
        self.live_session(owner, session_id)
        future = self.training.create_from_checkpoint(
            owner,
            session_id,
            model_seq_id,
            path,
            optimizer=optimizer,
            user_metadata=user_metadata,
            optimizer_config=optimizer_config,
        )
        return future, run_id_of(session_id, model_seq_id)

    def save_for_sampler(
        self,
        owner: str,
        model_id: str,
        seq_id: int | None,
        *,
        path: str | None,
        kind: str | None = None,
        sampling_session_seq_id: int | None = None,
        ttl_seconds: int | None = None,
        user_metadata: Mapping[str, Any] | None = None,
    ) -> Future:
        """A named save (``path``: a sampler checkpoint), or an unnamed one: a sampler on a
        snapshot of the weights now (``kind`` snapshot) or on the live weights (inflight);
        an unnamed save's future resolves to a :class:`SamplerReady`."""
        if path is not None:
            return self.training.save(
                owner,
                model_id,
                seq_id,
                "sampler",
                path,
                ttl_seconds=ttl_seconds,
                user_metadata=user_metadata,
            )
        run = self.training.live_run(owner, model_id)
        if sampling_session_seq_id is None:
            raise InvalidTrainingRequest("an unnamed save needs sampling_session_seq_id")
        if kind not in ("snapshot", "inflight"):
            raise InvalidTrainingRequest(f"kind must be 'snapshot' or 'inflight', not {kind!r}")
        seq = sampling_session_seq_id
        if kind == "inflight":
            source = WeightsSource(run.base_model, model_id=run.run_id)
            sampler = self.sampling.create(owner, run.session_id, seq, source)
            future = self.futures.create(owner, "SaveWeightsForSampler")
            self.futures.resolve(future, SamplerReady(sampler.id))
            return future
        folder = self.storage.scratch()

        def make_sampler() -> object:
            source = WeightsSource(run.base_model, path=folder)
            sampler = self.sampling.create(owner, run.session_id, seq, source, scratch=folder)
            return SamplerReady(sampler.id)

        try:
            return self.training.snapshot(owner, model_id, seq_id, folder, make_sampler)
        except BaseException:
            self.storage.discard(folder)
            raise

    def run_summary(self, owner: str, run_id: str) -> RunSummary:
        return self._summary(self.checkpoints.run(owner, run_id))

    def run_summaries(self, owner: str) -> list[RunSummary]:
        return [self._summary(run) for run in self.checkpoints.runs_of(owner)]

    def run_checkpoints(self, owner: str, run_id: str) -> list[CheckpointRecord]:
        self.checkpoints.run(owner, run_id)
        return self.checkpoints.find(owner, run_id)

    def _summary(self, run: RunRecord) -> RunSummary:
        return RunSummary(
            run,
            self.checkpoints.latest(run.run_id, "training"),
            self.checkpoints.latest(run.run_id, "sampler"),
        )

    # --- sampling ---------------------------------------------------------------------

    def create_sampler(
        self,
        owner: str,
        session_id: str,
        seq: int,
        *,
        base_model: str | None,
        model_path: str | None,
    ) -> SamplerRecord:
        """A sampling session of a live session, on a base model or a saved checkpoint."""
        self.live_session(owner, session_id)
        source = self.sampling.source_for(owner, base_model=base_model, model_path=model_path)
        return self.sampling.create(owner, session_id, seq, source, model_path=model_path)

    def sequence_ids(
        self,
        owner: str,
        future: Future,
        prompt: Sequence[int],
        num_samples: int,
        *,
        record_in: str | None,
    ) -> list[str]:
        """The ids of ``future``'s samples; with ``record_in`` (a sampling session id),
        their sequences are recorded for ``stable_reinforce`` as they finish."""
        ids = self.records.new_ids(num_samples)
        if record_in is not None:
            session_id = self.sampling.get(owner, record_in).session_id
            tokens = tuple(prompt)

            def record(result: object) -> None:
                if isinstance(result, TinkerSampleResult):
                    self.records.record(owner, session_id, ids, tokens, result)

            future.on_result.append(record)
        return ids

    def sample_target(
        self,
        owner: str,
        *,
        sampler_id: str | None,
        base_model: str | None,
        model_path: str | None,
    ) -> SampleTarget:
        """What a sample request samples: a sampling session's weights, or a base model or
        a checkpoint named in the request."""
        if sampler_id is not None:
            source = self.sampling.source_of(self.sampling.get(owner, sampler_id))
        else:
            source = self.sampling.source_for(owner, base_model=base_model, model_path=model_path)
        context = self.training.base_model(source.base_model).max_context_length
        return SampleTarget(source, context)

    # --- sampling sessions' clients and completions -------------------------------------

    def track_sample(
        self,
        owner: str,
        future: Future,
        *,
        sampler_id: str | None,
        seq_id: int | None,
        base_model: str,
        prompt_tokens: int,
    ) -> None:
        """Follow an accepted sample: its completion goes to its sampling session's
        clone (``retrieve_futures``), its tokens to the usage and its future's count."""
        session_id: str | None = None
        if sampler_id is not None:
            sampler = self.sampling.get(owner, sampler_id)
            session_id = future.session_id = sampler.session_id
            self.completions.track(sampler, seq_id, future)

        def count(done: Future) -> None:
            if isinstance(done.result, TinkerSampleResult):
                sampled = sum(len(s.tokens) for s in done.result.sequences)
                done.tokens = prompt_tokens + sampled
                self.usage.sampled(
                    owner,
                    base_model=base_model,
                    session_id=session_id,
                    prompt_tokens=prompt_tokens,
                    sampled_tokens=sampled,
                )

        future.on_done.append(count)

    def join_sampling_session(self, owner: str, sampler_id: str) -> int:
        """A new client of a live sampling session: its clone id."""
        sampler = self.sampling.get(owner, sampler_id)
        self.live_session(owner, sampler.session_id)
        return self.completions.join(sampler)

    async def retrieve_futures(
        self,
        owner: str,
        sampler_id: str,
        clone: int,
        prev_cursor: int,
        timeout_s: float | None,
        acks: list[str],
    ) -> Retrieved:
        """A sampling session clone's completions after ``prev_cursor`` (a long poll of
        at most ``long_poll_s``; ``timeout_s`` None: that long)."""
        sampler = self.sampling.get(owner, sampler_id)
        if timeout_s is not None and timeout_s < 0:
            raise InvalidTrainingRequest("timeout must be >= 0 (0: answer at once)")
        wait = self.long_poll_s if timeout_s is None else min(timeout_s, self.long_poll_s)
        return await self.completions.retrieve(sampler, clone, prev_cursor, wait, acks)

    def cancel_future(self, owner: str, request_id: str) -> None:
        """Stop a sample's work (a finished one is left as it is)."""
        future = self.futures.get(owner, request_id)
        if future.kind != "Sample":
            raise InvalidTrainingRequest(
                f"only sampling requests can be cancelled; {request_id} is a {future.kind}"
            )
        self.futures.cancel(future)

    def _checkpoint_saved(self, record: CheckpointRecord) -> None:
        run = self.checkpoints.runs.get(record.run_id)
        session_id = run.session_id if run is not None else None
        self.usage.checkpoint_saved(
            record.owner, base_model=record.base_model, session_id=session_id
        )


def tinker_service(
    enabled: bool,
    limits: TinkerLimits,
    backend: Callable[[], TrainingBackend],
    sampler: Callable[[], SamplingBackend | None],
    storage: Callable[[], DownloadableStorage],
    observer: TrainingObserver | None = None,
    track_pending: Callable[[Callable[[], int]], None] | None = None,
    id_tag: str = "",
) -> TinkerService | None:
    """The Tinker service when ``enabled`` (None otherwise): training on ``backend()``,
    samples from ``sampler()`` (None: nothing samples here, as LoRA training on the fake
    runner: no Tinker API either), checkpoints in ``storage()``; ``observer``: told of
    every operation; ``track_pending``: given the count of pending futures (a gauge);
    ``id_tag``: in its session and future ids (a fleet's replica id). The backends and
    storage are built only when the service is."""
    if not enabled:
        return None
    sampling = sampler()
    if sampling is None:
        return None
    service = TinkerService(
        backend(), sampling, storage(), limits=limits, observer=observer, id_tag=id_tag
    )
    if track_pending is not None:
        track_pending(service.pending_futures)
    return service
