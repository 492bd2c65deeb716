"""Step statistics and the observer port: what each engine step tells metrics and tracing.

``Engine.step()`` returns a :class:`StepStats` and hands it to a :class:`StepObserver`
(no-op by default). Plain data only: the scheduler's state after the step, how many tokens
ran, and the whole life of each request that ended in the step (timestamps from the
engine's clock), so a tracer can emit a request's spans and a metrics adapter its
histograms without hooks anywhere else.
"""

from dataclasses import dataclass, field
from typing import Protocol

from domain.kv_events import KVEvent
from domain.request import NO_CONTEXT, RequestContext
from domain.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The scheduler after one step."""

    running: int  # requests holding a batch slot (and their KV)
    waiting: int  # requests queued for a slot
    prefill_tokens: int  # prompt tokens run this step
    decode_tokens: int  # generated tokens fed back this step (one per decoding request)
    kv_usage: float  # fraction of the KV cache's blocks referenced by requests
    # Prefix caching this step: prompt tokens of admitted requests looked up in the cache,
    # and of those found cached (not computed).
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    # The fraction of the KV cache's blocks free but keeping reusable KV (prefix cache).
    kv_cached: float = 0.0
    # The LoRA adapters of the running and of the waiting requests (each once; the engine
    # scans them at most once a second).
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestStart:
    """A request queued since the previous step: what it asked for, reported once."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    params: SamplingParams
    context: RequestContext = NO_CONTEXT
    adapter_id: str | None = None


@dataclass(frozen=True, slots=True)
class StepRow:
    """One request's part of a step: prompt tokens run (a prefill chunk) and generated
    tokens fed back (decode; 1 or 0)."""

    request_id: str
    prefill_tokens: int
    decode_tokens: int


@dataclass(frozen=True, slots=True)
class RequestStats:
    """One request's life, reported once, in the step it ended (finished, aborted, failed).

    Times are the engine clock's seconds; ``scheduled_s`` / ``first_token_s`` are None when
    the request ended before reaching that point (aborted while waiting, failed prefill).
    """

    request_id: str
    arrival_s: float
    scheduled_s: float | None
    first_token_s: float | None
    finished_s: float
    finish_reason: str  # eos | stop | length | abort | error
    prompt_tokens: int
    completion_tokens: int
    adapter_id: str | None = None
    context: RequestContext = NO_CONTEXT
    preemptions: int = 0  # times the request was put back to the queue and recomputed
    # Speculative decoding: draft tokens verified for it, and of those accepted.
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one ``Engine.step()`` did. ``ran`` is False when nothing was run (idle, or a
    static batch still filling up); requests may still have ended (aborts)."""

    ran: bool
    time_s: float  # when the step ended (the engine's clock)
    scheduler: SchedulerStats
    sampled_tokens: int = 0  # tokens generated this step, across requests
    # Requests that produced their first token in this step.
    first_tokens: tuple[str, ...] = ()
    finished: tuple[RequestStats, ...] = field(default_factory=tuple)
    start_s: float | None = None  # when the step began (None: nothing ran)
    # The batch: each request that ran in this step, with its tokens.
    rows: tuple[StepRow, ...] = ()
    # Requests queued since the previous step (reported before any row of theirs).
    started: tuple[RequestStart, ...] = ()
    preempted: tuple[str, ...] = ()  # requests put back to the queue this step
    # Speculative decoding: requests that ran drafts this step, their draft tokens, and
    # of those accepted.
    drafts: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # vLLM's KV cache events of this step (``kv_events_config``; else none).
    kv_events: tuple[KVEvent, ...] = ()


class StepObserver(Protocol):
    """Receives every step's statistics, on the engine's thread: must be quick, never block,
    never raise (an observer's failure is logged and ignored by the engine)."""

    def on_step(self, stats: StepStats) -> None: ...


class NullObserver:
    """The default: observes nothing, costs one call per step."""

    def on_step(self, stats: StepStats) -> None:
        pass


@dataclass(frozen=True, slots=True)
class TrainingOpStats:
    """One Tinker operation that ran (forward_backward, optim_step, a sample, a save...):
    its kind as the Tinker API names it, the tenant, how long it ran (monotonic seconds),
    whether it succeeded, and the tokens it processed where it has them."""

    op: str
    tenant_id: str
    start_s: float
    end_s: float
    ok: bool
    tokens: int = 0
    run_id: str | None = None
    session_id: str | None = None


class TrainingObserver(Protocol):
    """Receives every Tinker operation's statistics when it ends (metrics, traces); must
    be quick and never raise."""

    def on_training_op(self, stats: TrainingOpStats) -> None: ...
