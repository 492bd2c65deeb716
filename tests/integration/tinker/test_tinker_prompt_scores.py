"""Issue 31: Tinker's prompt scores beyond prompt logprobs — ``target_prompt_logprobs`` and
``prompt_alt_tokens_k`` — from the serving engine's prefill (held against a full forward
of the model), over raw HTTP (JSON and protobuf answers, bad input refused with a 400
naming the field), and ``prompt_logprobs_last_n``'s edges."""

from pathlib import Path
from typing import Any

import pytest
import torch
from tinker.proto.response_conv import deserialize_sample_response

from adapters.http.tinker.codec import proto as codec
from adapters.torch.loading.loader import load_model
from adapters.torch.lora.serving import LoraServing
from adapters.torch.models.transformer import Transformer
from application.tinker.engine_sampler import EngineSampler
from application.tinker.service import TinkerService
from domain.config import EngineConfig
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import (
    PromptAltTokens,
    PromptTable,
    SampledSequence,
    SampleRequest,
    TinkerSampleResult,
    TinkerSamplingParams,
    WeightsSource,
)
from tests.fakes import torch_async_engine
from tests.support.tinker_client import SEQ, Api, sample_body
from tests.support.tinker_server import toy_service
from tests.support.tiny_models import save_tiny_model

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
OTHER = 7  # an id scored at every position beside the prompt's own next token


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Transformer, LoraServing]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", folder)
    model = load_model(folder, dtype=torch.float32)
    return model, LoraServing(model)


def reference(model: Transformer, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt), V]`` logprobs of a full forward (no cache): row i predicts i + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model.forward(torch.tensor([prompt]))[0].float(), dim=-1)


async def sample(
    tiny: tuple[Transformer, LoraServing], request: SampleRequest, *, budget: int = 512
) -> TinkerSampleResult:
    """``request`` through the serving engine; ``budget``: tokens per step (5: the prompt
    is prefilled in chunks)."""
    model, lora = tiny
    config = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=budget)
    engine = torch_async_engine(model, config, lora=lora)
    sampler = EngineSampler(engine, lora, ["tiny"])
    engine.start()
    try:
        return await sampler.sample(WeightsSource("tiny"), request)
    finally:
        await engine.stop()


def dense(rows: list[list[int]]) -> PromptTable:
    return PromptTable((len(rows), len(rows[0])), [v for row in rows for v in row])


@pytest.mark.parametrize("budget", [512, 5])
async def test_target_logprobs_and_draws_are_the_prefill_forwards(
    tiny: tuple[Transformer, LoraServing], budget: int
) -> None:
    n = len(PROMPT) - 1
    ids = [[PROMPT[i + 1], OTHER, -1] for i in range(n)]
    params = TinkerSamplingParams(max_tokens=2, temperature=1.0, seed=5)
    request = SampleRequest(
        PROMPT, params, 2, prompt_logprobs=True, target_prompt=dense(ids), prompt_alt_k=4
    )
    result = await sample(tiny, request, budget=budget)
    expected = reference(tiny[0], PROMPT)
    table = result.target_prompt_logprobs
    assert table is not None and table.shape == (n, 3)
    got = [list(table.values[3 * i : 3 * i + 3]) for i in range(n)]
    for i, (own, other, skipped) in enumerate(got):
        assert own == pytest.approx(expected[i, PROMPT[i + 1]].item(), abs=1e-4)
        assert other == pytest.approx(expected[i, OTHER].item(), abs=1e-4)
        assert skipped == 0.0
    # the prompt's own token: the same number prompt_logprobs reports
    assert result.prompt_logprobs is not None
    assert [row[0] for row in got] == pytest.approx(result.prompt_logprobs[1:], abs=1e-6)
    alt = result.prompt_alt_tokens
    assert alt is not None and alt.k == 4
    assert len(alt.tokens) == len(alt.logprobs) == n
    for i, (tokens, logprobs) in enumerate(zip(alt.tokens, alt.logprobs, strict=True)):
        assert len(tokens) == len(logprobs) == 4
        assert logprobs == pytest.approx([expected[i, t].item() for t in tokens], abs=1e-4)
    assert len({t for row in alt.tokens for t in row}) > 4  # drawn, not one argmax


async def test_draws_depend_on_the_seed_and_position_only(
    tiny: tuple[Transformer, LoraServing],
) -> None:
    """The same seed draws the same tokens however the prompt is chunked (and draw j is the
    same whatever k); another seed draws others; temperature 0 draws the argmax."""

    def request(seed: int, k: int, temperature: float = 1.0) -> SampleRequest:
        params = TinkerSamplingParams(max_tokens=1, temperature=temperature, seed=seed)
        return SampleRequest(PROMPT, params, prompt_alt_k=k)

    def tokens(result: TinkerSampleResult) -> list[list[int]]:
        assert result.prompt_alt_tokens is not None
        return result.prompt_alt_tokens.tokens

    whole = tokens(await sample(tiny, request(11, 6)))
    chunked = tokens(await sample(tiny, request(11, 6), budget=5))
    fewer = tokens(await sample(tiny, request(11, 2), budget=5))
    other = tokens(await sample(tiny, request(12, 6)))
    assert whole == chunked
    assert fewer == [row[:2] for row in whole]
    assert other != whole
    greedy = tokens(await sample(tiny, request(11, 3, temperature=0.0)))
    argmax = reference(tiny[0], PROMPT)[:-1].argmax(dim=-1).tolist()
    assert greedy == [[t] * 3 for t in argmax]


async def test_target_ids_outside_the_vocabulary_fail_before_any_sample_runs(
    tiny: tuple[Transformer, LoraServing],
) -> None:
    vocab = tiny[0].config.vocab_size
    n = len(PROMPT) - 1
    table = dense([[vocab if i == 3 else -1] for i in range(n)])
    request = SampleRequest(PROMPT, TinkerSamplingParams(max_tokens=1), target_prompt=table)
    with pytest.raises(InvalidTrainingRequest, match=rf"target_prompt_logprobs: token id {vocab}"):
        await sample(tiny, request)


async def test_the_last_n_prompt_logprobs_start_from_the_prefix_cache(
    tiny: tuple[Transformer, LoraServing],
) -> None:
    """With ``prompt_logprobs_last_n`` only the suffix must run: a prompt cached by an
    earlier call is served from the cache up to it (prompt logprobs otherwise run every
    position), and the suffix's logprobs and top-k rows are a full forward's; likewise up
    to the first position ``target_prompt_logprobs`` names an id at."""
    model, lora = tiny
    prompt = [(7 * i + 3) % 200 for i in range(45)]
    config = EngineConfig(max_num_seqs=4, max_model_len=64, kv_block_size=8)
    engine = torch_async_engine(model, config, lora=lora)
    sampler = EngineSampler(engine, lora, ["tiny"])
    params = TinkerSamplingParams(max_tokens=1, temperature=0.0)

    def hits() -> int:
        return engine.engine.scheduler.kv_stats().prefix_hit_tokens

    engine.start()
    try:
        await sampler.sample(WeightsSource("tiny"), SampleRequest(prompt, params))  # warms
        before = hits()
        whole = await sampler.sample(
            WeightsSource("tiny"), SampleRequest(prompt, params, prompt_logprobs=True)
        )
        assert hits() == before  # every position scored: every position runs
        last = await sampler.sample(
            WeightsSource("tiny"),
            SampleRequest(
                prompt, params, prompt_logprobs=True, topk_prompt=2, prompt_logprobs_last_n=3
            ),
        )
        assert hits() - before == 40  # 5 blocks of 8, short of position 41's row
        # target ids at the last position only: the rows before it are not scored either
        table = PromptTable((44, 1), [-1] * 43 + [prompt[44]])
        targeted = await sampler.sample(
            WeightsSource("tiny"), SampleRequest(prompt, params, target_prompt=table)
        )
        assert hits() - before == 80
    finally:
        await engine.stop()
    expected = reference(model, prompt)
    assert whole.prompt_logprobs is not None and last.prompt_logprobs is not None
    assert last.prompt_logprobs[:41] == [None] * 41
    assert last.prompt_logprobs[42:] == pytest.approx(whole.prompt_logprobs[42:], abs=1e-5)
    assert last.prompt_logprobs[-3:] == pytest.approx(
        [expected[i - 1, prompt[i]].item() for i in range(42, 45)], abs=1e-4
    )
    assert targeted.target_prompt_logprobs is not None
    assert list(targeted.target_prompt_logprobs.values) == pytest.approx(
        [0.0] * 43 + [expected[43, prompt[44]].item()], abs=1e-4
    )
    assert last.topk_prompt is not None and last.topk_prompt[:41] == [None] * 41
    for i in range(42, 45):
        row = last.topk_prompt[i]
        assert row is not None and [t for t, _ in row] == expected[i - 1].topk(2).indices.tolist()


# --- over HTTP (the toy backend) ------------------------------------------------------------


@pytest.fixture
def service(tmp_path: Path) -> TinkerService:
    return toy_service(tmp_path / "ckpt", long_poll_s=0.5)


def sparse_body(rows: list[list[int]]) -> dict[str, Any]:
    """``rows`` as TensorData JSON in CSR, the -1 cells left out (as the SDK's
    ``from_torch_sparse(ids, pad_value=-1)`` sends it)."""
    crow, cols, data = [0], [], []
    for row in rows:
        for j, v in enumerate(row):
            if v != -1:
                cols.append(j)
                data.append(v)
        crow.append(len(data))
    return {
        "data": data,
        "dtype": "int64",
        "shape": [len(rows), len(rows[0])],
        "sparse_crow_indices": crow,
        "sparse_col_indices": cols,
    }


def test_json_answers_carry_both_tensors_in_the_requests_layout(api: Api) -> None:
    n = len(SEQ) - 1
    rows = [[-1, -1] for _ in range(n)]
    rows[2] = [SEQ[3], 11]
    body = sample_body(
        SEQ,
        prompt_logprobs=True,
        target_prompt_logprobs=sparse_body(rows),
        prompt_alt_tokens_k=3,
    )
    out = api.run("asample", body)
    target = out["target_prompt_logprobs"]
    assert target["dtype"] == "float32" and target["shape"] == [n, 2]
    assert (target["sparse_crow_indices"], target["sparse_col_indices"]) == (
        [0, 0, 0, 2, 2, 2, 2, 2],
        [0, 1],
    )
    assert target["data"][0] == pytest.approx(out["prompt_logprobs"][3], abs=1e-6)
    alt = out["prompt_alt_tokens"]
    assert alt["tokens"]["shape"] == alt["logprobs"]["shape"] == [n, 3]
    assert alt["tokens"]["dtype"] == "int64" and alt["logprobs"]["dtype"] == "float32"
    assert len(alt["tokens"]["data"]) == len(alt["logprobs"]["data"]) == 3 * n

    dense_rows = [[SEQ[i + 1], -1] for i in range(n)]
    out = api.run(
        "asample",
        sample_body(
            SEQ,
            prompt_logprobs=True,
            target_prompt_logprobs={
                "data": [v for row in dense_rows for v in row],
                "dtype": "int64",
                "shape": [n, 2],
            },
        ),
    )
    target = out["target_prompt_logprobs"]
    assert "sparse_crow_indices" not in target and target["shape"] == [n, 2]
    assert target["data"][0::2] == pytest.approx(out["prompt_logprobs"][1:], abs=1e-6)
    assert target["data"][1::2] == [0.0] * n
    assert "prompt_alt_tokens" not in out


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (
            {"target_prompt_logprobs": {"data": [1] * 8, "dtype": "int64", "shape": [8, 1]}},
            "7 rows",
        ),
        (
            {"target_prompt_logprobs": {"data": [-1] * 7, "dtype": "int64", "shape": [7, 1]}},
            "no id",
        ),
        (
            {"target_prompt_logprobs": {"data": [1] * 7 * 65, "dtype": "int64", "shape": [7, 65]}},
            "at most 64",
        ),
        (
            {"target_prompt_logprobs": {"data": [1.0] * 7, "dtype": "float32", "shape": [7, 1]}},
            "int64",
        ),
        ({"target_prompt_logprobs": {"data": [-3] * 7, "dtype": "int64", "shape": [7, 1]}}, "-3"),
        ({"prompt_alt_tokens_k": 21}, "prompt_alt_tokens_k must be in 0..20"),
        ({"prompt_alt_tokens_k": -1}, "prompt_alt_tokens_k"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 8}, "1..len(prompt)-1"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 0}, "1..len(prompt)-1"),
        ({"prompt_logprobs_last_n": 2, "topk_prompt_logprobs": 2}, "needs prompt_logprobs"),
    ],
)
def test_bad_prompt_score_requests_are_a_400_naming_the_field(
    api: Api, extra: dict[str, Any], why: str
) -> None:
    answer = api.post("asample", sample_body(SEQ, **extra), status=400)
    assert why in answer["error"]
    name = next(k for k in extra if k != "prompt_logprobs" and k != "topk_prompt_logprobs")
    assert name in answer["error"]


def test_out_of_vocabulary_target_ids_fail_the_future_as_the_users(api: Api) -> None:
    n = len(SEQ) - 1
    rows = {"data": [600] * n, "dtype": "int64", "shape": [n, 1]}  # the toy vocab: 0..511
    body = sample_body(SEQ, target_prompt_logprobs=rows)
    answer = api.result(api.post("asample", body)["request_id"])
    assert answer["category"] == "user" and "target_prompt_logprobs" in answer["error"]


# --- the protobuf answer, as the SDK decodes it ---------------------------------------------


def test_the_protobuf_answer_decodes_to_the_sdks_tensors() -> None:
    sequence = SampledSequence([1, 2], [-0.5, -0.25], "length")
    sparse = PromptTable((3, 2), [-1.5, -2.5, -3.5], (0, 1, 1, 3), (1, 0, 1))
    alt = PromptAltTokens(2, [[4, 5], [6, 7], [8, 9]], [[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]])
    raw = codec.sample_response_proto(TinkerSampleResult([sequence], None, None, sparse, alt))
    out = deserialize_sample_response(raw)
    assert out.target_prompt_logprobs is not None
    assert out.target_prompt_logprobs.to_numpy().tolist() == [
        [0.0, -1.5],
        [0.0, 0.0],
        [-2.5, -3.5],
    ]
    assert out.target_prompt_logprobs.sparse_crow_indices == [0, 1, 1, 3]
    assert out.prompt_alt_tokens is not None
    assert out.prompt_alt_tokens.tokens.dtype == "int64"
    assert out.prompt_alt_tokens.tokens.to_numpy().tolist() == alt.tokens
    assert out.prompt_alt_tokens.logprobs.to_numpy().tolist() == alt.logprobs

    table = PromptTable((2, 2), [-1.0, 0.0, 0.0, -2.0])
    empty = PromptAltTokens(3, [], [])  # a one-token prompt: no position to draw at
    out = deserialize_sample_response(
        codec.sample_response_proto(TinkerSampleResult([sequence], None, None, table, empty))
    )
    assert out.target_prompt_logprobs is not None
    assert out.target_prompt_logprobs.sparse_crow_indices is None
    assert out.target_prompt_logprobs.to_numpy().tolist() == [[-1.0, 0.0], [0.0, -2.0]]
    assert out.prompt_alt_tokens is not None
    assert out.prompt_alt_tokens.tokens.to_numpy().shape == (0, 3)
    plain = deserialize_sample_response(codec.sample_response_proto(TinkerSampleResult([sequence])))
    assert plain.target_prompt_logprobs is None and plain.prompt_alt_tokens is None
