"""Structured outputs on the real default model (SmolLM2-135M-Instruct), through the official
openai SDK against the app: every schema of tests/structured_schemas.py, streamed and not,
sent concurrently; each reply parses and validates with ``jsonschema``. A fast subset runs
by default, the whole set is ``slow``."""

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from litestar.testing import TestClient

from domain.config import EngineConfig
from entrypoints.config import ServerConfig
from entrypoints.container import create_container
from tests.structured_schemas import SCHEMAS, SchemaCase

FAST = ("person", "array_of_objects", "pattern_date", "anyof_objects", "tool_call")
SYSTEM = "You answer with JSON only."


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    config = ServerConfig.for_model(
        dtype="float32", progress=False, engine=EngineConfig(max_num_seqs=16)
    )
    container = create_container(config)
    with TestClient(app=container.http_app()) as http:
        yield openai.OpenAI(
            base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0
        )


def ask(client: openai.OpenAI, case: SchemaCase, stream: bool) -> tuple[str, str | None]:
    """The reply's text and finish reason (greedy)."""
    request = {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": case.prompt},
        ],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": case.name, "schema": case.schema, "strict": True},
        },
        "temperature": 0,
        "max_tokens": 300,
    }
    if not stream:
        reply = client.chat.completions.create(**request)  # type: ignore[call-overload]
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(**request, stream=True):  # type: ignore[call-overload]
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


def check_all(client: openai.OpenAI, cases: list[SchemaCase]) -> None:
    jobs = [(case, stream) for case in cases for stream in (False, True)]
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda job: ask(client, *job), jobs))
    failures = []
    for (case, stream), (text, reason) in zip(jobs, replies, strict=True):
        try:
            assert reason == "stop", f"finish reason {reason}"
            jsonschema.validate(json.loads(text), case.schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{case.name} (stream={stream}): {str(e)[:80]} in {text[:160]!r}")
    assert not failures, "\n".join(failures)


def test_a_subset_of_schemas_validates_stream_and_not(client: openai.OpenAI) -> None:
    check_all(client, [c for c in SCHEMAS if c.name in FAST])


@pytest.mark.slow
def test_every_schema_validates_stream_and_not(client: openai.OpenAI) -> None:
    check_all(client, [c for c in SCHEMAS if c.name not in FAST])
