"""Speculative decoding in the engine: after every step, each running request that may
draft gets its drafts (``Request.draft_token_ids``) for the next step to verify.

A request drafts when its output may copy what came before (every request may: the
proposer finds nothing in open text, and a request whose drafts keep being rejected stops
— :class:`domain.speculation.Proposer`), unless ``min_tokens`` is not reached yet (EOS is
masked per row). Under a structured-output grammar each draft row is masked by the
grammar as it stands after the drafts before it, so a draft the grammar forbids is never
drawn, hence rejected. None are drafted while more requests run than
``disable_by_batch_size``: the batch fills the cores already.
"""

from collections.abc import Iterable

from domain.request import Request
from domain.speculation import Proposer, SharedSuffixes, SpeculativeConfig


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_seq_len: int) -> None:
        self.config, self.max_seq_len = config, max_seq_len
        self.shared = (
            SharedSuffixes(
                config.prompt_lookup_min, config.prompt_lookup_max, config.suffix_recent_requests
            )
            if config.method == "suffix"
            else None
        )
        self._proposers: dict[str, tuple[Proposer, int]] = {}  # id -> (it, tokens indexed)

    def propose(self, requests: Iterable[Request], running: int) -> None:
        """Drafts for ``requests`` (those that sampled this step); ``running``: requests
        in the batch now."""
        limit = self.config.disable_by_batch_size
        busy = limit is not None and running > limit
        for request in requests:
            if request.is_done:
                self.end(request)
                continue
            request.draft_token_ids = [] if busy else self._drafts(request)

    def end(self, request: Request) -> None:
        """``request`` ended: its proposer goes; its output joins the shared index when it
        finished (the suffix method)."""
        if self._proposers.pop(request.request_id, None) is None:
            return
        if self.shared is not None and request.finish_reason in ("eos", "stop", "length"):
            self.shared.add(request.request_id, request.generated_token_ids)

    def _drafts(self, request: Request) -> list[int]:
        params = request.sampling_params
        if len(request.generated_token_ids) < params.min_tokens:
            return []
        structured = params.structured
        if structured is not None and not structured.started(request.generated_token_ids):
            return []  # thinking before a constrained answer: drafts wait for its grammar
        k = min(
            self.config.num_speculative_tokens,
            params.max_tokens - len(request.generated_token_ids) - 1,
            self.max_seq_len - request.num_tokens - 1,
        )
        if k <= 0:
            return []
        proposer, indexed = self._proposers.get(request.request_id, (None, 0))
        if proposer is None:
            proposer = Proposer(self.config, request.prompt_token_ids, self.shared)
            indexed = request.num_prompt_tokens
        proposer.extend(request.token_ids_from(indexed, request.num_tokens - indexed))
        self._proposers[request.request_id] = (proposer, request.num_tokens)
        proposer.drafted, proposer.accepted = request.num_drafted, request.num_accepted
        return proposer.propose(k)
