"""SessionTraces: each session's operations as a timeline, for ``trace_export``.

Every Tinker operation that ran (the service's observer: its kind, start, end, outcome,
tokens and training run) is kept under its session, and a session's timeline is exported
in the Chrome trace-event JSON format, which Perfetto (ui.perfetto.dev) and
chrome://tracing open: one track per training run, one for sampling. The export is a
signed link (HMAC over the session and the link's expiry, with the checkpoint storage's
key): the signature is the permission. In memory: the newest ``max_ops`` operations per
session, for at most ``max_sessions`` sessions (the least recently active dropped).
"""

import hashlib
import hmac
import json
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from application.tinker.downloads import LinkRefusedError
from domain.observer import TrainingOpStats

MAX_OPS = 20_000
MAX_SESSIONS = 4096
LINK_TTL_S = 3600
_PID = 1


@dataclass(frozen=True, slots=True)
class TracedOp:
    op: str
    start: float  # unix seconds
    end: float
    ok: bool
    tokens: int
    run_id: str | None


@dataclass(frozen=True, slots=True)
class TraceLink:
    session_id: str
    expires: int  # unix seconds
    signature: str


class SessionTraces:
    def __init__(
        self,
        secret: Callable[[], bytes],
        *,
        max_ops: int = MAX_OPS,
        max_sessions: int = MAX_SESSIONS,
        link_ttl_s: int = LINK_TTL_S,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``secret``: the key links are signed with; ``clock``: the one operations' times
        are read on (the futures'), turned into ``wall_clock`` times here."""
        self._secret = secret
        self._max_ops = max_ops
        self._max_sessions = max_sessions
        self._link_ttl_s = link_ttl_s
        self._wall_clock = wall_clock
        self._clock = clock
        self._sessions: OrderedDict[str, deque[TracedOp]] = OrderedDict()
        self._lock = threading.Lock()

    def on_training_op(self, stats: TrainingOpStats) -> None:
        """The service's observer: an operation of a session."""
        if stats.session_id is None:
            return
        offset = self._wall_clock() - self._clock()
        op = TracedOp(
            stats.op,
            stats.start_s + offset,
            stats.end_s + offset,
            stats.ok,
            stats.tokens,
            stats.run_id,
        )
        with self._lock:
            ops = self._sessions.get(stats.session_id)
            if ops is None:
                ops = self._sessions[stats.session_id] = deque(maxlen=self._max_ops)
                while len(self._sessions) > self._max_sessions:
                    self._sessions.popitem(last=False)
            else:
                self._sessions.move_to_end(stats.session_id)
            ops.append(op)

    def ops(self, session_id: str) -> list[TracedOp]:
        with self._lock:
            return list(self._sessions.get(session_id, ()))

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop the operations of sessions ``keep`` refuses (forgotten ones)."""
        with self._lock:
            for session_id in [s for s in self._sessions if not keep(s)]:
                del self._sessions[session_id]

    def link(self, session_id: str) -> TraceLink:
        expires = int(self._wall_clock()) + self._link_ttl_s
        return TraceLink(session_id, expires, self._sign(session_id, expires))

    def export(self, session_id: str, expires: int, signature: str) -> bytes:
        """The trace a signed link names."""
        expected = self._sign(session_id, expires)
        if not hmac.compare_digest(signature, expected) or expires < self._wall_clock():
            raise LinkRefusedError("trace link invalid or expired: export the trace again")
        return chrome_trace(session_id, self.ops(session_id))

    def _sign(self, session_id: str, expires: int) -> str:
        message = f"trace\n{session_id}\n{expires}".encode()
        return hmac.new(self._secret(), message, hashlib.sha256).hexdigest()


def chrome_trace(session_id: str, ops: list[TracedOp]) -> bytes:
    """``ops`` as Chrome trace-event JSON: complete events (``ph: X``) in microseconds,
    one thread (track) per training run and one for sampling."""
    tracks: dict[str, int] = {}
    events: list[dict[str, object]] = [
        {"name": "process_name", "ph": "M", "pid": _PID, "args": {"name": session_id}}
    ]
    for op in ops:
        track = op.run_id or "sampling"
        if track not in tracks:
            tracks[track] = len(tracks) + 1
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": _PID,
                    "tid": tracks[track],
                    "args": {"name": track},
                }
            )
        args: dict[str, object] = {"ok": op.ok, "tokens": op.tokens}
        if op.run_id is not None:
            args["model_id"] = op.run_id
        events.append(
            {
                "name": op.op,
                "cat": "tinker",
                "ph": "X",
                "ts": round(op.start * 1e6),
                "dur": max(0, round((op.end - op.start) * 1e6)),
                "pid": _PID,
                "tid": tracks[track],
                "args": args,
            }
        )
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}).encode()
