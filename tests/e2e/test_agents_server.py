"""The openai-agents SDK on a real `infer serve` process (default model,
SmolLM2-135M-Instruct) through ``/v1/responses``: a two-tool agent loop, whole and
streamed (the streamed one continuing by ``previous_response_id``).

The calls are made deterministic the SDK's own way: the agent's ``tool_choice`` names a
function (the server constrains the output to that function's arguments), a run hook names
the next one once a tool ran (``reset_tool_choice`` off, so the SDK keeps what is named),
and ``StopAtTools`` ends the run at the second tool, its output the final output. The tools'
arguments are an enum, so a small model's call is always complete within ``max_tokens``."""

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    RunContextWrapper,
    RunHooks,
    Runner,
    StopAtTools,
    Tool,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from tests.e2e.server import infer_serve

pytestmark = pytest.mark.slow
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = "What is the weather in Paris, and what time is it?"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    set_tracing_disabled(True)
    with infer_serve("--max-batch-size", "2") as url:
        yield url


class NextTool(RunHooks[Any]):
    """Once get_weather ran, the model must call get_time."""

    async def on_tool_end(
        self, context: RunContextWrapper[Any], agent: Agent[Any], tool: Tool, result: object
    ) -> None:
        if tool.name == "get_weather":
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="get_time")


def two_tool_agent(base_url: str, ran: list[str]) -> Agent[Any]:
    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Tokyo"]) -> str:
        """The current weather in a city."""
        ran.append(f"get_weather({city})")
        return f"Sunny, 24C in {city}."

    @function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time now in a time zone."""
        ran.append(f"get_time({zone})")
        return f"12:00 {zone}"

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    return Agent(
        name="assistant",
        instructions="Use the tools to answer.",
        tools=[get_weather, get_time],
        model=OpenAIResponsesModel(MODEL, client),
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=48, temperature=0),
        reset_tool_choice=False,
        tool_use_behavior=StopAtTools(stop_at_tool_names=["get_time"]),
    )


def check_run(ran: list[str], result: Any) -> None:
    assert [name.split("(")[0] for name in ran] == ["get_weather", "get_time"], ran
    assert ran[0] in ("get_weather(Paris)", "get_weather(Rome)", "get_weather(Tokyo)")
    assert result.final_output == f"12:00 {ran[1][len('get_time(') : -1]}"
    calls = [item for r in result.raw_responses for item in r.output]
    assert [c.type for c in calls] == ["function_call", "function_call"]
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert all(r.usage.output_tokens > 0 for r in result.raw_responses)


def test_an_agent_runs_both_tools_and_finishes(base_url: str) -> None:
    ran: list[str] = []
    agent = two_tool_agent(base_url, ran)
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=4, hooks=NextTool()))
    check_run(ran, result)


def test_a_streamed_agent_continues_by_previous_response_id(base_url: str) -> None:
    ran: list[str] = []
    agent = two_tool_agent(base_url, ran)

    async def run() -> Any:
        result = Runner.run_streamed(
            agent, QUESTION, max_turns=4, hooks=NextTool(), auto_previous_response_id=True
        )
        kinds = [event.type async for event in result.stream_events()]
        assert "raw_response_event" in kinds
        return result

    result = asyncio.run(run())
    check_run(ran, result)
    first, second = result.raw_responses
    assert first.response_id is not None and second.response_id != first.response_id
