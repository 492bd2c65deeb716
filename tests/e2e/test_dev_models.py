"""Every model family end to end: the three dev models at their real
sizes (random weights from their published configs) and Gemma-3-270M's real weights stream
through the HTTP app — native SSE and OpenAI completions, several requests batched."""

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from litestar.testing import TestClient

from domain.config import EngineConfig
from entrypoints.config import ServerConfig
from entrypoints.container import create_container

pytestmark = pytest.mark.slow


def sse(text: str) -> list[tuple[str, dict]]:
    """(event, data) pairs of a native /v1/generate stream."""
    events = []
    for block in text.replace("\r\n", "\n").strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        events.append((fields.get("event", "message"), json.loads(fields["data"])))
    return events


@pytest.fixture(
    scope="module",
    params=["dummy:Llama-3.2-1B", "dummy:Qwen3-1.7B", "dummy:Gemma-3-1B", "gemma-3-270m"],
)
def served(request, tmp_path_factory) -> Iterator[tuple[TestClient, str]]:
    # Dummy configs live in a throwaway cache; the real weights in the shared one.
    cache = None if request.param == "gemma-3-270m" else str(tmp_path_factory.mktemp("cache"))
    config = ServerConfig.for_model(
        request.param,
        dtype="bfloat16",
        cache_dir=cache,
        progress=False,
        engine=EngineConfig(max_num_seqs=4, max_model_len=256),
    )
    container = create_container(config)
    name = container.backend.resolved_model().name
    with TestClient(app=container.http_app()) as client:
        yield client, name


def test_generate_streams_token_and_done_events(served) -> None:
    client, name = served
    response = client.post(
        "/v1/generate", json={"model": name, "prompt": "The capital of France is", "max_tokens": 6}
    )
    assert response.status_code == 200
    events = sse(response.text)
    # Dummy models sample ids the byte tokenizer decodes to nothing, so the last token, empty
    # and final, is folded into `done` (as an EOS token would be).
    kinds = [e for e, _ in events]
    assert kinds[-1] == "done" and set(kinds[:-1]) == {"token"} and len(kinds) - 1 in (5, 6)
    assert all(isinstance(data["token_id"], int) for _, data in events[:-1])
    assert events[-1][1]["finish_reason"] == "length"
    assert events[-1][1]["usage"]["completion_tokens"] == 6


def test_concurrent_completions_are_batched_and_all_finish(served) -> None:
    client, name = served

    def complete(prompt: str) -> dict:
        body = {"model": name, "prompt": prompt, "max_tokens": 5, "temperature": 0}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    prompts = ["Once upon a time", "1, 2, 3,", "The weather today", "def main():"]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(complete, prompts))
    for reply in replies:
        assert reply["choices"][0]["finish_reason"] == "length"
        assert reply["usage"]["completion_tokens"] == 5
