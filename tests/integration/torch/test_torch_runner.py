"""TorchModelRunner under the engine: batched outputs equal each request run alone."""

import dataclasses
from pathlib import Path

import pytest
import torch

from adapters.fake import ByteTokenizer
from adapters.torch.loading.loader import load_model
from adapters.torch.runtime.generate import stream_generate
from adapters.torch.runtime.runner import TorchModelRunner
from application.engine.engine import Engine
from domain.config import EngineConfig
from domain.request import AdmitCall
from domain.sampling import SamplingParams
from tests.fakes import ListSink
from tests.support.engine_calls import add_request
from tests.support.tiny_models import save_tiny_model

TOKENIZER = ByteTokenizer()
PROMPTS = ["Hello there", "A much longer prompt about many things", "Hi", "Sliding windows!"]


@pytest.fixture(
    scope="module",
    params=[
        ("llama", torch.float32),
        ("gemma3", torch.float32),
        ("qwen3", torch.float32),
        # bf16 on a CPU: the compiled kernels (batched attention, cache writes, argmax)
        # (and the fused decode layer; Llama with head_dim 32 so that it applies)
        ("gemma3", torch.bfloat16),
        ("qwen3", torch.bfloat16),
        ("llama", torch.bfloat16, {"head_dim": 32}),
    ],
    ids=lambda p: f"{p[0]}-{str(p[1]).removeprefix('torch.')}",
)
def model(request, tmp_path_factory):
    arch, dtype, *overrides = request.param
    folder: Path = tmp_path_factory.mktemp(arch)
    save_tiny_model(arch, folder, **(overrides[0] if overrides else {}))
    return load_model(folder, dtype=dtype)


def alone(model, prompt: str, params: SamplingParams) -> list[int]:
    ids = TOKENIZER.encode(prompt)
    return [c.token_id for c in stream_generate(model, TOKENIZER, ids, params)]


@pytest.mark.parametrize(
    ("mode", "budget"), [("continuous", 512), ("continuous", 5), ("static", 512)]
)
def test_batched_greedy_outputs_equal_each_request_alone(model, mode, budget) -> None:
    config = EngineConfig(
        batching_mode=mode,
        batch_wait_timeout=0.0,
        max_num_seqs=3,
        max_num_batched_tokens=max(budget, 3),
        max_model_len=96,
    )
    runner = TorchModelRunner(model, config)
    sink = ListSink()
    engine = Engine(config, runner, TOKENIZER, sink)
    lengths = [12, 20, 7, 15]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    add_request(engine, "r0", PROMPTS[0], params[0])
    add_request(engine, "r1", PROMPTS[1], params[1])
    for step in range(200):
        if step == 3:  # joins a running batch (continuous) or waits for the next (static)
            add_request(engine, "r2", PROMPTS[2], params[2])
            add_request(engine, "r3", PROMPTS[3], params[3])
        if not engine.has_work() and step > 3:
            break
        engine.step()
    engine.step()  # releases the last finished requests
    for i, prompt in enumerate(PROMPTS):
        got = [o.token_id for o in sink.outputs if o.request_id == f"r{i}"]
        assert got == alone(model, prompt, params[i]), f"request r{i}"
    assert runner.generators == {}
    assert engine.scheduler.blocks.num_free_blocks == config.kv_blocks  # type: ignore[attr-defined]


def test_a_cached_prefix_is_reused_with_the_same_greedy_output(model) -> None:
    """Prefix caching: a later request computes only what follows the full blocks an
    earlier one left cached, and generates what it generates alone."""
    config = EngineConfig(max_num_seqs=2, max_model_len=128)
    engine = Engine(config, TorchModelRunner(model, config), TOKENIZER, sink := ListSink())
    shared = "A system prompt shared by every request, two blocks long: "
    prompts = {"first": shared + "one?", "second": shared + "two!", "again": shared + "one?"}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prefill, hits = {}, {}
    for name, prompt in prompts.items():
        add_request(engine, name, prompt, params)
        prefill[name] = hits[name] = 0
        while engine.has_work():
            stats = engine.step().scheduler
            prefill[name] += stats.prefill_tokens
            hits[name] += stats.prefix_hit_tokens
    ids = {name: TOKENIZER.encode(prompt) for name, prompt in prompts.items()}
    n = len(ids["first"])
    common = next(
        i for i, (a, b) in enumerate(zip(ids["first"], ids["second"], strict=False)) if a != b
    )
    assert common >= 32
    assert (prefill["first"], hits["first"]) == (n, 0)
    assert hits["second"] == common // 16 * 16 and prefill["second"] == n - hits["second"]
    assert hits["again"] == (n - 1) // 16 * 16 and prefill["again"] == n - hits["again"]
    for name, prompt in prompts.items():
        got = [o.token_id for o in sink.outputs if o.request_id == name]
        assert got == alone(model, prompt, params), name


def test_n_greedy_choices_and_a_cached_prompt_decode_what_the_prompt_alone_does(model) -> None:
    """``n`` > 1 choices share one prefill: the first computes the prompt but its last token,
    then that token as a one-token chunk; the others fork its full blocks and compute the
    rest (a partial block and the last token) themselves. A one-token chunk of a prompt runs
    as a prompt chunk, not as a decode row (whose attention rounds differently in bf16), so
    every greedy choice, and a later request over the cached prompt, is the prompt alone."""
    config = EngineConfig(max_num_seqs=4, max_model_len=96)
    runner = TorchModelRunner(model, config)
    engine = Engine(config, runner, TOKENIZER, sink := ListSink())
    prompt = "Eighteen bytes of a"
    ids = TOKENIZER.encode(prompt)
    n = len(ids)  # 16 < n < 32: the siblings fork one block
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    steps: list[tuple[int, list[int]]] = []  # (decode rows, prompt chunk lengths) a step
    forward = model.forward_mixed

    def recording(tokens, batch, rows):  # type: ignore[no-untyped-def]
        steps.append((batch.rows, [length for _, length in batch.chunks]))
        return forward(tokens, batch, rows)

    model.forward_mixed = recording
    try:
        engine.admit(AdmitCall(("c0", "c1", "c2"), (ids,), params, 3))
        while engine.has_work():
            engine.step()
        add_request(engine, "later", ids, params)  # its first 16 positions cached
        while engine.has_work():
            engine.step()
    finally:
        del model.forward_mixed
    # the first choice's prompt but its last token; that token as a chunk beside the others'
    # tails; then three decode rows
    assert [(rows, sorted(chunks)) for rows, chunks in steps[:3]] == [
        (0, [n - 1]),
        (0, [1, n - 16, n - 16]),
        (3, []),
    ]
    expected = alone(model, prompt, params)
    for request_id in ("c0", "c1", "c2", "later"):
        assert [o.token_id for o in sink.outputs if o.request_id == request_id] == expected


def test_prompt_logprobs_are_computed_in_full_even_when_the_prefix_is_cached(model) -> None:
    """A request asking for prompt logprobs runs every prompt position (the cached blocks
    hold KV, not logits), and its logprobs equal those of an engine without caching."""
    prompt = "A system prompt shared by every request, two blocks long: one?"
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=True)
    results = {}
    for caching in (True, False):
        config = EngineConfig(max_num_seqs=2, max_model_len=128, prefix_caching=caching)
        engine = Engine(config, TorchModelRunner(model, config), TOKENIZER, ListSink())
        add_request(engine, "warm", prompt, dataclasses.replace(params, prompt_logprobs=False))
        while engine.has_work():
            engine.step()
        request = add_request(engine, "scored", prompt, params)
        hits = 0
        while engine.has_work():
            hits += engine.step().scheduler.prefix_hit_tokens
        assert hits == 0
        results[caching] = request.prompt_logprobs
    n = len(TOKENIZER.encode(prompt))
    assert len(results[True]) == n - 1
    assert results[True] == pytest.approx(results[False], abs=1e-4)


def test_seeded_sampling_is_the_same_batched_or_alone(model) -> None:
    config = EngineConfig(max_num_seqs=4, max_model_len=96)
    runner = TorchModelRunner(model, config)
    sink = ListSink()
    engine = Engine(config, runner, TOKENIZER, sink)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    add_request(engine, "seeded", PROMPTS[0], seeded)
    add_request(engine, "other", PROMPTS[1], other)
    while engine.has_work():
        engine.step()
    got = [o.token_id for o in sink.outputs if o.request_id == "seeded"]
    assert got == alone(model, PROMPTS[0], seeded)


def _run_all(model, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, list]:
    config = EngineConfig(max_num_seqs=len(requests), max_model_len=96)
    sink = ListSink()
    engine = Engine(config, TorchModelRunner(model, config), TOKENIZER, sink)
    for request_id, (prompt, params) in requests.items():
        add_request(engine, request_id, prompt, params)
    while engine.has_work():
        engine.step()
    return {request_id: sink.of(request_id) for request_id in requests}


def test_logit_bias_and_allowed_ids_apply_to_their_rows_only(model) -> None:
    """The logits seam: one batched step, each row processed by its own request's params;
    the other rows are what they are alone; logprobs are those of the processed
    distribution (``raw`` mode: the model's own)."""
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    forced = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0, logit_bias=((77, 100.0),)
    )
    allowed = SamplingParams(
        temperature=0.7, seed=3, max_tokens=6, ignore_eos=True, allowed_token_ids=(40, 41, 42)
    )
    out = _run_all(
        model,
        {
            "plain": (PROMPTS[0], plain),
            "forced": (PROMPTS[1], forced),
            "allowed": (PROMPTS[2], allowed),
        },
    )
    assert [o.token_id for o in out["plain"]] == alone(model, PROMPTS[0], plain)
    assert [o.token_id for o in out["forced"]] == [77] * 6
    assert {o.token_id for o in out["allowed"]} <= {40, 41, 42}
    assert [o.token_id for o in out["allowed"]] == alone(model, PROMPTS[2], allowed)
    # A +100 bias makes 77 certain to be sampled: its processed logprob is ~0, the model's not.
    assert all(o.logprob is not None and o.logprob > -1e-3 for o in out["forced"])
    raw = dataclasses.replace(forced, logprobs_mode="raw")
    out = _run_all(model, {"raw": (PROMPTS[1], raw)})
    assert all(o.logprob is not None and o.logprob < -0.01 for o in out["raw"])
    assert alone(model, PROMPTS[1], forced) == [77] * 6  # generate() shares the seam


def test_a_batch_without_logit_processing_is_not_copied(model) -> None:
    from adapters.torch.runtime.logits import process_logits

    logits = torch.randn(3, 50)
    params = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=5)]
    assert process_logits(logits, params) is logits
    biased = process_logits(logits, [*params[:2], SamplingParams(logit_bias=((4, -100.0),))])
    assert torch.equal(biased[:2], logits[:2]) and biased[2, 4] == logits[2, 4] - 100.0
