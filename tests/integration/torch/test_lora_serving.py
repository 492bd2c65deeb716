"""Multi-LoRA serving: requests on different adapters (and on the base model) share engine
steps, and each gets exactly what its own adapter computes — checked against the LoRA
training backend's forward on the same tokens. Also the Tinker EngineSampler over it."""

import asyncio
from pathlib import Path

import pytest
import torch

from adapters.fake import ByteTokenizer
from adapters.torch.cpu.kernels import cpu_kernels
from adapters.torch.loading.loader import load_model
from adapters.torch.lora.serving import LoraServing
from adapters.torch.lora.training import BaseModelEntry, LoraTrainingBackend
from adapters.torch.runtime.runner import TorchModelRunner
from application.engine.async_engine import AsyncEngine
from application.tinker.engine_sampler import EngineSampler
from domain.config import EngineConfig
from domain.sampling import SamplingParams
from domain.tinker.batch import ForwardBackwardInput
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import (
    AdamParams,
    Datum,
    LoraSpec,
    SampleRequest,
    TensorValue,
    TinkerSamplingParams,
    WeightsSource,
)
from tests.support.tiny_models import save_tiny_model

PROMPT = [5, 17, 42, 7, 99, 3, 250, 8, 61, 12]


def train(backend: LoraTrainingBackend, model_id: str, seed: int, steps: int = 3) -> None:
    backend.create(model_id, "tiny", LoraSpec(rank=4, seed=seed))
    tokens = PROMPT[:-1]
    datum = Datum(tokens, {"target_tokens": TensorValue.ints(PROMPT[1:])})
    for _ in range(steps):
        backend.forward_backward(
            model_id, ForwardBackwardInput([datum], "cross_entropy"), backward=True
        )
        backend.optim_step(model_id, AdamParams(learning_rate=0.05))


def reference_logprobs(backend: LoraTrainingBackend, model_id: str, seq: list[int]) -> list[float]:
    """Logprob of each token of ``seq`` after the first, by the training forward."""
    datum = Datum(seq[:-1], {"target_tokens": TensorValue.ints(seq[1:])})
    out = backend.forward_backward(
        model_id, ForwardBackwardInput([datum], "cross_entropy"), backward=False
    )
    return list(out.outputs[0]["logprobs"].data)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def setup(request, tmp_path_factory):
    folder: Path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(request.param, folder)
    backend = LoraTrainingBackend([BaseModelEntry("tiny", folder, dtype=torch.float32)])
    train(backend, "a", seed=1)
    train(backend, "b", seed=2)
    backend.create("base", "tiny", LoraSpec(rank=4, seed=3))  # B = 0: the base model
    saved = {}
    for name in ("a", "b"):
        saved[name] = tmp_path_factory.mktemp(f"adapter-{name}")
        backend.save(name, saved[name], optimizer=False)
    model = load_model(folder, dtype=torch.float32)
    lora = LoraServing(model, live_state=backend.peft_state)
    for name, path in saved.items():
        lora.load_folder(name, path)
    config = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=7)
    engine = AsyncEngine(config, TorchModelRunner(model, config, lora=lora), ByteTokenizer())
    return backend, engine, lora, saved


async def run(engine: AsyncEngine, rid: str, adapter: str | None, **params: object):
    outputs = await engine.stream(
        rid,
        PROMPT,
        SamplingParams(**params),
        adapter_id=adapter,  # type: ignore[arg-type]
    )
    return [o async for o in outputs]


async def test_adapters_and_base_share_steps_and_each_gets_its_own_weights(setup) -> None:
    backend, engine, _, _ = setup
    params = dict(max_tokens=6, temperature=0.0, logprobs=0, prompt_logprobs=True)
    engine.start()
    try:
        # Chunked prefill (7 tokens a step) interleaves the three requests' prompts and
        # decodes: every step mixes adapters.
        results = await asyncio.gather(
            run(engine, "ra", "a", **params),
            run(engine, "rb", "b", **params),
            run(engine, "rbase", None, **params),
        )
    finally:
        await engine.stop()
    for outputs, model_id in zip(results, ("a", "b", "base"), strict=True):
        tokens = [o.token_id for o in outputs]
        scored = outputs[0].prompt_logprobs
        assert scored is not None and len(scored) == len(PROMPT) - 1
        expected = reference_logprobs(backend, model_id, PROMPT + tokens)  # type: ignore[operator]
        torch.testing.assert_close(list(scored), expected[: len(PROMPT) - 1], atol=1e-4, rtol=0)
        got = [o.logprob for o in outputs]
        torch.testing.assert_close(got, expected[len(PROMPT) - 1 :], atol=1e-4, rtol=0)
    # The adapters matter: the three prompt scorings differ.
    first = [r[0].prompt_logprobs for r in results]
    assert first[0] != first[1] and first[0] != first[2]


async def test_engine_sampler_serves_saved_and_live_weights(setup) -> None:
    backend, engine, lora, saved = setup
    sampler = EngineSampler(engine, lora, ["tiny"])
    engine.start()
    try:
        params = TinkerSamplingParams(max_tokens=5, temperature=1.0, seed=7)
        from_path = await sampler.sample(
            WeightsSource("tiny", path=saved["a"]),
            SampleRequest(PROMPT, params, 3, prompt_logprobs=True),
        )
        live = await sampler.sample(
            WeightsSource("tiny", model_id="a"),
            SampleRequest(PROMPT, params, 3, prompt_logprobs=True),
        )
        with pytest.raises(InvalidTrainingRequest, match="not the one"):
            await sampler.sample(
                WeightsSource("other"), SampleRequest(PROMPT, params, 1, prompt_logprobs=False)
            )
    finally:
        await engine.stop()
    # Same weights, same seeds: the same samples; seeds differ per sample.
    assert [s.tokens for s in from_path.sequences] == [s.tokens for s in live.sequences]
    assert len({tuple(s.tokens) for s in from_path.sequences}) > 1
    assert from_path.prompt_logprobs is not None and from_path.prompt_logprobs[0] is None
    expected = reference_logprobs(backend, "a", PROMPT)
    torch.testing.assert_close(from_path.prompt_logprobs[1:], expected, atol=1e-4, rtol=0)
    for seq in from_path.sequences:
        assert len(seq.tokens) == len(seq.logprobs) == 5 and seq.stop_reason == "length"
        ref = reference_logprobs(backend, "a", PROMPT + seq.tokens)[len(PROMPT) - 1 :]
        torch.testing.assert_close(seq.logprobs, ref, atol=1e-4, rtol=0)
    assert all(not k.startswith("live:") for k in lora._adapters)  # the live copy is gone


async def test_engine_sampler_reloads_a_checkpoint_saved_again(setup, tmp_path) -> None:
    backend, engine, lora, _ = setup
    sampler = EngineSampler(engine, lora, ["tiny"])
    params = TinkerSamplingParams(max_tokens=1, temperature=0.0)
    source = WeightsSource("tiny", path=tmp_path)
    engine.start()
    try:
        backend.save("a", tmp_path, optimizer=False)
        first = await sampler.sample(source, SampleRequest(PROMPT, params, 1, prompt_logprobs=True))
        backend.save("b", tmp_path, optimizer=False)  # the same name, other weights
        second = await sampler.sample(
            source, SampleRequest(PROMPT, params, 1, prompt_logprobs=True)
        )
    finally:
        await engine.stop()
    assert first.prompt_logprobs is not None and second.prompt_logprobs is not None
    torch.testing.assert_close(
        second.prompt_logprobs[1:], reference_logprobs(backend, "b", PROMPT), atol=1e-4, rtol=0
    )
    assert first.prompt_logprobs != second.prompt_logprobs


async def test_engine_sampler_without_live_weights_refuses_a_live_source(
    setup, monkeypatch
) -> None:
    _, engine, lora, _ = setup
    monkeypatch.setattr(lora, "live_state", None)  # no training backend wired
    sampler = EngineSampler(engine, lora, ["tiny"])
    params = TinkerSamplingParams(max_tokens=1, temperature=0.0)
    with pytest.raises(InvalidTrainingRequest, match="live training weights"):
        await sampler.sample(
            WeightsSource("tiny", model_id="a"),
            SampleRequest(PROMPT, params, 1, prompt_logprobs=False),
        )
    assert all(not k.startswith("live:") for k in lora._adapters)


@pytest.mark.skipif(cpu_kernels() is None, reason="no AVX512-BF16 or no C++ toolchain")
async def test_bf16_kernels_base_rows_unchanged_by_adapter_rows(tmp_path: Path) -> None:
    """On the default CPU path (bf16, packed linears, the fused C++ decode layer), steps with
    adapter rows take the module path; a base-model request in such steps decodes exactly as
    it does with no adapter around, and the adapter rows track the float32 reference."""
    save_tiny_model("llama", tmp_path / "m", head_dim=32)
    backend = LoraTrainingBackend([BaseModelEntry("tiny", tmp_path / "m", dtype=torch.float32)])
    train(backend, "a", seed=1, steps=4)
    backend.save("a", tmp_path / "a", optimizer=False)
    model = load_model(tmp_path / "m", dtype=torch.bfloat16)
    assert any(b.decode_kernel is not None for b in model.layers)  # the fused path is on
    lora = LoraServing(model)
    lora.load_folder("a", tmp_path / "a")
    config = EngineConfig(max_num_seqs=4, max_model_len=64)
    engine = AsyncEngine(config, TorchModelRunner(model, config, lora=lora), ByteTokenizer())
    params = dict(max_tokens=8, temperature=0.0, logprobs=0, prompt_logprobs=True)
    engine.start()
    try:
        alone = await run(engine, "alone", None, **params)
        base, adapted = await asyncio.gather(
            run(engine, "base", None, **params), run(engine, "with-a", "a", **params)
        )
    finally:
        await engine.stop()
    assert [o.token_id for o in base] == [o.token_id for o in alone]
    assert [o.logprob for o in base] == [o.logprob for o in alone]
    assert all(b.decode_kernel is not None for b in model.layers)  # restored after LoRA steps
    expected = reference_logprobs(backend, "a", PROMPT)
    torch.testing.assert_close(list(adapted[0].prompt_logprobs or ()), expected, atol=0.1, rtol=0)


def test_a_removed_adapter_stays_until_its_last_request_ends(setup) -> None:
    _, _, lora, saved = setup
    lora.load_folder("gone", saved["a"])
    with lora.pinned("gone"):
        lora.remove("gone")
        assert "gone" in lora  # a request running on it finishes on it
    assert "gone" not in lora
    lora.load_folder("gone", saved["a"])
    lora.remove("gone")  # none running: at once
    assert "gone" not in lora


def test_a_folder_over_the_rank_limit_or_of_another_base_is_refused(setup, tmp_path) -> None:
    _, _, lora, saved = setup
    lora.max_rank = 2  # the adapters are rank 4
    try:
        with pytest.raises(InvalidTrainingRequest, match=r"rank 4 is over .*--max-lora-rank 2"):
            lora.load_folder("x", saved["a"])
    finally:
        lora.max_rank = None
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other-base"
    other.mkdir()
    for name in ("adapter_config.json",):
        (other / name).write_text((saved["a"] / name).read_text())
    state = load_file(str(saved["a"] / "adapter_model.safetensors"))
    wider = {k: torch.cat([v, v], dim=1) if "lora_A" in k else v for k, v in state.items()}
    save_file(wider, str(other / "adapter_model.safetensors"))
    with pytest.raises(InvalidTrainingRequest, match="an adapter of another base model"):
        lora.load_folder("other", other)
    assert "other" not in lora
