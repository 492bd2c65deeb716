"""Issue 11 §5: Tinker sampling shares the serving engine with OpenAI traffic. Large
``num_samples`` calls keep at most ``max_in_engine`` requests in the engine (the rest wait
in the sampler and go in as others finish), so the engine's waiting queue stays open for
other requests instead of answering them 503 (QueueFullError)."""

import asyncio
from pathlib import Path
from typing import Any

import torch

from adapters.torch.loading.loader import load_model
from adapters.torch.lora.serving import LoraServing
from application.tinker.engine_sampler import EngineSampler
from domain.config import EngineConfig
from domain.sampling import SamplingParams
from domain.tinker.values import SampleRequest, TinkerSamplingParams, WeightsSource
from tests.fakes import torch_async_engine
from tests.support.tiny_models import save_tiny_model

PROMPT = [3, 14, 15, 92, 65]


async def test_big_tinker_samples_leave_room_for_other_requests(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    lora = LoraServing(model)
    config = EngineConfig(max_num_seqs=2, max_waiting_requests=4, max_model_len=64)
    engine = torch_async_engine(model, config, lora=lora)
    sampler = EngineSampler(engine, lora, ["tiny"], max_in_engine=2)
    tenants: list[str | None] = []  # whose each engine request is (fair shares, counters)
    stream = engine.stream

    async def recorded(request_id: str, *args: Any, **kwargs: Any) -> Any:
        if request_id.startswith("tinker-sample"):
            tenants.append(kwargs["context"].tenant_id if "context" in kwargs else None)
        return await stream(request_id, *args, **kwargs)

    engine.stream = recorded  # type: ignore[method-assign]
    params = TinkerSamplingParams(max_tokens=12, temperature=1.0, seed=1, stop_token_ids=())
    engine.start()
    try:
        tinker = [
            asyncio.ensure_future(
                sampler.sample(
                    WeightsSource("tiny"),
                    SampleRequest(PROMPT, params, 24, prompt_logprobs=False),
                    tenant=t,
                )
            )
            for t in ("tenant-a", "tenant-b")
        ]
        for _ in range(500):  # bounded: until the sampler has filled its slots
            if sampler.slots.held == 2:
                break
            await asyncio.sleep(0.01)
        assert sampler.slots.held == 2

        async def openai_like(i: int) -> int:
            stream = await engine.stream(
                f"openai-{i}", PROMPT, SamplingParams(max_tokens=4, temperature=0.0)
            )
            return len([o async for o in stream])

        # Four more requests fit: 2 running + 4 waiting, Tinker holding 2 of the 6 places.
        # (Before the fix Tinker kept every place taken: these got QueueFullError.)
        done = await asyncio.gather(*(openai_like(i) for i in range(4)))
        assert all(n >= 1 for n in done)
        results = await asyncio.gather(*tinker)
        assert sorted(set(tenants)) == ["tenant-a", "tenant-b"] and len(tenants) == 48
    finally:
        await engine.stop()
    assert [len(r.sequences) for r in results] == [24, 24]
    assert all(len(s.tokens) == 12 for r in results for s in r.sequences)
    assert sampler.slots.held == 0


async def test_the_samples_of_one_call_compute_their_prompt_once(tmp_path: Path) -> None:
    """Issue 15: ``num_samples`` requests of one prompt, admitted together, share one
    prefill (the others fork its full KV blocks); a second call reuses the cached blocks."""
    save_tiny_model("llama", tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    lora = LoraServing(model)
    config = EngineConfig(max_num_seqs=4, max_waiting_requests=4, max_model_len=96)
    engine = torch_async_engine(model, config, lora=lora)
    runner = engine.engine.runner
    computed: list[int] = []
    execute = runner.execute

    def counting(batch):  # prompt positions each step runs
        computed.append(
            sum(c.num_tokens for c in batch.chunks if c.start < c.request.num_prompt_tokens)
        )
        return execute(batch)

    runner.execute = counting  # type: ignore[method-assign]
    sampler = EngineSampler(engine, lora, ["tiny"], max_in_engine=4)
    params = TinkerSamplingParams(max_tokens=6, temperature=1.0, seed=3, stop_token_ids=())
    prompt = [(7 * i) % 200 + 1 for i in range(40)]  # two full blocks, then 8 positions
    engine.start()
    try:
        first = await sampler.sample(
            WeightsSource("tiny"), SampleRequest(prompt, params, 4, prompt_logprobs=False)
        )
        once = sum(computed)
        again = await sampler.sample(
            WeightsSource("tiny"), SampleRequest(prompt, params, 4, prompt_logprobs=False)
        )
    finally:
        await engine.stop()
    # one sample computes 40 positions, three the 8 after the shared blocks (+1 sampled
    # token each feeds back as a decode row, not counted: start >= prompt length)
    assert once == 40 + 3 * 8
    assert sum(computed) - once == 4 * 8  # all four start from the cached blocks
    assert [len(s.tokens) for s in first.sequences + again.sequences] == [6] * 8
