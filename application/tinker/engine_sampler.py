"""EngineSampler: the Tinker SamplingBackend port over the serving engine.

Tinker samples run as ordinary engine requests — continuous batching with everything else
the server serves — each naming the LoRA adapter it runs with. A saved checkpoint's
adapter is loaded once by folder and kept (least recently used evicted); a live run's
current weights are copied in for the one call. The adapters are the runner's, behind the
:class:`~domain.tinker.ports.ServingAdapters` port (no tensors here). ``num_samples`` are that
many requests (seeds ``seed``, ``seed + 1``, ...); the first also scores the prompt when
asked: prompt logprobs, top-k alternatives, the logprobs of target ids and the draws of
``prompt_alt_k``, all from the logits of its one prefill.

At most ``max_in_engine`` Tinker requests are in the engine at once (tenants taking turns
for the slots; the rest wait here and go in as others finish), so a large ``num_samples``
never fills the engine's waiting queue and OpenAI requests are not refused for it.
"""

import asyncio
import itertools
import math
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from application.engine.engine_client import EngineClient
from application.engine.request_ids import new_request_id
from application.tinker.fair import FairSlots
from domain.errors import InvalidParameterError, QueueFullError
from domain.request import RequestContext, StepOutput
from domain.sampling import SamplingParams
from domain.tinker.errors import BackendFailure, InvalidTrainingRequest, NotFoundError
from domain.tinker.ports import ServingAdapters
from domain.tinker.values import (
    PromptAltTokens,
    PromptTable,
    SampledSequence,
    SampleRequest,
    TinkerSampleResult,
    TinkerSamplingParams,
    TopK,
    WeightsSource,
)


class EngineSampler:
    def __init__(
        self,
        engine: EngineClient,
        lora: ServingAdapters,
        model_names: Sequence[str],
        *,
        queue_retry_s: float = 0.05,
        max_in_engine: int = 8,
    ) -> None:
        """``lora``: the adapters the engine's runner applies; ``model_names``: the names the
        engine's model answers to; ``max_in_engine``: Tinker requests in the engine at once."""
        self.engine = engine
        self.lora = lora
        self.model_names = frozenset(model_names)
        self.queue_retry_s = queue_retry_s
        self.slots = FairSlots(max_in_engine)
        self._ids = itertools.count()

    async def sample(
        self, source: WeightsSource, request: SampleRequest, *, tenant: str = ""
    ) -> TinkerSampleResult:
        if source.base_model not in self.model_names:
            raise InvalidTrainingRequest(
                f"base model {source.base_model!r} is not the one the engine serves "
                f"({', '.join(sorted(self.model_names))})"
            )
        targets = request.target_prompt.row_ids() if request.target_prompt is not None else None
        scored_from = _scored_from(request, targets)
        params = [
            _engine_params(
                request.params,
                i,
                prompt_logprobs=request.prompt_logprobs and i == 0,
                topk_prompt=request.topk_prompt if i == 0 else 0,
                topk_sample=request.topk_sample,
                target_ids=targets if i == 0 else None,
                prompt_samples=request.prompt_alt_k if i == 0 else 0,
                scored_from=scored_from if i == 0 else 1,
            )
            for i in range(request.num_samples)
        ]
        try:  # before any sample runs: an id outside the vocabulary fails the whole call
            self.engine.inputs.checks.check_token_ids(params[0])
        except InvalidParameterError as e:
            raise _tinker_error(e) from e
        with ExitStack() as stack:
            adapter = self._adapter(source, stack)
            runs = [self._one(list(request.prompt), p, adapter, tenant) for p in params]
            outputs = await asyncio.gather(*runs)
        first = outputs[0][1]
        # positions served from the prefix cache (before the last n asked): NaN / no row
        scored: list[float | None] | None = None
        if request.prompt_logprobs:
            scored = [None, *(None if math.isnan(v) else v for v in first.prompt_logprobs or ())]
        alternatives: list[TopK | None] | None = None
        if request.topk_prompt and first.prompt_top_logprobs is not None:
            alternatives = [None, *(list(row) or None for row in first.prompt_top_logprobs)]
        return TinkerSampleResult(
            [seq for seq, _ in outputs],
            scored,
            alternatives,
            _target_logprobs(request, targets, first),
            _alt_tokens(request, first),
        )

    def _adapter(self, source: WeightsSource, stack: ExitStack) -> str | None:
        if source.path is not None:
            adapter_id = checkpoint_adapter_id(self.lora, source.path)
            # Pinned before it loads: loading evicts others, never the one about to be used.
            stack.enter_context(self.lora.pinned(adapter_id))
            if adapter_id not in self.lora:
                self.lora.load_folder(adapter_id, source.path)
            return adapter_id
        if source.model_id is not None:
            adapter_id = f"live:{source.model_id}:{next(self._ids)}"
            stack.enter_context(self.lora.pinned(adapter_id))
            stack.callback(self.lora.remove, adapter_id)
            self.lora.add_live(adapter_id, source.model_id)
            return adapter_id
        return None

    async def _one(
        self, prompt: list[int], params: SamplingParams, adapter: str | None, tenant: str
    ) -> tuple[SampledSequence, StepOutput]:
        """The sampled sequence, and the first output (which carries prompt scores)."""
        async with self.slots.slot(tenant):
            return await self._run(prompt, params, adapter, tenant)

    async def _run(
        self, prompt: list[int], params: SamplingParams, adapter: str | None, tenant: str
    ) -> tuple[SampledSequence, StepOutput]:
        request_id = new_request_id("tinker-sample")
        # Queued as its tenant's: the engine's fair scheduling and per-tenant counters.
        context = RequestContext(tenant_id=tenant or None)
        while True:
            try:
                outputs = await self.engine.stream(
                    request_id, prompt, params, adapter_id=adapter, context=context
                )
                break
            except QueueFullError:  # many samples at once: wait for room, as clients would
                await asyncio.sleep(self.queue_retry_s)
            except InvalidParameterError as e:
                raise _tinker_error(e) from e
        tokens: list[int] = []
        logprobs: list[float] = []
        topk: list[TopK] = []
        first: StepOutput | None = None
        last: StepOutput | None = None
        async for out in outputs:
            first, last = first or out, out
            if out.error is not None:
                raise BackendFailure(f"sampling failed: {out.error}")
            if out.token_id is not None:
                tokens.append(out.token_id)
                logprobs.append(out.logprob if out.logprob is not None else float("nan"))
                topk.append(list(out.top_logprobs or ()))
        assert first is not None and last is not None  # a stream ends with an output
        length = last.finish_reason == "length"
        sequence = SampledSequence(
            tokens, logprobs, "length" if length else "stop", topk if params.logprobs else None
        )
        return sequence, first


def checkpoint_adapter_id(lora: ServingAdapters, folder: Path) -> str:
    """The adapter id of the checkpoint in ``folder`` (``NotFoundError`` when it is gone).
    Keyed by the weights file's identity too: a checkpoint saved again under its name
    (overwrite) is a new adapter, not the cached one. The Tinker sampler and the OpenAI
    face (a ``tinker://`` path as ``model``) share these ids, so share the loaded adapter."""
    try:
        stat = lora.weights_file(folder).stat()
        real = folder.resolve(strict=True)  # a checkpoint's version folder
    except OSError as e:  # never name the folder: it is the server's business
        raise NotFoundError("the checkpoint this sampler uses was deleted") from e
    return f"path:{real}:{stat.st_mtime_ns}:{stat.st_size}"


def _engine_params(
    p: TinkerSamplingParams,
    index: int,
    *,
    prompt_logprobs: bool,
    topk_prompt: int,
    topk_sample: int,
    target_ids: tuple[tuple[int, ...], ...] | None = None,
    prompt_samples: int = 0,
    scored_from: int = 1,
) -> SamplingParams:
    """Tinker's parameters as the engine's. Explicit stops replace EOS (``[]``: never stop
    early), as in Tinker; ``top_k`` -1 is off."""
    explicit = p.stop_strings is not None or p.stop_token_ids is not None
    try:
        return SamplingParams(
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_k=max(p.top_k, 0),
            top_p=p.top_p,
            seed=None if p.seed is None else p.seed + index,
            stop=tuple(p.stop_strings or ()),
            stop_token_ids=tuple(p.stop_token_ids or ()),
            ignore_eos=explicit,
            logprobs=topk_sample,
            logprobs_mode="raw",  # the model's, as its training forward scores them
            prompt_logprobs=prompt_logprobs
            or topk_prompt > 0
            or target_ids is not None
            or prompt_samples > 0,
            prompt_top_logprobs=topk_prompt,
            prompt_target_ids=target_ids,
            prompt_samples=prompt_samples,
            prompt_logprobs_from=scored_from,
        )
    except InvalidParameterError as e:
        raise InvalidTrainingRequest(f"sampling_params: {e}") from e


# The engine's names of the prompt-scoring parameters -> the Tinker request's.
_TINKER_NAMES = {
    "prompt_target_ids": "target_prompt_logprobs",
    "prompt_samples": "prompt_alt_tokens_k",
}


def _tinker_error(e: InvalidParameterError) -> InvalidTrainingRequest:
    """An engine parameter error as a Tinker one, named as the Tinker request names it."""
    name = _TINKER_NAMES.get(e.param)
    return InvalidTrainingRequest(str(e.renamed(name) if name is not None else e))


def _scored_from(request: SampleRequest, targets: tuple[tuple[int, ...], ...] | None) -> int:
    """The first prompt position the prefill must score: the last n of
    ``prompt_logprobs_last_n``, the first target row naming an id, or 1 (the draws cover
    every position). The positions before it may run from the prefix cache."""
    wanted = []
    if request.prompt_logprobs or request.topk_prompt:
        last_n = request.prompt_logprobs_last_n
        wanted.append(1 if last_n is None else max(1, len(request.prompt) - last_n))
    if targets is not None:
        wanted.append(next((i + 1 for i, row in enumerate(targets) if row), 1))
    if request.prompt_alt_k:
        wanted.append(1)
    return min(wanted, default=1)


def _target_logprobs(
    request: SampleRequest, targets: tuple[tuple[int, ...], ...] | None, first: StepOutput
) -> PromptTable | None:
    """The logprobs of ``request.target_prompt``'s ids, in its layout."""
    if request.target_prompt is None or targets is None:
        return None
    rows = first.prompt_target_logprobs
    if rows is None or len(rows) != len(targets):
        raise BackendFailure("the prefill did not score target_prompt_logprobs")
    lookup = [
        dict(zip(ids, values, strict=True)) for ids, values in zip(targets, rows, strict=True)
    ]
    return request.target_prompt.scored(lookup)


def _alt_tokens(request: SampleRequest, first: StepOutput) -> PromptAltTokens | None:
    """The draws ``request.prompt_alt_k`` asked for, one row per prompt position after the
    first."""
    if not request.prompt_alt_k:
        return None
    rows = first.prompt_samples
    if rows is None or len(rows) != max(0, len(request.prompt) - 1):
        raise BackendFailure("the prefill did not draw prompt_alt_tokens")
    return PromptAltTokens(
        request.prompt_alt_k,
        [[token for token, _ in row] for row in rows],
        [[logprob for _, logprob in row] for row in rows],
    )
