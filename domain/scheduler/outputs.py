"""What a step's schedule says and what comes back: plain data between the scheduler, the
runner port and the output stage (lists of ints and the live requests, never tensors)."""

from dataclasses import dataclass, field

from domain.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` of ``request``'s tokens, from position ``start``, run this step.

    ``block_table``: the request's KV blocks, in order, covering positions ``[0, start +
    num_tokens)`` (position ``p`` in block ``p // block_size``); positions before ``start``
    hold computed KV (its own, a cached prefix's or a sibling choice's, shared)."""

    request: Request
    start: int
    num_tokens: int
    block_table: tuple[int, ...] = ()
    # Speculative decoding: drafted tokens run after the chunk's (its newest) token, each
    # row sampled; the runner verifies them (``RunnerOutput.accepted``). The table covers
    # them too.
    drafts: tuple[int, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        return [*self.request.token_ids_from(self.start, self.num_tokens), *self.drafts]

    @property
    def num_rows(self) -> int:
        """Positions the chunk runs: its tokens and its drafts."""
        return self.num_tokens + len(self.drafts)

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the newest token, so the step samples a next one."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Requests whose runner state (generator, grammar matcher) can be freed now; their KV
    # blocks are the scheduler's, freed already.
    released: list[str] = field(default_factory=list)
    # Requests put back to the waiting queue this step (also in ``released``): when
    # admitted again they start over at position 0 (prompt and generated tokens recomputed).
    preempted: list[str] = field(default_factory=list)
    # The tokenizer's EOS ids: what the runner masks out (with each request's stop ids)
    # while a request has generated fewer than its ``min_tokens``.
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class KVStats:
    """The KV block pool: the fraction referenced by requests, and the prefix cache's
    cumulative counters (tokens of admitted requests looked up, of those found cached)."""

    usage: float
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    cached: float = 0.0  # the fraction of blocks free but keeping reusable KV (the prefix cache)


@dataclass(frozen=True, slots=True)
class SampledToken:
    """A token a request got this step, and the finish it caused (None: runs on).
    ``stop_token``: it ended the request as an EOS / stop id, so it has no text.
    ``index``: its place among the request's generated tokens (a step may give a request
    several: accepted drafts); ``logprob`` / ``top_logprobs``: the runner's for it."""

    request: Request
    token_id: int
    finish_reason: str | None
    stop_token: bool
    index: int = 0
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True)
class RunnerOutput:
    """The runner port's answer (:meth:`domain.ports.ModelRunner.execute`): per request id
    that sampled this step, its token (and the token's logprob)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, float] = field(default_factory=dict)
    top_logprobs: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # Speculative decoding: per request id that ran drafts, those accepted (a prefix of
    # them, maybe none), which come before its ``sampled_token_ids`` token; and, when it
    # asked for logprobs, theirs.
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[float]] = field(default_factory=dict)
    accepted_top_logprobs: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)
    # Per request id that asked for prompt logprobs: those of the prompt tokens this step's
    # chunk predicts (positions start+1 .. within the prompt), in order.
    prompt_logprobs: dict[str, list[float]] = field(default_factory=dict)
    prompt_top_logprobs: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)
    # With ``prompt_ranks``: each of those prompt tokens' rank (1: the most likely).
    prompt_ranks: dict[str, list[int]] = field(default_factory=dict)
    # The same positions' target logprobs and draws (``prompt_target_ids``, ``prompt_samples``).
    prompt_target_logprobs: dict[str, list[list[float]]] = field(default_factory=dict)
    prompt_samples: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)
