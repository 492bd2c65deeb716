"""The completion use case: a parsed request in, its engine requests queued, their output
streams out. ``/v1/completions`` and ``/v1/chat/completions`` run it (and any face that
translates into a completion: one copy of rendering, tools, grammar and limits).

The steps, in this order:

1. precheck: what is cheap before any tokenizing (the stop-string limits, each prompt's
   size, room for every choice: a full engine answers at once);
2. render (a chat): the conversation and tools through the chat template;
3. prepare: tokenize and validate each prompt off the event loop (a chat's ``max_tokens``
   is known now: by default what the context leaves);
4. reserve: the tokens it may use against the caller's limits (they need the prompts'
   token counts, so they come after preparing);
5. prioritize: the caller's group queues at the request's priority;
6. admit: every choice of every prompt queued at once, or none.

``best_of`` (a prompt job's, vLLM's and the legacy OpenAI API's): each prompt runs
``best_of`` choices through the same admit, each scored by its tokens' logprobs, and its
streams are the ``n`` of the highest cumulative logprob, best first, once all finished.

Errors are domain errors naming the request field (``InvalidParameterError`` and its
kind, ``QueueFullError``, the limits' errors); a face maps them to its wire format.
"""

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from application.engine.engine_client import OwnedRequests
from application.engine.input_processor import InputProcessor
from application.engine.request_ids import new_request_id
from application.serving.chat_prompts import ChatPrompts, ToolRequest, constrain, tool_texts
from application.serving.generation import GenerationDefaults
from application.serving.reasoning import CLOSE, Reasoning, closes_thinking, reasoning_for
from application.serving.request_record import RequestRecord
from domain.errors import InvalidParameterError
from domain.ports import STRUCTURED_PARAM
from domain.request import AdmitCall, StepOutput
from domain.sampling import SamplingParams, StructuredOutput

Prompt = str | list[int]
# A chat without max_tokens may run to the end of the context; under a tokens-per-minute
# limit it reserves this many output tokens (its real use is counted at the end).
UNSET_MAX_TOKENS_RESERVE = 256


class Reservations(Protocol):
    """The caller's limits: ``reserve`` raises (``RateLimitedError``...) when ``tokens``
    more do not fit; what is not used is given back when the caller's request ends."""

    async def reserve(self, tokens: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a completion runs for: the group owning its engine requests (its end aborts
    them), the API request's record (timings, the output cap applied), and its limits
    (None: none)."""

    group: OwnedRequests
    record: RequestRecord
    limits: Reservations | None = None
    # The tenant's cap on one request's output tokens (None: the server's).
    max_output_tokens: int | None = None

    async def reserve(self, tokens: int) -> None:
        if self.limits is not None:
            await self.limits.reserve(tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """What every completion asks: ``n`` choices per prompt sampled with ``params``, on
    the LoRA adapter ``adapter_id`` (None: the base model), at ``priority`` (vLLM's: lower
    runs earlier; None: the default). ``structured_param``: the request field the output
    constraint came from (its errors name it)."""

    params: SamplingParams
    n: int = 1
    adapter_id: str | None = None
    priority: int | None = None
    structured_param: str = STRUCTURED_PARAM
    # vLLM's: words the output never contains (tokenized into ``params.bad_words``), and
    # the prompt's last N tokens kept (-1: as many as the context holds; None: all).
    bad_words: tuple[str, ...] = ()
    truncate_prompt_tokens: int | None = None
    # The sampling fields the request left out (they take the generation defaults).
    unset: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptJob(Job):
    """A completion of each of ``prompts`` (texts or token ids); its engine requests' ids
    start with ``id_prefix``."""

    prompts: Sequence[Prompt]
    id_prefix: str = "cmpl"
    # Candidates per prompt, of which the ``n`` most likely come back (None: ``n``).
    best_of: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatJob(Job):
    """A chat: ``messages`` (checked, text content) with ``tools``. ``params.max_tokens``
    is a placeholder: the output may take ``max_tokens`` (None: what the context leaves
    after the rendered prompt), which came from the field ``max_tokens_param``."""

    messages: list[dict[str, Any]]
    tools: ToolRequest | None = None
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    # More variables for the chat template (chat_template_kwargs; enable_thinking).
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Started:
    """A queued completion: one stream per choice (choice j of prompt i at ``i * n + j``),
    each prompt's token ids, and the parameters they run with."""

    streams: list[AsyncIterator[StepOutput]]
    prompts: list[list[int]]
    params: SamplingParams
    # How a chat's output splits into thinking and answer (None: no reasoning parser).
    reasoning: Reasoning | None = None


# The rendered prompt's last tokens read to see whether it opened or closed the thinking.
PROMPT_TAIL_TOKENS = 32


class CompletionService:
    def __init__(
        self,
        inputs: InputProcessor,
        chats: ChatPrompts,
        reasoning_parser: str = "none",
        generation: GenerationDefaults | None = None,
    ) -> None:
        """``reasoning_parser``: how chats' thinking is told from their answer (``think``:
        ``<think> … </think>``; ``none``: not told apart); ``generation``: the sampling
        defaults and the output cap (:mod:`application.serving.generation`; None: none)."""
        self.inputs, self.chats = inputs, chats
        self.reasoning_parser = reasoning_parser
        self.generation = generation or GenerationDefaults()
        self._close_ids: tuple[int, ...] | None = None

    async def complete(self, job: PromptJob, caller: Caller) -> Started:
        texts = [[p] for p in job.prompts if isinstance(p, str)]
        width = self._width(job)
        self._precheck(job, texts, len(job.prompts), "prompt", width)
        with caller.record.timing("tokenize"):
            params = self._capped(self.generation.applied(job.params, job.unset), caller)
            params = await self._with_bad_words(job, params)
            prepared = [
                await self._prepare(p, params, job, job.truncate_prompt_tokens) for p in job.prompts
            ]
        await self._reserve(caller, prepared, params, width)
        if width == job.n:
            return self._admit(caller, job, job.id_prefix, prepared, params)
        if params.logprobs is None:  # candidates are ranked by their tokens' logprobs
            params = dataclasses.replace(params, logprobs=0)
        started = self._admit(caller, job, job.id_prefix, prepared, params, width)
        streams = started.streams
        chosen = [
            BestOf(streams[i * width : (i + 1) * width], job.n).streams()
            for i in range(len(prepared))
        ]
        return dataclasses.replace(started, streams=[s for group in chosen for s in group])

    @staticmethod
    def _width(job: PromptJob) -> int:
        """Choices run per prompt: ``best_of`` (at least ``n``), else ``n``."""
        if job.best_of is None:
            return job.n
        if job.best_of < job.n:
            raise InvalidParameterError("best_of", f"must be >= n ({job.n})")
        return job.best_of

    async def chat(self, job: ChatJob, caller: Caller) -> Started:
        texts = [*(m["content"] for m in job.messages), *tool_texts(job.tools)]
        self._precheck(job, [texts], 1, "messages")
        with caller.record.timing("render_chat"):
            prompt = await self.chats.render(job.messages, job.tools, job.template_kwargs)
        prompt = self.inputs.truncate(prompt, job.truncate_prompt_tokens)
        tail = self._tail(prompt) if self.reasoning_parser != "none" else None
        reasoning = None if tail is None else reasoning_for(tail, self.reasoning_parser)
        params = self._capped(self._sized(job, len(prompt)), caller)
        params = self._after_thinking(constrain(params, job.tools), tail)
        with caller.record.timing("tokenize"):
            params = await self._with_bad_words(job, params)
            prepared = await self._prepare(prompt, params, job)
        out = params.max_tokens
        if job.max_tokens is None:
            out = min(out, UNSET_MAX_TOKENS_RESERVE)
        await self._reserve(caller, [prepared], params, job.n, out)
        started = self._admit(caller, job, "chatcmpl", [prepared], params)
        return dataclasses.replace(started, reasoning=reasoning)

    def _tail(self, prompt: Sequence[int]) -> str:
        """The rendered prompt's end as text (where it opens or closes the thinking)."""
        return self.inputs.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)

    def _after_thinking(self, params: SamplingParams, tail: str | None) -> SamplingParams:
        """A constrained chat of a thinking model (``tail``: its prompt's end; None: no
        reasoning parser): the constraint holds from ``</think>`` (the answer), unless the
        prompt already closed the thinking (thinking off)."""
        structured = params.structured
        if structured is None or tail is None or closes_thinking(tail):
            return params
        if self._close_ids is None:
            self._close_ids = tuple(self.inputs.tokenizer.encode(CLOSE, add_special_tokens=False))
        after = StructuredOutput(structured.kind, structured.spec, self._close_ids)
        return dataclasses.replace(params, structured=after)

    def _precheck(
        self,
        job: Job,
        prompts: Sequence[Sequence[str]],
        count: int,
        param: str,
        width: int | None = None,
    ) -> None:
        """The stop-string limits, each prompt's size (a prompt is a list of texts: a
        chat's messages, named ``param``), and room for ``count`` prompts of ``n``
        choices (``width``: of ``best_of`` candidates)."""
        self.inputs.check_params(job.params)
        for texts in prompts:
            self.inputs.check_prompt_size(texts, param)
        try:
            self.inputs.check_room(count, job.n if width is None else width)
        except InvalidParameterError as e:
            if width is None or width == job.n or e.param != "n":
                raise
            raise e.renamed("best_of") from e

    def _capped(self, params: SamplingParams, caller: Caller) -> SamplingParams:
        """``params`` within the caller's output cap (noted in its record when it cut)."""
        cap = self.generation.cap(caller.max_output_tokens)
        if cap is None or params.max_tokens <= cap:
            return params
        caller.record.output_cap = cap
        return dataclasses.replace(params, max_tokens=cap, min_tokens=min(params.min_tokens, cap))

    async def _with_bad_words(
        self, job: Job, params: SamplingParams | None = None
    ) -> SamplingParams:
        """``params`` (default: the job's) with the job's bad words as token ids."""
        params = job.params if params is None else params
        if not job.bad_words:
            return params
        words = await self.inputs.bad_words(job.bad_words)
        return dataclasses.replace(params, bad_words=words)

    def _sized(self, job: ChatJob, prompt_tokens: int) -> SamplingParams:
        """The chat's parameters with the generation defaults and its ``max_tokens`` (when
        it asks none: the default's, at most what the context leaves, at least one token:
        a full context is an error when the prompt is prepared)."""
        max_tokens = job.max_tokens
        if max_tokens is None:
            max_tokens = max(self.inputs.max_model_len - prompt_tokens, 1)
            if self.generation.max_tokens is not None:
                max_tokens = min(max_tokens, self.generation.max_tokens)
        params = self.generation.applied(job.params, job.unset)
        try:
            return dataclasses.replace(params, max_tokens=max_tokens)
        except InvalidParameterError as e:
            if e.param != "max_tokens":
                raise
            raise e.renamed(job.max_tokens_param) from e

    async def _prepare(
        self, prompt: Prompt, params: SamplingParams, job: Job, truncate: int | None = None
    ) -> list[int]:
        return await self.inputs.prepare(
            prompt,
            params,
            structured_param=job.structured_param,
            truncate_prompt_tokens=truncate,
        )

    @staticmethod
    async def _reserve(
        caller: Caller,
        prepared: list[list[int]],
        params: SamplingParams,
        n: int,
        out: int | None = None,
    ) -> None:
        """The prompts' tokens and ``out`` (default: ``max_tokens``) per choice."""
        out = params.max_tokens if out is None else out
        await caller.reserve(sum(map(len, prepared)) + out * len(prepared) * n)

    @staticmethod
    def _admit(
        caller: Caller,
        job: Job,
        prefix: str,
        prepared: list[list[int]],
        params: SamplingParams,
        n: int | None = None,
    ) -> Started:
        """Prioritize the caller's group, then queue ``n`` (default: the job's) choices of
        every prompt."""
        group = caller.group
        n = job.n if n is None else n
        if job.priority is not None:  # the scheduler runs a higher context priority first
            group.context = dataclasses.replace(group.context, priority=-job.priority)
        request_ids = tuple(new_request_id(prefix) for _ in range(len(prepared) * n))
        call = AdmitCall(request_ids, tuple(prepared), params, n, job.adapter_id, group.context)
        streams = group.admit(call)
        return Started(streams, prepared, params)


class BestOf:
    """One prompt's ``best_of`` candidates: each collected whole, then the ``n`` of the
    highest cumulative logprob (the sum of its tokens' logprobs; ties: the earlier
    candidate) replayed as ``n`` streams, best first. A candidate the engine failed is
    chosen first, so that its error reaches the caller."""

    def __init__(self, candidates: Sequence[AsyncIterator[StepOutput]], n: int) -> None:
        self._candidates, self._n = list(candidates), n
        self._lock = asyncio.Lock()
        self._chosen: list[list[StepOutput]] | None = None

    def streams(self) -> list[AsyncIterator[StepOutput]]:
        return [self._replay(j) for j in range(self._n)]

    async def _replay(self, j: int) -> AsyncIterator[StepOutput]:
        for out in (await self._choose())[j]:
            yield out

    async def _choose(self) -> list[list[StepOutput]]:
        async with self._lock:
            if self._chosen is None:
                outputs = await asyncio.gather(*(_drain(s) for s in self._candidates))
                ranked = sorted(range(len(outputs)), key=lambda i: -_score(outputs[i]))
                self._chosen = [outputs[i] for i in ranked[: self._n]]
            return self._chosen


async def _drain(stream: AsyncIterator[StepOutput]) -> list[StepOutput]:
    return [out async for out in stream]


def _score(outputs: Sequence[StepOutput]) -> float:
    """A candidate's cumulative logprob (+inf for a failed one)."""
    if any(out.error is not None for out in outputs):
        return float("inf")
    return sum(out.logprob or 0.0 for out in outputs if out.token_id is not None)
