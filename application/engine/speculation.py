"""Speculative decoding in the engine: after every step, each running request that may
draft gets its drafts (``Request.draft_token_ids``) for the next step to verify.

A request drafts when its output may copy what came before (every request may: the
proposer finds nothing in open text, and a request whose drafts keep being rejected stops
— :class:`domain.speculation.Proposer`), unless ``min_tokens`` is not reached yet (EOS is
masked per row). Under a structured-output grammar each draft row is masked by the
grammar as it stands after the drafts before it, so a draft the grammar forbids is never
drawn, hence rejected. None are drafted while more requests run than
``disable_by_batch_size`` (when set).

Where the runner measured what its steps cost (``StepCosts``: the torch runner, at the
first start on a machine, cached), each step verifies the drafts that pay: a request's
i-th draft is worth its running acceptance to the i-th power in expected tokens, and the
step takes the likeliest drafts while the expected tokens per unit of measured time beat
plain decoding (:func:`domain.speculation.plan_drafts`) — at one stream on the 2-vCPU
Zen 5, where a step of 1 + 3 rows costs 1.77x one row, from 29 % acceptance; where rows
cost what they read, never. Without costs (the fake runner), a request drafts until its
acceptance falls below ``min_acceptance``.

With ``method: draft_model`` the drafts come from :class:`DraftModel`: a smaller model
with the target's tokenizer, behind the same ``ModelRunner`` port, on its own KV pool.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import structlog

from domain.config import EngineConfig
from domain.kv_blocks import BlockManager
from domain.ports import ModelRunner
from domain.request import Request
from domain.sampling import SamplingParams
from domain.scheduler import RunnerOutput, SchedulerOutput
from domain.scheduler.outputs import ScheduledChunk
from domain.scheduler.shared_prefill import key_namespace
from domain.speculation import (
    Proposer,
    SharedSuffixes,
    SpeculativeConfig,
    StepCosts,
    acceptance,
    drafting_pays,
    plan_drafts,
)

log = structlog.get_logger(__name__)


def draft_params(params: SamplingParams) -> SamplingParams:
    """How the draft model picks: its most likely token (verification keeps the target's
    law whatever the drafts are: a draft is kept only where the target draws it), under
    the request's own logits processing (bias, allowed ids, bad words, penalties), which
    the target's draws obey too."""
    return SamplingParams(
        temperature=0.0,
        max_tokens=1 << 30,
        ignore_eos=True,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=params.logit_bias,
        allowed_token_ids=params.allowed_token_ids,
        bad_words=params.bad_words,
        cache_salt=params.cache_salt,
    )


@dataclass(slots=True)
class _DraftKV:
    """What the draft model's KV holds for one request: positions ``[0, base)`` are the
    target's tokens, then ``drafts`` (the drafts written, those before the last)."""

    base: int = 0
    drafts: list[int] = field(default_factory=list)
    named: int = 0  # positions whose full blocks are named in the prefix cache

    def valid(self, request: Request) -> int:
        """Positions still right for the request's tokens now (rejected drafts' are not)."""
        good = self.base
        for i, token in enumerate(self.drafts):
            if self.base + i >= request.num_tokens or request.token_ids_from(good, 1) != [token]:
                break
            good += 1
        return good


class DraftModel:
    """Drafts from a smaller model with the target's tokenizer (vLLM's ``draft_model``):
    for each request, its tokens the draft model has not seen yet as one chunk (the whole
    prompt the first time, a prefix cache of its own aside), then ``k - 1`` greedy decode
    steps — all requests batched in each of the ``k`` forwards, on the ``runner`` port over
    its own KV pool (``num_blocks`` of ``block_size``; a request that finds no room drafts
    nothing this step). A rejected draft's KV is written over next time. A failing draft
    forward costs the step its drafts, never a request."""

    def __init__(
        self,
        runner: ModelRunner,
        num_blocks: int,
        block_size: int,
        *,
        max_chunk: int = 512,
        vocab_size: int | None = None,
    ) -> None:
        """``max_chunk``: the most of a request's unseen tokens run in one forward (a long
        prompt is caught up in several); ``vocab_size``: the target's (drafts beyond it are
        cut)."""
        self.runner, self.max_chunk, self.vocab_size = runner, max_chunk, vocab_size
        self.blocks = BlockManager(num_blocks, block_size)
        self._kv: dict[str, _DraftKV] = {}

    def propose(self, wanted: Sequence[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to ``k`` drafts per ``(request, k)`` (its newest token not yet run)."""
        shadows = []
        for request, k in wanted:
            start = self._room(request, k)
            if start is not None:
                shadows.append(_Shadow.of(request, start, k))
        try:
            self._run(shadows)
        except Exception:  # the target's step goes on without drafts
            log.exception("draft model step failed", requests=len(shadows))
            for shadow in shadows:
                self.end(shadow.request.request_id)
            return {}
        for shadow in shadows:  # the last draft's KV is not written
            rid = shadow.request.request_id
            base = shadow.request.num_tokens - len(shadow.drafts)
            named = self._kv[rid].named if rid in self._kv else 0
            self._kv[rid] = _DraftKV(base, shadow.drafts[:-1], named)
        return {shadow.request.request_id: shadow.drafts for shadow in shadows}

    def end(self, request_id: str) -> None:
        """The request stopped drafting: its KV blocks and runner state go."""
        if self._kv.pop(request_id, None) is not None or request_id in self.blocks:
            self.blocks.free(request_id)
            self.runner.release([request_id])

    def _room(self, request: Request, k: int) -> int | None:
        """The request's first position the draft model has no KV for, its blocks grown
        to hold ``k`` more positions; None: no room in the pool."""
        rid = request.request_id
        kv = self._kv.get(rid)
        if kv is None or rid not in self.blocks:
            tokens = request.token_ids_from(0, request.num_tokens)
            # the draft has no adapter; a salted request shares blocks within its salt only
            namespace = key_namespace(None, request.sampling_params.cache_salt)
            prefix = self.blocks.find_cached_prefix(tokens, namespace)
            size = request.num_tokens + k - 1
            if self.blocks.allocate(rid, size, adapter_id=namespace, prefix=prefix) is None:
                return None
            return prefix.num_tokens
        start = min(kv.valid(request), request.num_tokens - 1)
        full = start // self.blocks.block_size * self.blocks.block_size
        if full > kv.named:  # a block of good KV filled up: it joins the cache
            self.blocks.commit(rid, request.token_ids_from(0, full), full)
            kv.named = full
        if self.blocks.allocate(rid, request.num_tokens + k - 1) is None:
            self.end(rid)
            return None
        return start

    def _run(self, shadows: list["_Shadow"]) -> None:
        tables = {
            s.request.request_id: tuple(self.blocks.block_table(s.request.request_id))
            for s in shadows
        }
        # Catch up: unseen tokens beyond one chunk run first, sampling nothing.
        while chunks := [
            s.catch_up(self.max_chunk, tables) for s in shadows if s.behind(self.max_chunk)
        ]:
            self.runner.execute(SchedulerOutput(chunks))
        while chunks := [s.chunk(tables) for s in shadows if not s.done]:
            result = self.runner.execute(SchedulerOutput(chunks))
            for shadow in shadows:
                if not shadow.done:
                    shadow.take(result, self.vocab_size)


@dataclass(slots=True)
class _Shadow:
    """One request as the draft model runs it this step: ``request`` holds the target's
    tokens up to ``pending`` + 1 (then each draft as it comes); ``tail``: the target's
    newer tokens, run as the chunk's draft rows — decode rows, as cheap as one — and
    checked as drafts are: where the draft model would not have written one of them, the
    step samples from the wrong row (every row's KV is good: they are the target's tokens)
    and the last token runs again for its logits."""

    request: Request
    pending: int  # the next position to run
    k: int
    tail: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    done: bool = False

    @classmethod
    def of(cls, request: Request, start: int, k: int) -> "_Shadow":
        generated = list(request.generated_token_ids)
        tail: list[int] = []
        unseen = request.num_tokens - start
        if 1 < unseen <= k + 1 and start >= request.num_prompt_tokens:
            keep = len(generated) - unseen + 1
            generated, tail = generated[:keep], generated[keep:]
        shadow = Request(
            request.request_id,
            request.prompt_token_ids,
            draft_params(request.sampling_params),
            0.0,
            generated_token_ids=generated,
        )
        return cls(shadow, start, k, tail)

    def behind(self, max_chunk: int) -> bool:
        return self.request.num_tokens - self.pending > max_chunk

    def catch_up(self, max_chunk: int, tables: dict[str, tuple[int, ...]]) -> ScheduledChunk:
        chunk = ScheduledChunk(
            self.request, self.pending, max_chunk, tables[self.request.request_id]
        )
        self.pending += max_chunk
        return chunk

    def chunk(self, tables: dict[str, tuple[int, ...]]) -> ScheduledChunk:
        count = self.request.num_tokens - self.pending
        table = tables[self.request.request_id]
        return ScheduledChunk(self.request, self.pending, count, table, tuple(self.tail))

    def take(self, result: RunnerOutput, vocab_size: int | None) -> None:
        """The step's answer for this request: a draft, or its tail to run again."""
        rid, tokens = self.request.request_id, self.request.generated_token_ids
        if self.tail:
            kept = result.accepted.get(rid, [])
            tokens += self.tail
            if kept != self.tail:  # sampled from a row before the last: its KV is good,
                self.pending = self.request.num_tokens - 1  # its logits are run again
                self.tail = []
                return
            self.tail = []
        token = result.sampled_token_ids.get(rid)
        if token is None or (vocab_size is not None and token >= vocab_size):
            self.done = True  # its drafts end here
            return
        self.pending = self.request.num_tokens
        tokens.append(token)
        self.drafts.append(token)
        self.done = len(self.drafts) == self.k


def make_speculator(
    config: EngineConfig,
    draft: ModelRunner | None,
    costs: StepCosts | None,
    vocab_size: int,
) -> "Speculator | None":
    """The engine's speculator for ``config.speculative_config`` (None: off), logged once (on by
    default for `infer serve` on a CPU: the log says so and how to turn it off). ``draft``:
    the draft model's runner (``method: draft_model``), with a KV pool of ``config``'s
    blocks; ``costs``: what the runner's steps cost by shape."""
    spec = config.speculative_config
    if spec is None:
        return None
    model = (
        DraftModel(
            draft,
            config.kv_blocks,
            config.kv_block_size,
            max_chunk=config.max_num_batched_tokens,
            vocab_size=vocab_size,
        )
        if draft is not None
        else None
    )
    speculator = Speculator(spec, config.max_model_len, model, costs)
    log.info(
        "speculative decoding",
        method=spec.method,
        num_speculative_tokens=spec.num_speculative_tokens,
        disable_by_batch_size=spec.disable_by_batch_size,
        draft_model=spec.model,
        drafts=speculator.policy(),
        off_with="--speculative-config none",
    )
    return speculator


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        draft: DraftModel | None = None,
        costs: StepCosts | None = None,
    ) -> None:
        """``draft``: the draft model (``method: draft_model``); ``costs``: what the
        runner's steps cost by shape (None: not measured; the draft model's drafts cost
        forwards of their own, so they never use them)."""
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError("speculative_config.model: a draft model goes with draft_model")
        self.config, self.max_model_len, self.draft = config, max_model_len, draft
        self.costs = costs if draft is None else None
        self.shared = (
            SharedSuffixes(
                config.prompt_lookup_min, config.prompt_lookup_max, config.suffix_recent_requests
            )
            if config.method == "suffix"
            else None
        )
        self._proposers: dict[str, tuple[Proposer, int]] = {}  # id -> (it, tokens indexed)
        self._pays: dict[int, bool] = {}  # running requests -> whether drafts can pay

    def propose(self, requests: Iterable[Request], running: int) -> None:
        """Drafts for ``requests`` (those that sampled this step); ``running``: requests
        in the batch now. With measured costs, none while a running request did not
        sample (its prompt is still being prefilled: the next step carries its chunk, a
        compute-bound step the costs do not cover, whose first tokens drafts would delay)."""
        requests = list(requests)
        limit = self.config.disable_by_batch_size
        busy = limit is not None and running > limit
        if self.costs is not None and not busy:
            prefilling = running > sum(not r.is_done for r in requests)
            busy = prefilling or not self._may_pay(running)
        wanted: list[tuple[Request, int]] = []
        drafting: list[Request] = []
        for request in requests:
            if request.is_done:
                self.end(request)
                continue
            request.draft_token_ids = []
            k = 0 if busy else self._budget(request)
            if k > 0 and self.draft is None:
                request.draft_token_ids = self._drafts(request, k)
                if request.draft_token_ids:
                    drafting.append(request)
            elif k > 0:
                wanted.append((request, k))
        if self.costs is not None:
            self._plan(drafting, running)
        if wanted and self.draft is not None:
            drafted = self.draft.propose(wanted)
            for request, _ in wanted:
                request.draft_token_ids = drafted.get(request.request_id, [])

    def _may_pay(self, running: int) -> bool:
        """Whether drafts can pay at all in a step of ``running`` requests (each with k
        drafts kept 98 % of the time): where they cannot, nobody's are even looked up."""
        pays = self._pays.get(running)
        if pays is None:
            assert self.costs is not None
            k = self.config.num_speculative_tokens
            pays = any(plan_drafts(self.costs, running, [(k, 0.98)] * max(running, 1)))
            self._pays[running] = pays
        return pays

    def policy(self) -> str:
        """What decides each step's drafts, for the start-up log."""
        if self.draft is not None:
            return "the draft model's, while a request's acceptance stays above min_acceptance"
        if self.costs is None:
            return "every request, while its acceptance stays above min_acceptance"
        k = self.config.num_speculative_tokens
        one = self.costs.ratio(1, k)
        breakeven = self.costs.breakeven(k)
        if breakeven is None:
            return (
                f"none: a step of 1 + {k} rows costs {one:.2f}x one row here, more than any "
                "acceptance repays (measured; decided per step)"
            )
        return (
            f"per step, where they pay at the measured step costs: one stream drafts from "
            f"{breakeven:.0%} acceptance (1 + {k} rows cost {one:.2f}x one row)"
        )

    def _plan(self, drafting: list[Request], running: int) -> None:
        """Cut each request's drafts to what pays at the measured step costs."""
        if not drafting:
            return
        assert self.costs is not None
        offers = [
            (len(r.draft_token_ids), acceptance(r.num_drafted, r.num_accepted)) for r in drafting
        ]
        for request, count in zip(drafting, plan_drafts(self.costs, running, offers), strict=True):
            request.draft_token_ids = request.draft_token_ids[:count]

    def end(self, request: Request) -> None:
        """``request`` ended: its proposer goes; its output joins the shared index when it
        finished (the suffix method)."""
        if self.draft is not None:
            self.draft.end(request.request_id)
        if self._proposers.pop(request.request_id, None) is None:
            return
        if self.shared is not None and request.finish_reason in ("eos", "stop", "length"):
            self.shared.add(request.request_id, request.generated_token_ids)

    def _budget(self, request: Request) -> int:
        """How many drafts the request may have now (0: none)."""
        params = request.sampling_params
        if len(request.generated_token_ids) < params.min_tokens:
            return 0
        structured = params.structured
        if structured is not None and not structured.started(request.generated_token_ids):
            return 0  # thinking before a constrained answer: drafts wait for its grammar
        if self.draft is not None and not drafting_pays(
            self.config, request.num_drafted, request.num_accepted
        ):
            self.draft.end(request.request_id)
            return 0
        return min(
            self.config.num_speculative_tokens,
            params.max_tokens - len(request.generated_token_ids) - 1,
            self.max_model_len - request.num_tokens - 1,
        )

    def _drafts(self, request: Request, k: int) -> list[int]:
        proposer, indexed = self._proposers.get(request.request_id, (None, 0))
        if proposer is None:
            proposer = Proposer(self.config, request.prompt_token_ids, self.shared)
            indexed = request.num_prompt_tokens
        proposer.extend(request.token_ids_from(indexed, request.num_tokens - indexed))
        self._proposers[request.request_id] = (proposer, request.num_tokens)
        proposer.drafted, proposer.accepted = request.num_drafted, request.num_accepted
        return proposer.propose(k, gated=self.costs is None)
