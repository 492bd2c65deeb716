"""A completion request's lifecycle, and what each engine step reports about it.

Prefill and decode are not separate code paths: a request has ``num_computed_tokens`` and
the scheduler decides how many of its tokens run in a step (all of a prompt, a chunk of
it, or the one newest token).
"""

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from domain.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestContext:
    """Who asked, and where from: plain data the engine carries for policies and observers.

    ``tenant_id``: the caller's tenant (None: an open local server); ``priority``: higher
    runs first under fair scheduling (0 by default); ``trace``: the caller's W3C trace
    context as header-style entries (``traceparent``, ``tracestate``) for the tracing
    adapter, opaque to the engine."""

    tenant_id: str | None = None
    priority: int = 0
    trace: tuple[tuple[str, str], ...] = ()


NO_CONTEXT = RequestContext()


@dataclass(frozen=True, slots=True)
class AdmitCall:
    """One admission, built once by the use case and taken unchanged by every layer down to
    ``Engine.admit``: prepared prompts, ``n`` request ids each (choice j of prompt i at
    ``i * n + j``), queued all together or none, with ``adapter_id``'s LoRA (None: the base
    model) for ``context``'s caller. Plain data: a fleet sends it to a replica in another
    process."""

    request_ids: tuple[str, ...]
    prompts: tuple[list[int], ...]
    params: SamplingParams
    n: int = 1
    adapter_id: str | None = None
    context: RequestContext = NO_CONTEXT
    # Where a fleet's replica loads the adapter from when it does not hold it (a Tinker
    # checkpoint served by path); None: it holds it, or there is none.
    adapter_folder: Path | None = None

    @classmethod
    def one(
        cls,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        adapter_id: str | None = None,
        context: RequestContext = NO_CONTEXT,
    ) -> "AdmitCall":
        """One prompt, one choice."""
        return cls((request_id,), (prompt,), params, adapter_id=adapter_id, context=context)


class RequestState(Enum):
    WAITING = "waiting"  # queued, or admitted and running: how many tokens ran says which
    FINISHED = "finished"
    FAILED = "failed"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time_s: float

    state: RequestState = RequestState.WAITING
    generated_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    # Lifecycle times (the engine's clock): first scheduled, first token, ended.
    scheduled_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    # The LoRA adapter the request runs with (None: the base model); the runner knows it.
    adapter_id: str | None = None
    context: RequestContext = NO_CONTEXT
    # With ``sampling_params.prompt_logprobs``: logprobs of prompt tokens 1.., as computed
    # (NaN, and empty rows below, before ``prompt_logprobs_from``: served from the cache).
    prompt_logprobs: list[float] = field(default_factory=list)
    # With ``sampling_params.prompt_top_logprobs``: the alternatives at those positions.
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # With ``sampling_params.prompt_ranks``: those tokens' ranks (0 before
    # ``prompt_logprobs_from``).
    prompt_ranks: list[int] = field(default_factory=list)
    # With ``prompt_target_ids`` / ``prompt_samples``: per position, the logprobs of its
    # target ids (in their order) / its draws (id, logprob).
    prompt_target_logprobs: list[list[float]] = field(default_factory=list)
    prompt_samples: list[list[tuple[int, float]]] = field(default_factory=list)
    # Times the scheduler preempted the request (put it back to the queue, runner state
    # freed); it is then recomputed: prompt and generated tokens prefilled again.
    num_preemptions: int = 0
    # Tokens (prompt + generated) the request held at its last preemption: positions below
    # this count as prefill work when recomputed (0: never preempted).
    num_recompute_tokens: int = 0
    # Another choice of the same prompt (``n`` > 1, admitted together): this request waits
    # for it to compute the prompt's first ``num_prompt_tokens - 1`` positions, copies
    # their KV from it and runs only the last prompt token. None: it prefills itself.
    prefill_source_id: str | None = None
    # Other choices copy this request's prompt KV: its prefill stops one token short, so
    # that it is still running (it has sampled nothing) when they copy, and every choice
    # runs its last prompt token, and samples its first token, in the same step.
    shares_prefill: bool = False
    # Speculative decoding: the drafts the next step verifies (after the newest token),
    # and so far drafted / accepted. ``num_draws``: rows sampled for the request (a
    # verified draft costs a draw too): a seeded generator recreated after a preemption
    # skips this many.
    draft_token_ids: list[int] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0
    num_draws: int = 0
    # Prompt tokens whose KV came from the prefix cache when the request was first
    # scheduled (OpenAI's ``cached_tokens``); None: not scheduled yet.
    num_cached_tokens: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return self.num_prompt_tokens + len(self.generated_token_ids)

    @property
    def is_done(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.FAILED)

    def token_ids_from(self, start: int, count: int) -> list[int]:
        """``count`` tokens of prompt + output starting at position ``start``."""
        prompt = self.prompt_token_ids
        if start + count <= len(prompt):
            return prompt[start : start + count]
        return (prompt + self.generated_token_ids)[start : start + count]

    def finish(self, reason: str) -> None:
        self.state, self.finish_reason = RequestState.FINISHED, reason

    def fail(self) -> None:
        """The request's step failed (its error goes to the client in a StepOutput)."""
        self.state, self.finish_reason = RequestState.FAILED, "error"


@dataclass(frozen=True)
class StepOutput:
    """One step's news for one request: a token (and its text), or the end, or an error."""

    request_id: str
    token_id: int | None
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    # Why a ``stop`` finish stopped (vLLM's ``stop_reason``): the stop string the text hit,
    # or the ``stop_token_ids`` id generated; None otherwise (EOS, length, not finished).
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Of the prompt's tokens, those found in the prefix cache (not computed again).
    cached_tokens: int = 0
    # The token's logprob (when ``sampling_params.logprobs`` is set), and the top
    # ``logprobs`` alternatives (id, logprob), best first.
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    # Logprobs of prompt tokens 1.. (``sampling_params.prompt_logprobs``; first output only)
    # and, with ``prompt_top_logprobs``, each position's alternatives.
    prompt_logprobs: tuple[float, ...] | None = None
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    prompt_ranks: tuple[int, ...] | None = None  # with ``prompt_ranks``: each token's rank
    # With ``prompt_target_ids`` / ``prompt_samples``: the same positions' target logprobs
    # and draws (as :class:`Request` holds them).
    prompt_target_logprobs: tuple[tuple[float, ...], ...] | None = None
    prompt_samples: tuple[tuple[tuple[int, float], ...], ...] | None = None


def token_finish_reason(
    params: SamplingParams, eos_token_ids: frozenset[int], token: int, num_generated: int
) -> str | None:
    """Whether generating ``token`` (the ``num_generated``-th) ends a request, and why:
    ``eos`` (an EOS id, unless ``ignore_eos``), ``stop`` (one of ``stop_token_ids``),
    ``length`` (``max_tokens`` reached), or None. The one rule for token-level stops (stop
    strings need text: the output stage finds them)."""
    if token in eos_token_ids and not params.ignore_eos:
        return "eos"
    if token in params.stop_token_ids:
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None


def is_stop_token(params: SamplingParams, eos_token_ids: frozenset[int], token: int) -> bool:
    """``token`` ended its request by being a stop or EOS id: it has no text in the output."""
    return (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
