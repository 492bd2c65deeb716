"""LangChain's ``ChatOpenAI`` and ``OpenAIEmbeddings`` against a real `infer serve` on the
default model (SmolLM2-135M-Instruct, with the all-MiniLM-L6-v2 embedding model beside it):
plain and streamed chat, tools through ``bind_tools``, ``with_structured_output`` (JSON
schema and function calling), embeddings. Constrained decoding is what lets a 135M model
answer these with valid calls and objects."""

import json
from collections.abc import Iterator
from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic import BaseModel, Field

from tests.e2e.server import infer_serve

pytestmark = pytest.mark.slow
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"Sunny in {city}"


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Person(BaseModel):
    """A person named in the text."""

    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=150)
    role: Literal["engineer", "doctor", "teacher"]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with infer_serve("--max-batch-size", "4") as url:
        yield f"{url}/v1"


@pytest.fixture
def llm(base_url: str) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL, base_url=base_url, api_key="unused", temperature=0, max_tokens=64
    )


def test_invoke_and_stream_answer_text(llm: ChatOpenAI) -> None:
    reply = llm.invoke([HumanMessage("What is the capital of France? One word.")])
    assert isinstance(reply, AIMessage) and reply.content
    assert reply.usage_metadata and reply.usage_metadata["output_tokens"] > 0
    chunks = list(llm.stream("Name a color."))
    assert "".join(str(c.content) for c in chunks).strip()


def test_bind_tools_with_a_required_choice_returns_valid_calls(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([get_weather, add], tool_choice="any")  # OpenAI's "required"
    reply = bound.invoke("What is the weather in Paris?")
    # A 135M model asked for "one or more" calls may go on until max_tokens cuts the array:
    # the complete calls come back either way.
    assert reply.tool_calls, reply
    for call in reply.tool_calls:
        assert call["name"] in {"get_weather", "add"}
        if call["name"] == "get_weather":
            assert isinstance(call["args"]["city"], str)
        else:
            assert isinstance(call["args"]["a"], int) and isinstance(call["args"]["b"], int)
    finish = reply.response_metadata["finish_reason"]
    assert finish in ("tool_calls", "length")
    one = llm.bind_tools([get_weather, add], tool_choice="any", parallel_tool_calls=False)
    single = one.invoke("What is the weather in Paris?", max_tokens=256)
    assert len(single.tool_calls) == 1, single
    assert single.response_metadata["finish_reason"] == "tool_calls", single


def test_bind_tools_with_a_named_choice_and_the_result_back_in_the_history(
    llm: ChatOpenAI,
) -> None:
    bound = llm.bind_tools([get_weather, add], tool_choice="add")
    question = HumanMessage("What is 2 plus 3?")
    reply = bound.invoke([question])
    [call] = reply.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    result = ToolMessage(str(add.invoke(call["args"])), tool_call_id=call["id"])
    final = llm.bind_tools([get_weather, add]).invoke([question, reply, result])
    assert isinstance(final, AIMessage)  # the history with tool_calls and a tool message


def test_streamed_tool_calls_assemble_into_valid_calls(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    merged = None
    for chunk in bound.stream("Weather in Rome?"):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None
    [call] = merged.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_with_structured_output_returns_a_valid_object(llm: ChatOpenAI, method: str) -> None:
    prompt = "Extract the person: Ada is a 36 year old engineer."
    if method == "json_mode":  # JSON mode alone does not carry the schema: say it
        prompt += ' Answer in JSON with keys "name", "age" and "role".'
        structured = llm.with_structured_output(Person, method=method, include_raw=True)
        raw = structured.invoke(prompt)["raw"]
        assert isinstance(raw, AIMessage)
        assert isinstance(json.loads(str(raw.content)), dict)  # json_object: always JSON
        return
    person = llm.with_structured_output(Person, method=method).invoke(prompt)
    assert isinstance(person, Person)
    assert 0 <= person.age <= 150 and person.role in {"engineer", "doctor", "teacher"}


def test_embeddings(base_url: str) -> None:
    embeddings = OpenAIEmbeddings(
        model="all-MiniLM-L6-v2",
        base_url=base_url,
        api_key="unused",
        check_embedding_ctx_length=False,  # its tiktoken check would download an encoding
    )
    vectors = embeddings.embed_documents(["A cat sits.", "A dog runs.", "Stock prices fell."])
    query = embeddings.embed_query("A kitten is sitting.")
    assert len(vectors) == 3 and all(len(v) == 384 for v in [*vectors, query])
    similarity = [sum(a * b for a, b in zip(query, v, strict=True)) for v in vectors]
    assert similarity[0] == max(similarity)
