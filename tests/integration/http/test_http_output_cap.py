"""The output cap and the generation defaults through the HTTP faces (fake runner, through
the composition root): a request asking more than ``--max-output-tokens``, or none, ends
at the cap with ``finish_reason: length`` and ``x-infer-max-output-tokens``; a tenant's
``max_output_tokens`` in the keys file replaces the server's; ``--override-generation-
config`` fills the sampling fields a request left out."""

import json
from pathlib import Path
from typing import Any

import openai
from dependency_injector import providers
from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.observer import RecordingObserver
from adapters.fake.runner import FakeModelRunner, reply_script
from application.access.keys import hash_key
from application.serving.generation import OUTPUT_CAP_HEADER
from domain.request import Request
from entrypoints.config.generation import GenerationSettings
from tests.fakes import fake_container
from tests.support.anthropic_sdk import anthropic_client

ENDLESS = "x" * 400  # the fake model's reply: longer than any cap here


def endless_runner() -> FakeModelRunner:
    return FakeModelRunner(script=reply_script(ByteTokenizer(), ENDLESS))


def client(tmp_path: Path, **overrides: Any) -> tuple[TestClient, RecordingObserver]:
    container = fake_container(endless_runner(), cache_dir=str(tmp_path), **overrides)
    observer = RecordingObserver()
    container.observer.override(providers.Object(observer))
    return TestClient(app=container.http_app()), observer  # type: ignore[arg-type]


def test_a_chat_asking_more_or_none_ends_at_the_cap_and_says_so(tmp_path: Path) -> None:
    http, _ = client(tmp_path, generation=GenerationSettings(max_output_tokens=8))
    with http:
        for extra in ({}, {"max_tokens": 100}, {"max_completion_tokens": 100}):
            body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], **extra}
            reply = http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.headers[OUTPUT_CAP_HEADER] == "8"
            data = reply.json()
            assert data["usage"]["completion_tokens"] == 8
            assert data["choices"][0]["finish_reason"] == "length"
        under = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        reply = http.post("/v1/chat/completions", json=under)
        assert OUTPUT_CAP_HEADER not in reply.headers  # under the cap: as asked
        assert reply.json()["usage"]["completion_tokens"] == 3


def test_every_face_holds_the_cap(tmp_path: Path) -> None:
    http, _ = client(tmp_path, generation=GenerationSettings(max_output_tokens=5))
    with http:
        oa = openai.OpenAI(
            base_url=f"{http.base_url}/v1", api_key="x", http_client=http, max_retries=0
        )
        completion = oa.completions.create(model="fake", prompt="hi", max_tokens=50)
        assert completion.usage is not None and completion.usage.completion_tokens == 5
        assert completion.choices[0].finish_reason == "length"
        response = oa.responses.create(model="fake", input="hi", max_output_tokens=50)
        assert response.usage is not None and response.usage.output_tokens == 5
        assert response.status == "incomplete"
        message = anthropic_client(http).messages.create(
            model="fake", max_tokens=50, messages=[{"role": "user", "content": "hi"}]
        )
        assert message.usage.output_tokens == 5 and message.stop_reason == "max_tokens"


def test_a_tenants_cap_replaces_the_servers(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    tenants = [
        {"id": "free", "keys": [hash_key("sk-free")]},
        {"id": "pro", "keys": [hash_key("sk-pro")], "max_output_tokens": 20},
    ]
    keys.write_text(json.dumps({"tenants": tenants}))
    http, _ = client(
        tmp_path, generation=GenerationSettings(max_output_tokens=6), api_keys_file=str(keys)
    )
    with http:
        for key, cap in (("sk-free", "6"), ("sk-pro", "20")):
            reply = http.post(
                "/v1/completions",
                json={"model": "fake", "prompt": "hi", "max_tokens": 100},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert reply.status_code == 200, reply.text
            assert reply.headers[OUTPUT_CAP_HEADER] == cap
            assert reply.json()["usage"]["completion_tokens"] == int(cap)


def test_the_override_fills_what_a_request_left_out(tmp_path: Path) -> None:
    seen: list[tuple[float, int]] = []
    script = reply_script(ByteTokenizer(), "ok")

    def recording(request: Request) -> int:
        seen.append((request.sampling_params.temperature, request.sampling_params.top_k))
        return script(request)

    override = json.dumps({"temperature": 0.25, "top_k": 7})
    container = fake_container(
        FakeModelRunner(script=recording),
        cache_dir=str(tmp_path),
        generation=GenerationSettings(override_generation_config=override),
    )
    with TestClient(app=container.http_app()) as http:
        for extra in ({}, {"temperature": 0.9}):
            body = {"model": "fake", "prompt": "hi", "max_tokens": 2, **extra}
            assert http.post("/v1/completions", json=body).status_code == 200
    assert set(seen) == {(0.25, 7), (0.9, 7)}
