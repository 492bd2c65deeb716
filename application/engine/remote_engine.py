"""The engine of a fleet, as the ingress sees it: an :class:`EngineClient` whose requests
run on engine replicas elsewhere (Ray Serve's, :mod:`entrypoints.replicas`), reached
through a :class:`Dispatch`.

The ingress prepares requests itself (its :class:`InputProcessor`: the same tokenizer,
limits and checks as a replica's), so a bad request is refused before it leaves. Each
``admit`` is one call: every choice of every prompt goes to one replica, all or none, and
the call's outputs come back in batches (whatever the replica's step produced) that this
client spreads over one stream per request id, as :class:`AsyncEngine` gives them.

The call carries what routing needs (:class:`~domain.routing.RouteRequest`): the first
prompt's block-hash chain, keyed as the replica's cache keys it (adapter, ``cache_salt``),
the session (a Tinker run) that pins it to a replica, and its LoRA adapter (the replicas
holding it preferred).

No silent loss: a replica that dies before a call produced anything is retried once on
another (:data:`RETRIES`); a call that had produced output ends each open stream with an
``error`` output (a client cannot be given half an answer twice). A replica whose queue is
full is tried once more on another; any other refusal by the replica ends the call's
streams with its error. Closing a stream early, or the
group, cancels the call (the replica aborts its requests).
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import structlog

from application.engine.engine_client import AdmittingClient, EngineClient
from application.engine.input_processor import InputProcessor
from application.engine.request_checks import RequestChecks
from application.engine.request_ids import new_request_id
from domain.breaker import Breakers, Transition, standby
from domain.config import EngineConfig
from domain.errors import QueueFullError
from domain.ports import GrammarCompiler, Tokenizer
from domain.request import AdmitCall, StepOutput
from domain.routing import RouteRequest, prompt_block_hashes
from domain.sampling import SamplingParams
from domain.scheduler.shared_prefill import key_namespace
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.ports import ServingAdapters

log = structlog.get_logger(__name__)

RETRIES = 1  # a call lost with its replica before any output runs again once, elsewhere
REPLICA_LOST = "the engine replica serving this request stopped; retry the request"
# An open breaker's replica, once its cool-down is over, is probed with a short greedy run.
PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 30.0
PROBE_PROMPT = "The capital of France is"
PROBE_TOKENS = 2


@dataclass(frozen=True, slots=True)
class Routed:
    """A call's destination as the dispatcher reports it: which replica (an id, never an
    address) and the batches of outputs it sends back."""

    replica_id: str
    outputs: AsyncIterator[list[StepOutput]]


class ReplicaLostError(Exception):
    """The replica running a call died or could not be reached."""

    message = REPLICA_LOST  # what the call's streams end with, when not tried again

    def __init__(self, replica_id: str | None, detail: str) -> None:
        super().__init__(f"replica {replica_id or '?'}: {detail}")
        self.replica_id = replica_id


class ReplicaFailedError(ReplicaLostError):
    """The replica's engine failed a call before it produced anything (a server error, as
    a broken device gives): tried on another replica like a lost one."""

    def __init__(self, replica_id: str | None, error: str) -> None:
        super().__init__(replica_id, error)
        self.message = error


class Dispatch(Protocol):
    """Sends a call to a replica chosen for ``route`` (not one of ``avoid``: those lost a
    try of it) and gives its output batches. Raises :class:`ReplicaLostError` (at once or
    while iterating) when the replica dies; a replica's own refusal (a domain error)
    raises as it is."""

    async def __call__(
        self, route: RouteRequest, call: AdmitCall, avoid: frozenset[str]
    ) -> Routed: ...


@dataclass(slots=True)
class _Call:
    """One call's streams: the queue of each request id, which are still read, and the
    task feeding them."""

    queues: dict[str, asyncio.Queue[StepOutput]]
    open: set[str]
    task: asyncio.Task[None] | None = None
    replica_id: str | None = None
    produced: bool = False
    note: "ReplicaNote | None" = None
    noted: bool = False  # the note has this call's replica (replaced if it runs again)


@dataclass(slots=True)
class ReplicaNote:
    """Which replicas served the calls of one API request (its ``x-infer-replica``): the
    HTTP layer sets one in :data:`CURRENT_NOTE` per request and reads it when the
    response starts, after ``routed`` (every call sent so far has its replica)."""

    replicas: list[str] = field(default_factory=list)
    pending: int = 0
    routed: asyncio.Event = field(default_factory=asyncio.Event)

    def routed_to(self, replica_id: str | None) -> None:
        if replica_id is not None and replica_id not in self.replicas:
            self.replicas.append(replica_id)
        self.pending -= 1
        if self.pending <= 0:
            self.routed.set()

    def rerouted(self, failed: str | None, replica_id: str) -> None:
        """A call that ``failed`` replica gave nothing for ran again on ``replica_id``:
        named in its place (where the response has not started yet)."""
        if failed in self.replicas:
            self.replicas.remove(failed)
        if replica_id not in self.replicas:
            self.replicas.append(replica_id)


CURRENT_NOTE: ContextVar[ReplicaNote | None] = ContextVar("infer_replica_note", default=None)


class RemoteEngine(AdmittingClient):
    """:class:`~application.engine.engine_client.EngineClient` over ``replicas`` engine replicas
    (see the module), each configured as ``config``; requests are checked here as a
    replica would (``vocab_size``, ``grammar``: as :class:`RequestChecks` takes them), the
    fleet's room being every replica's capacity less the requests in flight."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        dispatch: Dispatch,
        *,
        replicas: int,
        vocab_size: int | None = None,
        grammar: GrammarCompiler | None = None,
        adapters: "ReplicaAdapters | None" = None,
        breakers: Breakers | None = None,
        on_breaker: Callable[[Transition], None] | None = None,
        joined: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        """``adapters``: the LoRA adapters the served models named (a call names the folder
        of its adapter, for a replica that does not hold it yet); ``breakers``: each
        replica's circuit breaker (None: none), fed every call's outcome, an open one's
        replica left out of routing and probed after its cool-down; ``on_breaker``: told
        of each breaker that opens or closes; ``joined``: the replicas in the order they
        joined, of which the first ``replicas`` with closed breakers serve and the others
        are warm standbys (None: every replica serves)."""
        self.capacity = config.capacity * replicas
        self.replicas = replicas
        self._joined = joined
        self.adapters = adapters
        self.block_size = config.kv_block_size
        checks = RequestChecks(
            config, tokenizer, room=self.room, vocab_size=vocab_size, grammar=grammar
        )
        self.inputs = InputProcessor(config, tokenizer, checks)
        self._dispatch = dispatch
        self._calls: dict[str, _Call] = {}  # request id -> its call
        self._running = False
        self.breakers = breakers
        self._on_breaker = on_breaker
        self._prober: asyncio.Task[None] | None = None

    def room(self) -> int:
        return self.capacity - len(self._calls)

    @property
    def healthy(self) -> bool:
        return self._running

    def start(self) -> None:
        self._running = True
        if self.breakers is not None and self.breakers.settings.enabled:
            self._prober = asyncio.get_running_loop().create_task(self._probe_forever())

    async def stop(self) -> None:
        self._running = False
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        for call in {id(c): c for c in self._calls.values()}.values():
            if call.task is not None:
                call.task.cancel()
        self.inputs.close()

    def route_of(self, call: AdmitCall, session: str | None = None) -> RouteRequest:
        namespace = key_namespace(call.adapter_id, call.params.cache_salt)
        hashes = prompt_block_hashes(call.prompts[0], self.block_size, namespace)
        return RouteRequest(hashes, session, adapter=call.adapter_id)

    def submit(
        self, call: AdmitCall, *, session: str | None = None
    ) -> list[AsyncIterator[StepOutput]]:
        """Send ``call`` to one replica (all its prompts there, or none; its outputs read
        on the running loop); one stream per request id, in order."""
        if not self._running:
            raise RuntimeError("the remote engine is not started")
        if call.adapter_id is not None and self.adapters is not None:
            call = replace(call, adapter_folder=self.adapters.folder_of(call.adapter_id))
        state = _Call({rid: asyncio.Queue() for rid in call.request_ids}, set(call.request_ids))
        state.note = CURRENT_NOTE.get()
        if state.note is not None:
            state.note.pending += 1
        for request_id in call.request_ids:
            self._calls[request_id] = state
        state.task = asyncio.create_task(self._feed(state, call, self.route_of(call, session)))
        return [self._drain(state, rid) for rid in call.request_ids]

    def replica_of(self, request_id: str) -> str | None:
        """The replica a queued request runs on (None: not yet routed, or done)."""
        call = self._calls.get(request_id)
        return None if call is None else call.replica_id

    def abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            call = self._calls.pop(request_id, None)
            if call is not None:
                self._close_stream(call, request_id)

    def fail(self, request_ids: Sequence[str], error: str) -> None:
        for request_id in request_ids:
            call = self._calls.get(request_id)
            if call is not None:
                call.queues[request_id].put_nowait(_error(request_id, error))
        self.abort(request_ids)

    def _close_stream(self, call: _Call, request_id: str) -> None:
        call.open.discard(request_id)
        if not call.open and call.task is not None and not call.task.done():
            call.task.cancel()  # nobody reads the rest: the replica aborts the call

    async def _feed(self, call: _Call, admit: AdmitCall, route: RouteRequest) -> None:
        try:
            await self._run(call, admit, route)
        finally:
            if call.note is not None and not call.noted:  # never routed (refused, ...)
                call.note.routed_to(None)

    async def _run(self, call: _Call, admit: AdmitCall, route: RouteRequest) -> None:
        avoid, tried = self.avoided(), set[str]()
        for attempt in range(RETRIES + 1):
            try:
                routed = await self._dispatch(route, admit, avoid)
                before, call.replica_id = call.replica_id, routed.replica_id
                if call.note is not None and call.noted:  # run again: this one answers
                    call.note.rerouted(before, routed.replica_id)
                elif call.note is not None:
                    call.note.routed_to(routed.replica_id)
                    call.noted = True
                failed = False
                async for batch in routed.outputs:
                    if not call.produced and batch and all(o.error for o in batch):
                        await _closed(routed.outputs)  # the replica's side ends the call
                        raise ReplicaFailedError(routed.replica_id, batch[0].error or "")
                    call.produced = call.produced or bool(batch)
                    for output in batch:
                        failed = failed or output.error is not None
                        queue = call.queues.get(output.request_id)
                        if queue is not None:
                            queue.put_nowait(output)
                self._outcome(routed.replica_id, failed)
                return
            except ReplicaLostError as e:
                self._outcome(e.replica_id, True)
                if call.produced or attempt == RETRIES:
                    log.warning("replica lost", replica=e.replica_id, produced=call.produced)
                    self._end(call, e.message)
                    return
                log.warning("replica lost before any output: retrying", replica=e.replica_id)
                tried |= {e.replica_id} if e.replica_id else set()
                avoid = self._open() | tried  # a standby too may take the retry
            except QueueFullError as e:  # that replica is full: nothing ran, try another
                if call.produced or attempt == RETRIES:
                    self._end(call, str(e))
                    return
                tried |= {call.replica_id} if call.replica_id else set()
                avoid = self._open() | tried
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the replica refused the call (a domain error)
                self._end(call, str(e) or type(e).__name__)
                return

    def avoided(self) -> frozenset[str]:
        """The replicas routing leaves out now: open breakers' and idle standbys'."""
        avoided = self._open()
        if self._joined is None:
            return avoided
        return avoided | standby(self._joined(), self.replicas, avoided)

    def _open(self) -> frozenset[str]:
        return self.breakers.avoided() if self.breakers is not None else frozenset()

    def _outcome(self, replica_id: str | None, failed: bool) -> None:
        if self.breakers is None or replica_id is None:
            return
        transition = self.breakers.record(replica_id, failed)
        if transition is not None:
            self._told(transition)

    def _told(self, transition: Transition) -> None:
        log.warning(
            "replica circuit breaker",
            replica=transition.replica_id,
            state=transition.state,
            reason=transition.reason,
        )
        if self._on_breaker is not None:
            self._on_breaker(transition)

    async def _probe_forever(self, every_s: float = PROBE_EVERY_S) -> None:
        """Probe each replica whose breaker's cool-down is over; close or reopen it."""
        assert self.breakers is not None
        while True:
            await asyncio.sleep(every_s)
            for replica_id in self.breakers.due_probes():
                ok = await self.probe(replica_id)
                self._told(self.breakers.probed(replica_id, ok))

    async def probe(self, replica_id: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
        """Whether ``replica_id`` generates (a few greedy tokens of a short prompt, sent to
        it alone, as ``/health/generate`` runs them)."""
        prompt = self.inputs.tokenizer.encode(PROBE_PROMPT)
        params = SamplingParams(max_tokens=PROBE_TOKENS, min_tokens=PROBE_TOKENS, temperature=0)
        call = AdmitCall.one(new_request_id("probe"), prompt, params)
        try:
            async with asyncio.timeout(timeout_s):
                routed = await self._dispatch(RouteRequest(replica=replica_id), call, frozenset())
                if routed.replica_id != replica_id:  # it is gone: the router sent it elsewhere
                    return False
                tokens = 0
                async for batch in routed.outputs:
                    for output in batch:
                        if output.error is not None:
                            return False
                        tokens += output.token_id is not None
                return tokens > 0
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("replica probe failed", replica=replica_id, error=str(e)[:200])
            return False

    @staticmethod
    def _end(call: _Call, error: str) -> None:
        for request_id, queue in call.queues.items():
            queue.put_nowait(_error(request_id, error))

    async def _drain(self, call: _Call, request_id: str) -> AsyncIterator[StepOutput]:
        queue = call.queues[request_id]
        try:
            while True:
                output = await queue.get()
                yield output
                if output.finished:
                    return
        finally:
            self._calls.pop(request_id, None)
            self._close_stream(call, request_id)


async def _closed(outputs: AsyncIterator[object]) -> None:
    aclose = getattr(outputs, "aclose", None)
    if aclose is not None:
        await aclose()


def _error(request_id: str, error: str) -> StepOutput:
    return StepOutput(request_id, None, "", finished=True, error=error)


async def serve_call(
    engine: EngineClient, call: AdmitCall, adapters: ServingAdapters | None = None
) -> AsyncIterator[list[StepOutput]]:
    """The replica's side of a call: queue it on ``engine`` (in a group of its own, closed
    at the end: a caller gone aborts what still runs) and give its outputs in batches, each
    what is ready when the caller asks (one step's tokens of every choice together), until
    every stream has finished. A refusal (a full queue) raises before the first batch.
    ``adapters``: the replica's LoRA serving, which loads the call's adapter from its
    folder when it does not hold it (kept loaded until the call ends)."""
    group = engine.group(call.context)
    held = contextlib.ExitStack()
    try:
        folder = call.adapter_folder
        if call.adapter_id is not None and folder is not None and adapters is not None:
            held.enter_context(adapters.pinned(call.adapter_id))
            if call.adapter_id not in adapters:
                adapters.load_folder(call.adapter_id, folder)
        streams = group.admit(call)
        async for batch in _merged(streams):
            yield batch
    finally:
        group.close()
        held.close()


async def _merged(streams: Sequence[AsyncIterator[StepOutput]]) -> AsyncIterator[list[StepOutput]]:
    ready: asyncio.Queue[StepOutput | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[StepOutput]) -> None:
        try:
            async for output in stream:
                ready.put_nowait(output)
        finally:
            ready.put_nowait(None)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            batch: list[StepOutput] = []
            item = await ready.get()
            while True:
                if item is None:
                    remaining -= 1
                else:
                    batch.append(item)
                if ready.empty():
                    break
                item = ready.get_nowait()
            if batch:
                yield batch
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class ReplicaAdapters:
    """The ingress's :class:`~domain.tinker.ports.ServingAdapters`: the LoRA adapters live on
    the replicas, each of which loads the ``--lora-modules`` folders at its start under the
    ids the served models give them. Here a load checks the folder with ``check`` (what a
    replica's load would refuse, without loading it: raises as the replica's load does;
    None: no check) and notes the id; a request names its adapter by id and its replica
    applies it."""

    def __init__(self, weights_name: str, check: Callable[[Path], None] | None = None) -> None:
        self.weights_name = weights_name
        self._check = check
        self._folders: dict[str, Path] = {}

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._folders

    def folder_of(self, adapter_id: str) -> Path | None:
        """Where ``adapter_id`` is loaded from (a replica not holding it loads it there)."""
        return self._folders.get(adapter_id)

    def weights_file(self, folder: Path) -> Path:
        return folder / self.weights_name

    def load_folder(self, adapter_id: str, folder: Path) -> None:
        if self._check is not None:
            self._check(folder)
        self._folders[adapter_id] = folder

    def add_live(self, adapter_id: str, model_id: str) -> None:
        raise InvalidTrainingRequest("a training run's live weights are on its replica")

    def remove(self, adapter_id: str) -> None:
        self._folders.pop(adapter_id, None)

    def pinned(self, adapter_id: str) -> AbstractContextManager[None]:
        return contextlib.nullcontext()
