"""SequenceRecords: sampled sequences recorded for ``stable_reinforce`` training.

A sampling client made with ``record_stability_info=True`` asks the server to keep every
sequence it samples: the request's prompt, the sampled tokens and the sampler's logprob of
each, under the ``sequence_id`` the ``asample`` reply named. Training requests name them
back with provenance spans, and the loss uses the recorded logprobs, not the client's.

As Tinker documents it, recorded sequences belong to the session that sampled them and can
be trained on for a day after sampling; each training request that uses one restarts its
day. They are dropped when their session ends, and, beyond ``max_tokens`` recorded tokens
in all (an ``infer serve`` flag), least recently used first.
"""

import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import RecordedSequence, TinkerSampleResult

DAY_S = 24 * 3600.0


@dataclass(eq=False, slots=True)
class _Entry:
    owner: str
    session_id: str
    sequence: RecordedSequence
    tokens: int
    used_at: float


class SequenceRecords:
    def __init__(
        self,
        *,
        ttl_s: float = DAY_S,
        max_tokens: int = 16 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl_s = ttl_s
        self._max_tokens = max_tokens
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._tokens = 0
        # Ids unique across restarts of the server, so an id from before one never names
        # a sequence recorded after it.
        self._prefix = f"seq-{secrets.token_hex(4)}-"
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return self._tokens

    def new_ids(self, n: int) -> list[str]:
        """``n`` fresh sequence ids (what ``asample`` names its samples before they run)."""
        return [f"{self._prefix}{next(self._ids)}" for _ in range(n)]

    def record(
        self,
        owner: str,
        session_id: str,
        ids: Sequence[str],
        prompt: Sequence[int],
        result: TinkerSampleResult,
    ) -> None:
        """Keep ``result``'s sequences under ``ids`` (one per sequence, in order)."""
        self.evict_expired()
        shared_prompt = tuple(prompt)
        now = self._clock()
        for sequence_id, seq in zip(ids, result.sequences, strict=False):
            recorded = RecordedSequence(shared_prompt, tuple(seq.tokens), tuple(seq.logprobs))
            size = len(seq.tokens) + len(shared_prompt)
            self._entries[sequence_id] = _Entry(owner, session_id, recorded, size, now)
            self._tokens += size
        while self._tokens > self._max_tokens and self._entries:
            self._drop(next(iter(self._entries)))

    def lookup(self, owner: str, session_id: str) -> Callable[[str], RecordedSequence]:
        """A lookup of ``session_id``'s recorded sequences, each use restarting its
        lifetime; an unknown, expired or foreign id raises ``InvalidTrainingRequest``."""
        self.evict_expired()

        def find(sequence_id: str) -> RecordedSequence:
            entry = self._entries.get(sequence_id)
            if entry is None or entry.owner != owner or entry.session_id != session_id:
                raise InvalidTrainingRequest(
                    f"sequence {sequence_id!r} is not recorded for this session (sample with "
                    "record_stability_info=True in the session that trains; recorded "
                    "sequences expire a day after their last use)"
                )
            entry.used_at = self._clock()
            self._entries.move_to_end(sequence_id)
            return entry.sequence

        return find

    def end_session(self, session_id: str) -> None:
        for sequence_id in [k for k, e in self._entries.items() if e.session_id == session_id]:
            self._drop(sequence_id)

    def evict_expired(self) -> None:
        cutoff = self._clock() - self._ttl_s
        while self._entries:
            sequence_id, oldest = next(iter(self._entries.items()))
            if oldest.used_at >= cutoff:
                break
            self._drop(sequence_id)

    def _drop(self, sequence_id: str) -> None:
        entry = self._entries.pop(sequence_id)
        self._tokens -= entry.tokens
