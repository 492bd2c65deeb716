"""The OpenAI faces' replies: collecting a request's outputs into a body, and the SSE chunks
of streamed completions and chats; logprobs in both wire shapes.

A reply has choices: ``n`` per prompt, choice j of prompt i at index ``i * n + j``, each one
engine request. Usage counts each prompt once (as OpenAI and vLLM do, whatever ``n``) and
every choice's completion tokens.

Token strings in logprobs are vLLM's: the token decoded alone (special tokens included), so
a token holding part of a multi-byte character reads U+FFFD; ``bytes`` are that string's
UTF-8. Logprobs of masked-out tokens (-inf) read -9999.0, as in vLLM (JSON has no -inf).

A completion's ``top_logprobs`` follow the legacy OpenAI API's and vLLM's "k + 1" rule: each
token's dict holds the ``logprobs`` = k most likely tokens and the token itself when it is
not among them (``logprobs: 0``: the token alone). A chat's ``top_logprobs`` list holds the
k most likely only (``top_logprobs: 0``: an empty list), as OpenAI's chat does.

vLLM's extras, when asked: ``return_token_ids`` (each choice's generated ids, and the
prompt's: per choice on completions, on the response on chats; streamed: each chunk its
own tokens, the prompt's on the first chunk), ``prompt_logprobs`` (vLLM's shape: None for
the first prompt token, then per token a dict id -> logprob, rank, decoded token: the
token itself first, then the alternatives), ``continuous_usage_stats`` (every streamed
chunk carries its choice's usage so far). Every choice says its ``stop_reason``.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Request, Response

from adapters.http.errors import HTTPError
from adapters.http.openai.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCallOut,
    PromptLogprob,
    PromptLogprobs,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from adapters.http.openai.tools import CallIds, ToolReplies, new_call_id
from adapters.http.streaming import merge_streams, unless_disconnected
from application.serving.chat_output import (
    ChoiceEnd,
    ChoiceEvents,
    ChoiceResult,
    Text,
    Thinking,
    ToolCallDelta,
    split_choice,
)
from application.serving.chat_prompts import ToolRequest
from application.serving.reasoning import Reasoning
from application.serving.tool_parsers import StreamingToolParser
from domain.request import StepOutput

_encoder = msgspec.json.Encoder()
# Token ids -> their strings (each decoded alone): the engine client's ``token_texts``.
TokenTexts = Callable[[Sequence[int]], list[str]]
LOGPROB_FLOOR = -9999.0

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "stop"}


@dataclass
class Collected:
    """One choice's outputs, collected: its text, finish, counts, and the outputs that
    carried a token (their logprobs; the first one also the prompt's)."""

    text: str = ""
    finish_reason: str | None = None
    end_reason: str = "abort"  # the engine's (eos, stop, length, abort)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    outputs: list[StepOutput] = field(default_factory=list)
    stop_reason: str | int | None = None  # the stop string or id that ended it

    @property
    def token_ids(self) -> list[int]:
        return [o.token_id for o in self.outputs if o.token_id is not None]


@dataclass(frozen=True)
class Echo:
    """What ``echo`` puts before a completion: the prompt's text and token ids."""

    text: str
    token_ids: Sequence[int]


async def collect(stream: AsyncIterator[StepOutput]) -> Collected:
    collected, parts = Collected(), []
    async for out in stream:
        if out.error is not None:
            raise HTTPError(500, out.error, "server_error")
        parts.append(out.text_delta)
        if out.token_id is not None:
            collected.outputs.append(out)
        if out.finished:
            collected.finish_reason = finish_reason(out)
            collected.end_reason = out.finish_reason or "stop"
            collected.prompt_tokens = out.prompt_tokens
            collected.completion_tokens = out.completion_tokens
            collected.cached_tokens = out.cached_tokens
            collected.stop_reason = out.stop_reason
    collected.text = "".join(parts)
    return collected


async def collect_all(
    request: Request[Any, Any, Any], streams: Sequence[AsyncIterator[StepOutput]]
) -> list[Collected]:
    """Every choice collected, unless the client leaves first (then they are aborted)."""
    return await unless_disconnected(request, asyncio.gather(*(collect(s) for s in streams)))


def finish_reason(out: StepOutput) -> str | None:
    if not out.finished:
        return None
    return FINISH_REASONS.get(out.finish_reason or "", out.finish_reason)


def usage_so_far(out: StepOutput) -> Usage:
    """One output's choice's usage so far (``continuous_usage_stats``)."""
    return Usage.of(out.prompt_tokens, out.completion_tokens, out.cached_tokens)


def prompt_logprobs_of(
    prompt: Sequence[int], first: StepOutput | None, texts: TokenTexts, k: int
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs`` from a choice's first output: None for the first
    token, then per token {id: {logprob, rank, decoded_token}}, the token first, then its
    ``k`` best alternatives (ranks 1..)."""
    logprobs = list(first.prompt_logprobs or ()) if first is not None else []
    ranks = list(first.prompt_ranks or ()) if first is not None else []
    alternatives = list(first.prompt_top_logprobs or ()) if first is not None else []
    rows: PromptLogprobs = [None]
    for i in range(1, len(prompt)):
        if i > len(logprobs):
            rows.append(None)
            continue
        token, value = prompt[i], logprobs[i - 1]
        rank = ranks[i - 1] if i - 1 < len(ranks) else 0
        top = alternatives[i - 1][:k] if i - 1 < len(alternatives) else ()
        entries = [(token, value, rank), *((t, v, r) for r, (t, v) in enumerate(top, 1))]
        strings = texts([t for t, _, _ in entries])
        row: dict[str, PromptLogprob] = {}
        for string, (t, v, r) in zip(strings, entries, strict=True):
            key = str(t)
            if key in row:  # the token is among the alternatives: one entry, its rank
                row[key] = PromptLogprob(row[key].logprob, min(row[key].rank, r), string)
            else:
                row[key] = PromptLogprob(_floored(v), r, string)
        rows.append(row)
    return rows


def total_usage(choices: Sequence[Collected], n: int = 1) -> Usage:
    """Each prompt's tokens once (choices ``i * n`` .. are one prompt's), every choice's
    completion tokens."""
    prompt = sum(c.prompt_tokens for c in choices[::n])
    cached = sum(c.cached_tokens for c in choices[::n])
    return Usage.of(prompt, sum(c.completion_tokens for c in choices), cached)


# --- completions ------------------------------------------------------------------------


@dataclass(frozen=True)
class CompletionReply:
    """A completion's answer: ``n`` choices per prompt, ``logprobs`` alternatives per token
    (None: no logprobs), ``echoes``: per prompt, what ``echo`` puts first (none: no echo)."""

    reply_id: str
    model: str
    texts: TokenTexts
    n: int = 1
    logprobs: int | None = None
    echoes: Sequence[Echo] = ()
    # vLLM's extras: each prompt's token ids, and whether the reply carries them and the
    # choices' (``return_token_ids``); the prompt logprobs asked (None: none); every
    # streamed chunk with its usage.
    prompts: Sequence[Sequence[int]] = ()
    token_ids: bool = False
    prompt_logprobs: int | None = None
    continuous_usage: bool = False

    def body(self, outputs: Sequence[Collected]) -> Response[bytes]:
        """The whole completion: its choices and usage."""
        echoes, n = self.echoes, self.n
        choices = []
        for i, out in enumerate(outputs):
            echo = echoes[i // n] if echoes else None
            choice = completion_choice(i, out, self.texts, self.logprobs, echo)
            if self.token_ids:
                choice.prompt_token_ids = list(self.prompts[i // n])
                choice.token_ids = out.token_ids
            if self.prompt_logprobs is not None:
                first = out.outputs[0] if out.outputs else None
                prompt, k = self.prompts[i // n], self.prompt_logprobs
                choice.prompt_logprobs = prompt_logprobs_of(prompt, first, self.texts, k)
            choices.append(choice)
        created, usage = int(time.time()), total_usage(outputs, n)
        return json_response(Completion(self.reply_id, created, self.model, choices, usage))

    async def chunks(
        self, streams: list[AsyncIterator[StepOutput]], include_usage: bool
    ) -> AsyncIterator[bytes]:
        reply_id, model, n, echoes = self.reply_id, self.model, self.n, self.echoes
        created, totals = int(time.time()), [0, 0, 0]  # prompt, completion, cached
        states = [_StreamedChoice(echoes[i // n] if echoes else None) for i in range(len(streams))]
        first = [True] * len(streams)
        async for index, out in merge_streams(streams):
            if out.error is not None:
                yield error_chunk(out.error)
                return
            if out.finished:
                totals[0] += out.prompt_tokens if index % n == 0 else 0
                totals[1] += out.completion_tokens
                totals[2] += out.cached_tokens if index % n == 0 else 0
            choice = _completion_delta(index, out, states[index], self.texts, self.logprobs)
            if self.token_ids:
                if first[index]:
                    choice.prompt_token_ids = list(self.prompts[index // n])
                choice.token_ids = [] if out.token_id is None else [out.token_id]
            first[index] = False
            usage = usage_so_far(out) if self.continuous_usage else None
            yield _encoder.encode(Completion(reply_id, created, model, [choice], usage))
        if include_usage:
            yield _encoder.encode(Completion(reply_id, created, model, [], Usage.of(*totals)))
        yield b"[DONE]"


def completion_choice(
    index: int,
    collected: Collected,
    texts: TokenTexts,
    logprobs: int | None,
    echo: Echo | None,
) -> CompletionChoice:
    """``logprobs``: alternatives per token (None: no logprobs)."""
    text = collected.text if echo is None else echo.text + collected.text
    scores = None
    if logprobs is not None:
        scores = CompletionLogprobs([], [], [], [])
        if echo is not None:
            first = collected.outputs[0] if collected.outputs else None
            _add_prompt_logprobs(scores, echo.token_ids, first, texts)
        _add_completion_logprobs(scores, collected.outputs, texts, 0)
    return CompletionChoice(
        index, text, collected.finish_reason, scores, stop_reason=collected.stop_reason
    )


def _add_prompt_logprobs(
    scores: CompletionLogprobs,
    prompt: Sequence[int],
    first: StepOutput | None,
    texts: TokenTexts,
) -> None:
    """The prompt's tokens: the first has no logprob (nothing predicts it)."""
    logprobs = list(first.prompt_logprobs or ()) if first is not None else []
    alternatives = list(first.prompt_top_logprobs or ()) if first is not None else []
    strings = texts(prompt)
    offset = 0
    for i, token in enumerate(strings):
        scores.tokens.append(token)
        scores.text_offset.append(offset)
        offset += len(token)
        if i == 0 or i > len(logprobs):
            scores.token_logprobs.append(None)
            scores.top_logprobs.append(None)
            continue
        scores.token_logprobs.append(_floored(logprobs[i - 1]))
        top = alternatives[i - 1] if i - 1 < len(alternatives) else ()
        scores.top_logprobs.append(_top_dict(top, (prompt[i], logprobs[i - 1]), texts))


def _add_completion_logprobs(
    scores: CompletionLogprobs, outputs: Sequence[StepOutput], texts: TokenTexts, offset: int
) -> int:
    """Append each output's token; returns the text offset after them (text offsets count
    characters of the token strings, from ``offset``, or from the echoed prompt's end)."""
    if scores.text_offset:
        offset = scores.text_offset[-1] + len(scores.tokens[-1])
    scored = [(out, out.token_id) for out in outputs if out.token_id is not None]
    strings = texts([token_id for _, token_id in scored])
    for (out, token_id), token in zip(scored, strings, strict=True):
        scores.tokens.append(token)
        scores.token_logprobs.append(_floored(out.logprob))
        chosen = (token_id, out.logprob)
        scores.top_logprobs.append(_top_dict(out.top_logprobs or (), chosen, texts))
        scores.text_offset.append(offset)
        offset += len(token)
    return offset


def _top_dict(
    top: Sequence[tuple[int, float]], chosen: tuple[int, float | None], texts: TokenTexts
) -> dict[str, float]:
    """The k + 1 rule: the k alternatives (best first), then the ``chosen`` token (its id
    and logprob) when not among them. Two ids reading alike keep the first's value."""
    pairs: list[tuple[int, float | None]] = list(top)
    if all(token != chosen[0] for token, _ in pairs):
        pairs.append(chosen)
    entries: dict[str, float] = {}
    for string, (_, value) in zip(texts([t for t, _ in pairs]), pairs, strict=True):
        entries.setdefault(string, _floored(value))
    return entries


@dataclass
class _StreamedChoice:
    """A streamed completion choice's state: echo still owed, text offset so far."""

    echo: Echo | None
    offset: int = 0


def _completion_delta(
    index: int, out: StepOutput, state: _StreamedChoice, texts: TokenTexts, logprobs: int | None
) -> CompletionChoice:
    """One output of a streamed completion choice (the echo before its first)."""
    echo, state.echo = state.echo, None
    text = out.text_delta if echo is None else echo.text + out.text_delta
    scores = None
    if logprobs is not None:
        scores = CompletionLogprobs([], [], [], [])
        if echo is not None:
            _add_prompt_logprobs(scores, echo.token_ids, out, texts)
        outputs = [out] if out.token_id is not None else []
        state.offset = _add_completion_logprobs(scores, outputs, texts, state.offset)
    return CompletionChoice(index, text, finish_reason(out), scores, stop_reason=out.stop_reason)


# --- chat -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatReply:
    """A chat completion's answer: ``top_logprobs`` alternatives per token (None: no
    logprobs); ``tools`` read tool calls for ``request`` from the answer (None: all
    content); ``reasoning``: how the thinking splits from the answer (None: no split)."""

    reply_id: str
    model: str
    texts: TokenTexts
    top_logprobs: int | None = None
    tools: ToolReplies | None = None
    request: ToolRequest | None = None
    reasoning: Reasoning | None = None
    # vLLM's extras: the prompt's token ids, and whether the reply carries them and the
    # choices' (``return_token_ids``); the prompt logprobs asked (None: none); every
    # streamed chunk with its choice's usage so far.
    prompt: Sequence[int] = ()
    token_ids: bool = False
    prompt_logprobs: int | None = None
    continuous_usage: bool = False

    def _parser(self) -> StreamingToolParser | None:
        return None if self.tools is None else self.tools.parser(self.request)

    @property
    def _parallel(self) -> bool:
        return self.request is None or self.request.parallel

    def body(self, outputs: Sequence[Collected]) -> Response[bytes]:
        """The whole chat completion: each choice's message, and the usage."""
        choices = []
        for j, out in enumerate(outputs):
            end = ChoiceEnd(out.end_reason, out.prompt_tokens, out.completion_tokens)
            split = split_choice(out.text, end, self.reasoning, self._parser(), self._parallel)
            choice = chat_choice(j, out, self.texts, self.top_logprobs, split)
            choice.stop_reason = out.stop_reason
            if self.token_ids:
                choice.token_ids = out.token_ids
            choices.append(choice)
        created, usage = int(time.time()), total_usage(outputs)
        reply = ChatCompletion(self.reply_id, created, self.model, choices, usage)
        if self.token_ids:
            reply.prompt_token_ids = list(self.prompt)
        if self.prompt_logprobs is not None:
            first = outputs[0].outputs[0] if outputs and outputs[0].outputs else None
            k = self.prompt_logprobs
            reply.prompt_logprobs = prompt_logprobs_of(self.prompt, first, self.texts, k)
        return json_response(reply)

    async def chunks(
        self, streams: list[AsyncIterator[StepOutput]], include_usage: bool
    ) -> AsyncIterator[bytes]:
        """Each choice (its index in ``streams``) opens with its role, then carries its
        thinking, content and tool-call deltas and each token's logprobs, then its finish."""
        reply_id, model, created = self.reply_id, self.model, int(time.time())
        choices = [ChoiceEvents(self.reasoning, self._parser(), self._parallel) for _ in streams]
        ids = [CallIds() for _ in streams]
        # Each choice's token ids not sent yet: they go on its next chunk (text held back,
        # an EOS: its finish chunk).
        pending: list[list[int]] = [[] for _ in streams]
        so_far: Usage | None = None  # with continuous usage: the chunk's choice's

        def chunk(
            index: int,
            delta: ChatDelta,
            reason: str | None = None,
            scores: ChatLogprobs | None = None,
            stop_reason: str | int | None = None,
        ) -> bytes:
            choice = ChatChunkChoice(index, delta, reason, scores, stop_reason)
            reply = ChatCompletionChunk(reply_id, created, model, [choice], so_far)
            if self.token_ids:
                choice.token_ids, pending[index] = pending[index], []
            return _encoder.encode(reply)

        if self.continuous_usage:
            so_far = Usage(len(self.prompt), 0, len(self.prompt))
        for index in range(len(streams)):
            reply = ChatCompletionChunk(
                reply_id,
                created,
                model,
                [ChatChunkChoice(index, ChatDelta(role="assistant", content=""))],
                so_far,
            )
            if index == 0 and self.token_ids:  # the prompt's ids on the first chunk
                reply.prompt_token_ids = list(self.prompt)
            yield _encoder.encode(reply)
        prompt = completion = cached = 0
        async for index, out in merge_streams(streams):
            if out.error is not None:
                yield error_chunk(out.error)
                return
            if out.token_id is not None:
                pending[index].append(out.token_id)
            if self.continuous_usage:
                so_far = usage_so_far(out)
            scores = None
            if self.top_logprobs is not None and out.token_id is not None:
                scores = ChatLogprobs(chat_logprobs([out], self.texts))
            deltas, end = [], None
            for event in choices[index].feed(out):
                if isinstance(event, Thinking):
                    deltas.append(ChatDelta(reasoning_content=event.text, reasoning=event.text))
                elif isinstance(event, Text):
                    deltas.append(ChatDelta(content=event.text))
                elif isinstance(event, ToolCallDelta):
                    deltas.append(ChatDelta(tool_calls=[ids[index].delta(event)]))
                else:
                    end = event
            if scores is not None and not deltas:
                deltas = [ChatDelta(content="")]
            for i, delta in enumerate(deltas):  # the token's logprobs on its first delta
                yield chunk(index, delta, None, scores if i == 0 else None)
            if end is not None:
                yield chunk(index, ChatDelta(), chat_finish_reason(end), None, out.stop_reason)
                prompt, cached = end.prompt_tokens, end.cached_tokens  # one prompt, once
                completion += end.completion_tokens
        if include_usage:
            usage = Usage.of(prompt, completion, cached)
            yield _encoder.encode(ChatCompletionChunk(reply_id, created, model, [], usage))
        yield b"[DONE]"


def chat_finish_reason(end: ChoiceEnd) -> str:
    return "tool_calls" if end.tool_calls else FINISH_REASONS.get(end.reason, end.reason)


def chat_choice(
    index: int,
    collected: Collected,
    texts: TokenTexts,
    top_logprobs: int | None,
    split: ChoiceResult,
) -> ChatChoice:
    """``top_logprobs``: alternatives per token (None: no logprobs); ``split``: the
    thinking, answer and calls read from the text."""
    scores = None
    if top_logprobs is not None:
        scores = ChatLogprobs(chat_logprobs(collected.outputs, texts))
    message = ChatMessageOut(split.content)
    if split.calls:
        message.tool_calls = [
            ToolCallOut(new_call_id(), FunctionCallOut(c.name, c.arguments)) for c in split.calls
        ]
    if split.reasoning is not None:
        message.reasoning_content = message.reasoning = split.reasoning
    return ChatChoice(index, message, chat_finish_reason(split.end), scores)


def chat_logprobs(outputs: Sequence[StepOutput], texts: TokenTexts) -> list[ChatTokenLogprob]:
    outputs = [o for o in outputs if o.token_id is not None]
    strings = texts([o.token_id for o in outputs if o.token_id is not None])
    items = []
    for out, token in zip(outputs, strings, strict=True):
        top = out.top_logprobs or ()
        alternatives = [
            TopLogprob(s, _floored(v), list(s.encode()))
            for s, (_, v) in zip(texts([t for t, _ in top]), top, strict=True)
        ]
        items.append(
            ChatTokenLogprob(token, _floored(out.logprob), list(token.encode()), alternatives)
        )
    return items


def error_chunk(message: str) -> bytes:
    return _encoder.encode(
        {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    )


def json_response(payload: msgspec.Struct) -> Response[bytes]:
    return Response(_encoder.encode(payload), media_type="application/json")


def _floored(logprob: float | None) -> float:
    """A logprob JSON can carry (-inf, a masked-out token, reads ``LOGPROB_FLOOR``)."""
    return LOGPROB_FLOOR if logprob is None else max(logprob, LOGPROB_FLOOR)
