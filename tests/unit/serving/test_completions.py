"""The completion use case with fakes: its steps' order, what it reserves, the chat's
``max_tokens``, priorities, and errors naming the request's fields."""

from typing import Any

import pytest

from application.serving.chat_prompts import ChatPrompts, ToolRequest
from application.serving.completions import (
    UNSET_MAX_TOKENS_RESERVE,
    Caller,
    ChatJob,
    CompletionService,
    PromptJob,
)
from application.serving.request_record import RequestRecord
from application.serving.tool_parsers import FORMATS
from domain.errors import InvalidParameterError, PromptTooLongError
from domain.request import AdmitCall, RequestContext
from domain.sampling import SamplingParams
from tests.fakes import AcceptingGrammar, fake_async_engine

MESSAGES = [{"role": "user", "content": "hi"}]


class Limits:
    def __init__(self) -> None:
        self.reserved: list[int] = []

    async def reserve(self, tokens: int) -> None:
        self.reserved.append(tokens)


class Group:
    """An ``OwnedRequests`` group that records what it is asked to queue."""

    def __init__(self) -> None:
        self.context = RequestContext()
        self.admitted: list[tuple[list[str], list[list[int]], SamplingParams, int]] = []

    def admit(self, call: AdmitCall) -> list:
        self.admitted.append((list(call.request_ids), list(call.prompts), call.params, call.n))
        return []

    def close(self) -> None: ...

    def fail(self, error: str) -> None: ...


def service(**config: Any) -> CompletionService:
    inputs = fake_async_engine(grammar=AcceptingGrammar(), **config).inputs
    return CompletionService(inputs, ChatPrompts(FORMATS["hermes"], inputs))


def caller() -> tuple[Caller, Group, Limits, RequestRecord]:
    group, limits, record = Group(), Limits(), RequestRecord()
    return Caller(group, record, limits), group, limits, record  # type: ignore[arg-type]


async def test_a_completion_is_prepared_reserved_then_admitted_at_its_priority() -> None:
    who, group, limits, record = caller()
    job = PromptJob(params=SamplingParams(max_tokens=4), prompts=["ab", [7, 8, 9]], n=2, priority=3)
    started = await service().complete(job, who)
    assert started.prompts[1] == [7, 8, 9]
    assert limits.reserved == [len(started.prompts[0]) + 3 + 4 * 2 * 2]
    [(ids, prompts, _, n)] = group.admitted
    assert n == 2 and prompts == started.prompts
    assert len(ids) == 4 and all(i.startswith("cmpl") for i in ids)
    assert group.context.priority == -3  # the scheduler runs a higher context priority first
    assert [name for name, _, _ in record.timings] == ["tokenize"]


async def test_a_chat_takes_what_the_context_leaves_and_reserves_at_most_the_default() -> None:
    who, group, limits, record = caller()
    job = ChatJob(params=SamplingParams(max_tokens=1), messages=MESSAGES)
    started = await service(max_model_len=2048).chat(job, who)
    [prompt] = started.prompts
    assert started.params.max_tokens == 2048 - len(prompt)
    assert limits.reserved == [len(prompt) + UNSET_MAX_TOKENS_RESERVE]
    assert group.admitted[0][0][0].startswith("chatcmpl")
    assert [name for name, _, _ in record.timings] == ["render_chat", "tokenize"]


async def test_a_named_tool_constrains_the_output() -> None:
    tool = {"type": "function", "function": {"name": "f"}}
    job = ChatJob(
        params=SamplingParams(),
        messages=MESSAGES,
        tools=ToolRequest([tool], "f", parallel=True),
        max_tokens=5,
    )
    started = await service().chat(job, caller()[0])
    assert started.params.max_tokens == 5
    assert started.params.structured is not None
    assert started.params.structured.kind == "json_schema"


async def test_errors_name_the_fields_the_request_used() -> None:
    job = ChatJob(
        params=SamplingParams(),
        messages=MESSAGES,
        max_tokens=0,
        max_tokens_param="max_completion_tokens",
    )
    with pytest.raises(InvalidParameterError) as error:
        await service().chat(job, caller()[0])
    assert error.value.param == "max_completion_tokens"
    too_big = [{"role": "user", "content": "x" * 100}]
    with pytest.raises(InvalidParameterError) as error:
        await service(max_prompt_bytes=50).chat(
            ChatJob(params=SamplingParams(), messages=too_big), caller()[0]
        )
    assert error.value.param == "messages"


async def test_nothing_is_reserved_or_queued_for_a_refused_request() -> None:
    who, group, limits, _ = caller()
    with pytest.raises(PromptTooLongError):
        await service(max_model_len=8).complete(
            PromptJob(params=SamplingParams(max_tokens=4), prompts=["abcdefg"]), who
        )
    with pytest.raises(InvalidParameterError) as error:
        await service(max_n=2).complete(PromptJob(params=SamplingParams(), prompts=["a"], n=3), who)
    assert error.value.param == "n"
    assert limits.reserved == [] and group.admitted == []
