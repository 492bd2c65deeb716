"""TorchModelRunner: the ModelRunner port over our models, for static and continuous batching.

KV lives in a :class:`PagedKVCache` (a pool of fixed-size blocks); the scheduler's block
manager decides which blocks each request uses and every scheduled chunk carries its
request's block table, so the runner keeps no per-request KV state (requests sharing a
cached prefix or a sibling choice's prompt read the same blocks). A step runs the decoding
requests' tokens (each row at its own position) and the prompt chunks as one flat forward
(:class:`PagedBatch`: one matmul per projection for every token of the step); then the
rows that asked for it get their logits processed (bias, allowed-token masks, grammar
masks for structured outputs: :mod:`adapters.torch.runtime.logits`), and one sampler call
samples every row that needs a token. Grammar masks are computed on a worker thread while
the forward runs (:mod:`adapters.torch.runtime.structured`).

With a :class:`LoraServing`, each request may name a LoRA adapter: the step routes every
token (and every logits row) to its request's adapter, so requests on different adapters
and on the base model share one forward. Requests asking for prompt logprobs get the
logits of their prompt positions too (log-softmaxed in float32, the next prompt token's
value gathered; target ids' logprobs and draws from the same rows:
:mod:`adapters.torch.runtime.prompt_scores`).
"""

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import structlog
import torch
from torch import Tensor

from adapters.torch.cuda.graphs import DecodeGraphs
from adapters.torch.lora.serving import LoraServing
from adapters.torch.models.layers import Attention, PagedBatch
from adapters.torch.models.paged_kv import PagedKVCache
from adapters.torch.models.transformer import Transformer
from adapters.torch.quant import prompt_rows, prompt_step
from adapters.torch.runtime.invariant import make_batch_invariant
from adapters.torch.runtime.logits import process_logits
from adapters.torch.runtime.min_tokens import suppress_stop_tokens
from adapters.torch.runtime.prompt_scores import PromptScores, ScoredSpan, score_prompts
from adapters.torch.runtime.sampler import TokenSampler, make_generator
from adapters.torch.runtime.structured import GrammarMasks, GrammarMatchers, GrammarStep, joined
from domain.config import EngineConfig
from domain.errors import InvalidParameterError
from domain.request import Request
from domain.scheduler import RunnerOutput, ScheduledChunk, SchedulerOutput

log = structlog.get_logger(__name__)


class TorchModelRunner:
    def __init__(
        self,
        model: Transformer,
        config: EngineConfig,
        sampler: TokenSampler | None = None,
        lora: LoraServing | None = None,
        grammar: GrammarMatchers | None = None,
    ):
        """``grammar``: per-request matchers for structured outputs (their vocabulary is
        the model's)."""
        self.model = model
        self.sampler = sampler or TokenSampler()
        self.lora = lora
        weight = model.embed_tokens.weight
        self.device = weight.device
        # the loader installed the kernels (adapters/torch/loading/install.py): decode rows read the
        # pool through their tables where a paged kernel was built
        attention = [m for m in model.modules() if isinstance(m, Attention)]
        paged = all(m.backend.paged is not None for m in attention)
        # CUDA graphs of decode steps need the paged kernel (fixed shapes) and a scratch
        # block beyond the scheduler's pool for their padding rows.
        graphs = self.device.type == "cuda" and paged and not config.enforce_eager
        self.cache = PagedKVCache(
            model.config,
            config.kv_blocks + (1 if graphs else 0),  # the graphs' scratch block last
            config.kv_block_size,
            dtype=weight.dtype,
            device=weight.device,
            # a gather reads padding positions (masked, but NaN * 0 is NaN): zeros then
            zeroed=not paged,
        )
        self.graphs = (
            DecodeGraphs(
                model,
                self.cache,
                config.max_num_seqs,
                config.blocks_per_sequence,
                config.kv_blocks,
            )
            if graphs
            else None
        )
        self.generators: dict[str, torch.Generator | None] = {}
        if grammar is not None and grammar.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"the grammar's vocabulary ({grammar.vocab_size}) is not the model's "
                f"({model.config.vocab_size})"
            )
        self.grammar = GrammarStep(grammar) if grammar is not None else None
        # --batch-invariant: every token a row over the pool, one kernel path per row
        self.invariant = config.batch_invariant
        if self.invariant:
            if self.device.type != "cpu":
                raise InvalidParameterError(
                    "batch_invariant", f"the CPU kernels only (this model is on {self.device})"
                )
            log.info("batch-invariant: on", **make_batch_invariant(model))
        else:
            log.info(
                "batch-invariant: off (a row's rounding may depend on what shares its step; "
                "--batch-invariant for bitwise-reproducible outputs)"
            )

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        if not batch.chunks:
            return RunnerOutput()
        for chunk in batch.chunks:
            self._ensure_generator(chunk)
        # Decode rows: one generated token each. A one-token chunk of a prompt (the last token
        # of a cached prompt, an ``n`` > 1 choice's tail) runs as a prompt chunk, so that its
        # KV and logits round as the same positions do in a longer chunk.
        singles: list[ScheduledChunk] = []
        prompts: list[ScheduledChunk] = []
        for chunk in batch.chunks:
            (singles if _decode_row(chunk) else prompts).append(chunk)
        sampled = [c for c in batch.chunks if c.samples]
        scored = [c for c in batch.chunks if _scores_prompt(c)]
        # A chunk with drafts samples a row per position: its newest token's and each draft's.
        row_requests = [c.request for c in sampled for _ in range(len(c.drafts) + 1)]
        drafted = [c.drafts[:i] for c in sampled for i in range(len(c.drafts) + 1)]
        masks = self.grammar.begin(row_requests, drafted) if self.grammar else None
        with torch.inference_mode(), joined(masks):
            logits, scores = self._forward(singles, prompts, sampled, scored)
            output = self._sample(sampled, logits, batch.eos_token_ids, masks)
        if self.grammar is not None:
            self.grammar.advance(output.sampled_token_ids, output.accepted)
        output.prompt_logprobs.update(scores.logprobs)
        output.prompt_top_logprobs.update(scores.top)
        output.prompt_ranks.update(scores.ranks)
        output.prompt_target_logprobs.update(scores.targets)
        output.prompt_samples.update(scores.samples)
        return output

    def release(self, request_ids: Sequence[str]) -> None:
        if self.grammar is not None:
            self.grammar.release(request_ids)
        for request_id in request_ids:  # KV blocks are the scheduler's to free
            self.generators.pop(request_id, None)

    def _ensure_generator(self, chunk: ScheduledChunk) -> None:
        request = chunk.request
        if request.request_id in self.generators:
            return
        seed = request.sampling_params.seed
        generator = make_generator(seed, self.device) if seed is not None else None
        if generator is not None and request.generated_token_ids:
            # Recomputed after a preemption (the scheduler released it): a fresh stream
            # would draw its first numbers again. The sampler draws one float64 per row
            # sampled (``sampler._uniforms``; greedy rows ignore theirs), so skipping one
            # per row sampled so far (a token, or a verified draft) continues the stream.
            for _ in range(request.num_draws):
                torch.rand(1, dtype=torch.float64, device=self.device, generator=generator)
        self.generators[request.request_id] = generator

    def _forward(
        self,
        singles: list[ScheduledChunk],
        prompts: list[ScheduledChunk],
        sampled: list[ScheduledChunk],
        scored: list[ScheduledChunk],
    ) -> tuple[Tensor, PromptScores]:
        """Logits ``[len(sampled), vocab]`` of one step, and the prompt logprobs of
        ``scored``: the decode rows (if any) and every prompt chunk's tokens run as one flat
        forward (see :class:`PagedBatch`), each reading its KV through its block table."""
        tokens: list[int] = []
        rows_in: list[tuple[list[int], int]] = []
        first_row: dict[int, int] = {}  # id(chunk) -> its first row
        token_adapters: list[str | None] = []
        for chunk in singles:  # a decode row, and one more per draft (each at its position)
            first_row[id(chunk)] = len(tokens)
            table = list(chunk.block_table)
            for i, token in enumerate(chunk.token_ids):
                tokens.append(token)
                rows_in.append((table, chunk.start + i))
                token_adapters.append(chunk.request.adapter_id)
        chunks = []
        for chunk in prompts:
            first_row[id(chunk)] = len(tokens)
            table = list(chunk.block_table)
            if self.invariant:  # each token a row at its position, as decode rows are
                rows_in.extend((table, chunk.start + i) for i in range(chunk.num_rows))
            else:
                chunks.append((table, chunk.start, chunk.num_rows))
            tokens.extend(chunk.token_ids)
            token_adapters.extend([chunk.request.adapter_id] * chunk.num_rows)
        rows = [
            first_row[id(c)] + c.num_tokens - 1 + i
            for c in sampled
            for i in range(len(c.drafts) + 1)
        ]
        targets: list[int] = []
        spans: list[ScoredSpan] = []  # the rows scored, after the sampled ones
        for chunk in scored:
            request = chunk.request
            prompt = request.prompt_token_ids
            count = min(chunk.num_tokens, len(prompt) - 1 - chunk.start)
            rows.extend(first_row[id(chunk)] + i for i in range(count))
            targets.extend(prompt[chunk.start + 1 : chunk.start + 1 + count])
            spans.append(
                ScoredSpan(request.request_id, chunk.start, count, request.sampling_params)
            )
        if self.graphs is not None and self._replays(
            rows_in, prompts, sampled, scored, token_adapters
        ):
            tables, positions = [t for t, _ in rows_in], [p for _, p in rows_in]
            return self.graphs.forward(tokens, tables, positions), PromptScores()
        sampled_rows = len(rows) - sum(s.count for s in spans)
        batch = PagedBatch(
            self.cache,
            rows_in,
            chunks,
            self.model.windows(),
            self.device,
            fused=not any(token_adapters),  # the fused decode kernels know no LoRA deltas
        )
        # A step scoring prompt tokens (prompt logprobs: Tinker's compute_logprobs) runs
        # every row through the quantized linears' tiles (quant.prompt_rows), as the
        # trainer's forward does: the same logprobs, whatever the chunk's size (a scored
        # position is always computed, never a prefix cache hit). Batch-invariant steps
        # take one path for every row instead.
        dense = prompt_rows(bool(spans) and not self.invariant)
        # A step with prompt chunks runs every row on the float path (quant.prompt_step): a
        # prompt's tail after a cached prefix rounds as the whole prompt did.
        chunked = prompt_step(bool(chunks))
        with self._routed(token_adapters, [token_adapters[r] for r in rows]), dense, chunked:
            logits = self.model.forward_mixed(
                torch.tensor(tokens, device=self.device),
                batch,
                torch.tensor(rows, dtype=torch.long, device=self.device),
            )
        if not spans:
            return logits, PromptScores()
        scores = score_prompts(logits[sampled_rows:], targets, spans)
        return logits[:sampled_rows], scores

    def _replays(
        self,
        rows: list[tuple[list[int], int]],
        prompts: list[ScheduledChunk],
        sampled: list[ScheduledChunk],
        scored: list[ScheduledChunk],
        token_adapters: list[str | None],
    ) -> bool:
        """The step runs as a CUDA graph: decode rows alone, each sampled (so the logits'
        rows are the rows'), on the base model, within the captured sizes."""
        assert self.graphs is not None
        return (
            not prompts
            and not scored
            and sum(c.num_rows for c in sampled) == len(rows)
            and self.graphs.covers([table for table, _ in rows])
            and not any(token_adapters)
        )

    def _routed(
        self, token_adapters: list[str | None], row_adapters: list[str | None]
    ) -> AbstractContextManager[None]:
        if self.lora is None or not any(token_adapters):
            return nullcontext()
        return self.lora.route(token_adapters, row_adapters)

    def _generators(
        self, requests: list[Request], outputs: list[list[int]]
    ) -> list[torch.Generator | None]:
        """Each sampled row's generator: its request's stream; when batch-invariant, one
        seeded by the request's seed and the row's output position, so that a seeded
        request draws the same number for a token whether drafts ran before it or not."""
        if not self.invariant:
            return [self.generators[r.request_id] for r in requests]
        found: list[torch.Generator | None] = []
        for request, output in zip(requests, outputs, strict=True):
            seed = request.sampling_params.seed
            position = len(output)
            found.append(
                None
                if seed is None
                else make_generator((seed * 0x9E3779B1 + position) % (1 << 63), self.device)
            )
        return found

    def _sample(
        self,
        chunks: list[ScheduledChunk],
        logits: Tensor,
        eos_token_ids: frozenset[int],
        masks: GrammarMasks | None = None,
    ) -> RunnerOutput:
        """``logits``: a row per position sampled, in ``chunks`` order (a chunk with drafts
        has one per draft too); ``masks``: the grammar rows' (being computed).

        Drafts are verified by sampling: each row draws its token from the target model's
        distribution as if the drafts before it were the request's (penalties and bad words
        see them), and a draft is accepted while it equals the token its row drew; the
        first row that differs gives the request's next token (all accepted: the last row's
        token too). For drafts that are certain guesses (n-gram, suffix) this is the
        rejection sampling of the speculative-sampling papers: a draft ``d`` is kept with
        probability p(d), else the token is drawn from p without ``d``, so the output's
        distribution is the model's own; greedy output is the same token for token."""
        if not chunks:
            return RunnerOutput()
        requests, outputs = [], []
        for chunk in chunks:
            request, drafts = chunk.request, list(chunk.drafts)
            for i in range(len(drafts) + 1):
                requests.append(request)
                outputs.append(
                    [*request.generated_token_ids, *drafts[:i]]
                    if i
                    else request.generated_token_ids
                )
        params = [r.sampling_params for r in requests]
        grammar = (masks.rows, masks.result().to(logits.device)) if masks else None
        processed = suppress_stop_tokens(
            process_logits(logits, params, grammar, outputs), requests, eos_token_ids
        )
        result = self.sampler.sample(
            processed,  # forward -> per-row processing -> sampling
            params,
            prompt_ids=[r.prompt_token_ids for r in requests],
            output_ids=outputs,
            generators=self._generators(requests, outputs),
            raw_logits=logits,
        )
        output = RunnerOutput()
        row = 0
        top = result.top_logprobs or []
        for chunk in chunks:
            rid, guessed = chunk.request.request_id, chunk.drafts
            drawn = result.token_ids[row : row + len(guessed) + 1]
            kept = 0
            while kept < len(guessed) and drawn[kept] == guessed[kept]:
                kept += 1
            last = row + kept
            output.sampled_token_ids[rid] = drawn[kept]
            if result.logprobs:
                output.logprobs[rid] = result.logprobs[last]
            if last < len(top) and top[last]:
                output.top_logprobs[rid] = top[last]
            if guessed:
                output.accepted[rid] = list(guessed[:kept])
                if result.logprobs:
                    output.accepted_logprobs[rid] = result.logprobs[row:last]
                if top:
                    output.accepted_top_logprobs[rid] = top[row:last]
            row += len(guessed) + 1
        return output


def _scores_prompt(chunk: ScheduledChunk) -> bool:
    """The chunk covers prompt positions whose next token is a prompt token, for a request
    that asked for prompt logprobs."""
    request = chunk.request
    return request.sampling_params.prompt_logprobs and chunk.start < request.num_prompt_tokens - 1


def _decode_row(chunk: ScheduledChunk) -> bool:
    """One token past the prompt: a decode row (a prompt's tokens run as chunks). Its drafts
    run as decode rows too, one each: every row's key and value are written before any row
    attends, and each attends to its own position and those before it."""
    return chunk.num_tokens == 1 and chunk.start >= chunk.request.num_prompt_tokens
