"""Completions: what ``retrieve_futures`` reports, per sampling session and clone.

A sampling session's clients (the original is clone 0; ``join`` hands out the others'
ids) each poll for their own samples' completions: a sample with ``seq_id`` belongs to
clone ``seq_id // 1_000_000_000``. Each (sampler, clone) has a queue of completion events
with increasing cursors; a poll gets those after its ``prev_cursor`` (long-polling while
there are none) and those at or before it are dropped. Acknowledged request ids
(``retrieved_request_ids``) drop the futures themselves: the client has their results.

Bounded: at most ``max_events`` unseen events per queue (the oldest dropped: a client
that never polls loses nothing else, it fetches each future itself), at most
``max_clones`` queues per sampler (the least recently used dropped), and a sampler's
queues go with its session.
"""

import asyncio
import contextlib
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import structlog

from application.tinker.futures import Future, FutureStore
from application.tinker.sampling import SamplerRecord
from domain.tinker.errors import InvalidTrainingRequest

log = structlog.get_logger(__name__)

CLONE_SPAN = 1_000_000_000  # a clone's seq_ids: clone * CLONE_SPAN + n
MAX_EVENTS = 4096
MAX_CLONES = 1024
MAX_ACKS = 10_000  # retrieved_request_ids in one poll


@dataclass(frozen=True, slots=True)
class Completion:
    cursor: int
    request_id: str
    ok: bool


@dataclass(frozen=True, slots=True)
class Retrieved:
    completions: list[Completion]
    cursor: int


@dataclass(eq=False)
class _Queue:
    events: deque[Completion] = field(default_factory=deque)
    # Requests of this clone not yet acknowledged (their futures may be dropped on ack).
    members: OrderedDict[str, None] = field(default_factory=OrderedDict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


@dataclass(eq=False)
class _Sampler:
    owner: str
    session_id: str
    clients: int = 0  # clone ids handed out by join (the original client is 0)
    queues: OrderedDict[int, _Queue] = field(default_factory=OrderedDict)


class Completions:
    def __init__(
        self,
        futures: FutureStore,
        *,
        max_events: int = MAX_EVENTS,
        max_clones: int = MAX_CLONES,
    ) -> None:
        self._futures = futures
        self._max_events = max_events
        self._max_clones = max_clones
        self._samplers: dict[str, _Sampler] = {}
        # One cursor sequence for every queue: a queue dropped and made again never
        # reuses a cursor a client has already seen.
        self._cursors = itertools.count(1)

    def join(self, sampler: SamplerRecord) -> int:
        """A new client of ``sampler``: its clone id (1, 2, ...; the original is 0)."""
        state = self._state(sampler)
        if state.clients >= CLONE_SPAN - 1:
            raise InvalidTrainingRequest(f"sampling session {sampler.id!r} has too many clients")
        state.clients += 1
        return state.clients

    def track(self, sampler: SamplerRecord, seq_id: int | None, future: Future) -> None:
        """Report ``future`` to the clone its ``seq_id`` names when it finishes."""
        clone = max(0, seq_id or 0) // CLONE_SPAN
        members = self._queue(self._state(sampler), clone).members
        members[future.id] = None
        while len(members) > self._max_events:  # never acknowledged: expire as futures do
            members.popitem(last=False)
        sampler_id = sampler.id

        def done(finished: Future) -> None:
            state = self._samplers.get(sampler_id)
            if state is not None:  # gone with its session: nobody polls for it
                self._push(self._queue(state, clone), finished)

        if future.finished:
            done(future)
        else:
            future.on_done.append(done)

    async def retrieve(
        self,
        sampler: SamplerRecord,
        clone: int,
        prev_cursor: int,
        timeout_s: float,
        acks: list[str],
    ) -> Retrieved:
        """The completions after ``prev_cursor`` (waiting up to ``timeout_s`` for one when
        there are none); the events up to it and the acknowledged futures are dropped."""
        if not 0 <= clone <= CLONE_SPAN:  # the SDK's random clone ids reach CLONE_SPAN
            raise InvalidTrainingRequest(f"cloned_sampler_id must be in 0..{CLONE_SPAN}")
        if prev_cursor < 0:
            raise InvalidTrainingRequest("prev_cursor must be >= 0")
        if timeout_s < 0:
            raise InvalidTrainingRequest("timeout must be >= 0 (0: answer at once)")
        if len(acks) > MAX_ACKS:
            raise InvalidTrainingRequest(f"at most {MAX_ACKS} retrieved_request_ids per poll")
        queue = self._queue(self._state(sampler), clone)
        for request_id in acks:
            if request_id in queue.members:  # this clone's: its client has the result
                del queue.members[request_id]
                self._futures.forget(sampler.owner, request_id)
        while queue.events and queue.events[0].cursor <= prev_cursor:
            queue.events.popleft()
        if not queue.events and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(queue.changed.wait(), timeout_s)
        found = [e for e in queue.events if e.cursor > prev_cursor]
        return Retrieved(found, found[-1].cursor if found else prev_cursor)

    def end_session(self, session_id: str) -> None:
        """Drop the queues of the session's samplers (their polls end now)."""
        for sampler_id in [s for s, v in self._samplers.items() if v.session_id == session_id]:
            for queue in self._samplers.pop(sampler_id).queues.values():
                queue.wake()

    def close(self) -> None:
        """Wake every poll (the server stops)."""
        for state in self._samplers.values():
            for queue in state.queues.values():
                queue.wake()

    def queued(self) -> int:
        """Completion events held, all queues together."""
        return sum(len(q.events) for s in self._samplers.values() for q in s.queues.values())

    def _state(self, sampler: SamplerRecord) -> _Sampler:
        state = self._samplers.get(sampler.id)
        if state is None:
            state = self._samplers[sampler.id] = _Sampler(sampler.owner, sampler.session_id)
        return state

    def _queue(self, state: _Sampler, clone: int) -> _Queue:
        queue = state.queues.get(clone)
        if queue is None:
            queue = state.queues[clone] = _Queue()
            while len(state.queues) > self._max_clones:
                _, dropped = state.queues.popitem(last=False)
                dropped.wake()
        else:
            state.queues.move_to_end(clone)
        return queue

    def _push(self, queue: _Queue, future: Future) -> None:
        queue.events.append(Completion(next(self._cursors), future.id, future.error is None))
        if len(queue.events) > self._max_events:
            dropped = queue.events.popleft()
            log.warning("tinker_completion_dropped", request_id=dropped.request_id)
        queue.wake()
