"""``GET /health/generate``: a short greedy generation through the engine (fake runner,
through the composition root) — 200 with its times on the base model or a served name,
503 with why when the engine fails it, 404 for an unknown model or a rollout's name;
probes coalesce (one engine request for many callers at once, reused for a second)."""

import asyncio
from pathlib import Path
from typing import Any

from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from application.engine.generation_probe import TOKENS, GenerationProbe
from domain.rollout import parse_rollout
from entrypoints.config.model import ModelSettings
from tests.fakes import fake_container

PROBE = "/health/generate"


def client_for(tmp_path: Path, script: Any = None) -> tuple[TestClient, FakeModelRunner]:
    runner = FakeModelRunner(script=script or reply_script(ByteTokenizer(), "Paris"))
    model = ModelSettings(aliases=("v1", "v2"), rollouts=(parse_rollout("canary=v1:1,v2:1"),))
    container = fake_container(
        runner, cache_dir=str(tmp_path), served_model_name="base", model=model
    )
    return TestClient(app=container.http_app()), runner


def test_the_probe_runs_prefill_and_decode(tmp_path: Path) -> None:
    client, runner = client_for(tmp_path)
    with client:
        answer = client.get(PROBE)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert (body["status"], body["model"], body["tokens"]) == ("ok", "base", TOKENS)
        assert body["ttft_ms"] >= 0 and body["tpot_ms"] >= 0
        assert any(chunk.num_rows > 1 for step in runner.steps for chunk in step.chunks)  # prefill
        by_name = client.get(PROBE, params={"model": "v2"}).json()
        assert (by_name["status"], by_name["model"]) == ("ok", "v2")
        for name in ("nope", "canary"):
            missing = client.get(PROBE, params={"model": name})
            assert missing.status_code == 404 and missing.json()["status"] == "unknown model"


def test_a_failing_engine_is_a_503_saying_why(tmp_path: Path) -> None:
    def broken(request: Any) -> int:
        raise RuntimeError("weights are broken")

    client, _ = client_for(tmp_path, broken)
    with client:
        answer = client.get(PROBE)
        assert answer.status_code == 503, answer.text
        body = answer.json()
        assert body["status"] == "failed" and body["error"]
        assert client.get("/health").status_code == 200  # the loop itself still runs


class CountingEngine:
    """An engine client whose streams give three tokens after a pause, counted."""

    healthy = True

    def __init__(self) -> None:
        self.streams = 0

    async def stream(self, request_id: str, prompt: Any, params: Any, **_: Any) -> Any:
        self.streams += 1

        async def outputs() -> Any:
            from domain.request import StepOutput

            for i in range(TOKENS):
                await asyncio.sleep(0.01)
                finished = i == TOKENS - 1
                yield StepOutput(request_id, i, "x", finished, "length" if finished else None)

        return outputs()

    def abort(self, request_ids: Any) -> None:
        pass


def test_probes_coalesce_and_are_reused_briefly() -> None:
    engine = CountingEngine()
    now = [0.0]
    probe = GenerationProbe(engine, reuse_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type]

    async def main() -> None:
        results = await asyncio.gather(*(probe.run() for _ in range(5)))
        assert all(r.ok and r.tokens == TOKENS for r in results)
        assert engine.streams == 1  # five callers, one generation
        await probe.run()
        assert engine.streams == 1  # reused within a second
        now[0] += 2
        await probe.run()
        await probe.run("lora-module:x")  # another model: its own probe
        assert engine.streams == 3

    asyncio.run(main())
