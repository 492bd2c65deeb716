"""Prefill sharing: one prompt's KV computed once for several requests.

``n`` > 1 choices of a prompt share its first choice's prefill (``prefill_source_id``,
``shares_prefill``: the source stops at the prompt's last position until they fork it), and
so does a request admitted while a running one computes its very prompt (in-flight
sharing, with prefix caching on). What a request's KV blocks are keyed by beside their
tokens is :func:`cache_namespace`.
"""

from collections.abc import Callable, Iterable

from domain.kv_blocks import BlockManager, CachedPrefix
from domain.request import Request
from domain.scheduler.outputs import ScheduledChunk


class SharedPrefill:
    """Links requests to the prefill they share, and forks it when it is done."""

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks

    def join(self, request: Request, prefix: CachedPrefix, running: Iterable[Request]) -> bool:
        """In-flight prefix sharing (with prefix caching on): a request whose whole prompt
        a running request is computing right now (the same tokens, adapter and cache salt:
        Tinker's ``num_samples``, a burst of one prompt) waits for that prefill and forks
        its blocks, as ``n`` > 1 choices do (:meth:`fork`), instead of computing the prompt
        again beside it. True when it was linked (it holds no blocks)."""
        if not self.blocks.enable_caching or request.sampling_params.prompt_logprobs:
            return False
        start, size = request.num_prompt_tokens - 1, self.blocks.block_size
        if start // size * size <= prefix.num_tokens:
            return False  # no full block to gain beyond what is cached
        prompt, namespace = request.prompt_token_ids, cache_namespace(request)
        for source in running:
            if (
                source.num_prompt_tokens == request.num_prompt_tokens
                and source.num_computed_tokens < start
                and source.prefill_source_id is None
                and not source.is_done
                and source.request_id in self.blocks
                and source.prompt_token_ids == prompt
                and cache_namespace(source) == namespace
            ):
                request.prefill_source_id = source.request_id
                request.num_computed_tokens = 0
                return True
        return False

    def fork(
        self, request: Request, budget: int, live: Callable[[str], Request | None]
    ) -> ScheduledChunk | None:
        """A choice sharing another's prefill (``prefill_source_id``; ``live`` finds the
        source among the running): once the source computed the prompt's first
        ``num_prompt_tokens - 1`` positions, this request forks its full blocks among them
        and runs the rest (None meanwhile: it waits). When the source cannot serve (done, or
        not running: it was preempted), the link is dropped and the request prefills
        itself."""
        source_id = request.prefill_source_id
        if source_id is None:
            return None
        source = live(source_id)
        if source is None or source.is_done:
            request.prefill_source_id = None
            return None
        start = request.num_prompt_tokens - 1
        if source.num_computed_tokens < start:
            return None
        request.prefill_source_id = None  # forked once; a recompute prefills itself
        request.num_computed_tokens = self.blocks.fork(source_id, request.request_id, start)
        return next_chunk(request, budget)


def next_chunk(request: Request, budget: int) -> ScheduledChunk | None:
    """``request``'s next tokens within ``budget`` (None: none to run). A prompt whose
    choices share its prefill stops before its last position until they have forked it."""
    end = request.num_tokens
    if request.shares_prefill and request.num_computed_tokens < request.num_prompt_tokens - 1:
        end = request.num_prompt_tokens - 1  # its choices fork this much, then all run on
    count = min(end - request.num_computed_tokens, budget)
    return ScheduledChunk(request, request.num_computed_tokens, count) if count > 0 else None


def cache_namespace(request: Request) -> str | None:
    """What a request's KV blocks are keyed by beside their tokens: its LoRA adapter (KV
    computed under other weights is never reused) and its ``cache_salt`` (blocks are shared
    only between requests with the same salt)."""
    return key_namespace(request.adapter_id, request.sampling_params.cache_salt)


def key_namespace(adapter_id: str | None, cache_salt: str | None) -> str | None:
    """:func:`cache_namespace` of a request with this adapter and salt (the fleet's router
    keys a prompt's blocks as the replica will)."""
    if cache_salt is None:
        return adapter_id
    return f"{adapter_id or ''}\x00salt:{cache_salt}"
