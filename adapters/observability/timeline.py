"""The engine's recent past for the web console: a :class:`EngineTimeline` is a step
observer (the domain ``StepObserver`` port) that folds every step into one bucket per
wall-clock second and keeps the last ``window_s`` of them (a ring; ten minutes by
default), for ``GET /ui/api/engine/events`` to send as a history and then live.

A bucket (:meth:`EngineTimeline.points`, plain JSON-ready dicts) holds, for its second:

- ``running`` / ``waiting``: requests holding a batch slot / queued, after the second's
  last step (the peaks in ``running_max`` / ``waiting_max``);
- ``kv_usage``: the fraction of the KV cache's blocks referenced by requests, after its
  last step; ``kv_cached``: the fraction held by the prefix cache only (free, reusable;
  None before the first step);
- ``prefix_queried`` / ``prefix_hits`` and ``prefix_hit_rate``: prompt tokens of admitted
  requests looked up in the prefix cache, of those found there (None: none looked up);
- ``generation_tps`` / ``prompt_tps``: tokens sampled / prompt tokens run in the second;
- ``ttft_s`` / ``ttft_max_s``: the mean and worst time to first token of the requests that
  got theirs in the second (arrival to first token, as ``infer:time_to_first_token_seconds``);
- ``itl_s``: the mean inter-token latency of the second's decode rows (the time since the
  previous step ended, as ``infer:inter_token_latency_seconds``);
- ``finished``: requests that ended in the second.

Seconds without a step (an idle engine sleeps) are filled in when read: the gauges carried
over from the second before, the rates zero. Steps arrive on the engine's thread and reads
come from the event loop: a lock guards the ring (held for microseconds).
"""

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from domain.observer import StepStats

DEFAULT_WINDOW_S = 600
# Requests whose first token is awaited (their arrival kept): bounded should a request
# never report its end.
MAX_ARRIVALS = 100_000


@dataclass(slots=True)
class _Bucket:
    t: int
    running: int = 0
    waiting: int = 0
    running_max: int = 0
    waiting_max: int = 0
    kv_usage: float = 0.0
    kv_cached: float | None = None
    prefix_queried: int = 0
    prefix_hits: int = 0
    generated: int = 0
    prompt: int = 0
    ttfts: list[float] = field(default_factory=list)
    itl_sum: float = 0.0
    itl_rows: int = 0
    finished: int = 0
    steps: int = 0

    def carried(self, t: int) -> "_Bucket":
        """The next, silent second: the gauges as they were."""
        return _Bucket(
            t,
            running=self.running,
            waiting=self.waiting,
            running_max=self.running,
            waiting_max=self.waiting,
            kv_usage=self.kv_usage,
            kv_cached=self.kv_cached,
        )

    def point(self) -> dict[str, Any]:
        ttfts = self.ttfts
        return {
            "t": self.t,
            "running": self.running,
            "waiting": self.waiting,
            "running_max": self.running_max,
            "waiting_max": self.waiting_max,
            "kv_usage": round(self.kv_usage, 4),
            "kv_cached": None if self.kv_cached is None else round(self.kv_cached, 4),
            "prefix_queried": self.prefix_queried,
            "prefix_hits": self.prefix_hits,
            "prefix_hit_rate": (
                round(self.prefix_hits / self.prefix_queried, 4) if self.prefix_queried else None
            ),
            "generation_tps": self.generated,
            "prompt_tps": self.prompt,
            "ttft_s": round(sum(ttfts) / len(ttfts), 5) if ttfts else None,
            "ttft_max_s": round(max(ttfts), 5) if ttfts else None,
            "itl_s": round(self.itl_sum / self.itl_rows, 5) if self.itl_rows else None,
            "finished": self.finished,
            "steps": self.steps,
        }


class EngineTimeline:
    """Per-second buckets of the engine's steps, the last ``window_s`` seconds (see the
    module). ``clock``: wall-clock seconds (the buckets' ``t``)."""

    def __init__(
        self, window_s: int = DEFAULT_WINDOW_S, clock: Callable[[], float] = time.time
    ) -> None:
        if window_s < 1:
            raise ValueError("window_s must be at least 1 second")
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: deque[_Bucket] = deque(maxlen=window_s + 1)
        self._arrivals: dict[str, float] = {}
        self._last_end: float | None = None  # the previous step's end (engine clock)

    def on_step(self, stats: StepStats) -> None:
        """One engine step's statistics (the ``StepObserver`` port): quick, never blocks."""
        now = int(self._clock())
        scheduler = stats.scheduler
        with self._lock:
            bucket = self._bucket(now)
            bucket.steps += 1
            bucket.running, bucket.waiting = scheduler.running, scheduler.waiting
            bucket.running_max = max(bucket.running_max, scheduler.running)
            bucket.waiting_max = max(bucket.waiting_max, scheduler.waiting)
            bucket.kv_usage = scheduler.kv_usage
            bucket.kv_cached = scheduler.kv_cached
            bucket.prefix_queried += scheduler.prefix_queried_tokens
            bucket.prefix_hits += scheduler.prefix_hit_tokens
            bucket.generated += stats.sampled_tokens
            bucket.prompt += scheduler.prefill_tokens
            if len(self._arrivals) < MAX_ARRIVALS:
                for start in stats.started:
                    self._arrivals[start.request_id] = start.arrival_s
            for request_id in stats.first_tokens:
                arrival = self._arrivals.pop(request_id, None)
                if arrival is not None:
                    bucket.ttfts.append(max(0.0, stats.time_s - arrival))
            for request in stats.finished:
                self._arrivals.pop(request.request_id, None)
                bucket.finished += 1
            self._observe_gap(stats, bucket)

    def _observe_gap(self, stats: StepStats, bucket: _Bucket) -> None:
        """A step's decode rows waited since the previous step ended (none after idle)."""
        if not stats.ran:
            self._last_end = None
            return
        previous = self._last_end
        self._last_end = stats.time_s if stats.scheduler.running else None
        decode_rows = sum(1 for row in stats.rows if row.decode_tokens)
        if previous is not None and decode_rows and stats.sampled_tokens:
            bucket.itl_sum += (stats.time_s - previous) * decode_rows
            bucket.itl_rows += decode_rows

    def _bucket(self, second: int) -> _Bucket:
        """The bucket of ``second`` (the lock held), the silent seconds before it filled."""
        buckets = self._buckets
        if not buckets:
            buckets.append(_Bucket(second))
            return buckets[-1]
        last = buckets[-1]
        if second <= last.t:  # a step stamped a moment late: the newest bucket takes it
            return last
        for t in range(max(last.t + 1, second - self.window_s), second):
            buckets.append(buckets[-1].carried(t))
        buckets.append(buckets[-1].carried(second) if buckets else _Bucket(second))
        return buckets[-1]

    def points(self, since: int | None = None) -> list[dict[str, Any]]:
        """The finished seconds of the window (the current one is still filling), oldest
        first; ``since``: only those after that second."""
        now = int(self._clock())
        with self._lock:
            if self._buckets and self._buckets[-1].t < now - 1:
                self._bucket(now - 1)  # the silent seconds up to the last finished one
            low = now - self.window_s if since is None else max(since, now - self.window_s - 1)
            return [b.point() for b in self._buckets if low < b.t < now]
