"""The fused decode layer over quantized weights (adapters/torch/cpu/quant_decode.py, the
portable ``quant_decode_layer``) computes what the block's modules compute over the paged
pool (engine steps of several rows, and one sequence decoding alone), every family, int8
and int4, float32 and bfloat16; it steps aside for prompt chunks and for rows with a LoRA
adapter."""

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from adapters.torch.cpu.kernels import cpu_kernels
from adapters.torch.cpu.portable import portable_kernels
from adapters.torch.cpu.quant_decode import (
    QuantDecodeLayer,
    QuantDecodeStack,
    install_quant_decode,
)
from adapters.torch.loading.loader import load_model
from adapters.torch.lora.serving import LoraServing
from adapters.torch.models.layers import PagedBatch
from adapters.torch.models.transformer import Transformer
from adapters.torch.quant import keep_panels
from tests.support.paged_forward import PagedSequence, Pool, paged_step, rand_ids
from tests.support.tiny_models import save_tiny_model

pytestmark = pytest.mark.skipif(portable_kernels() is None, reason="no C++ toolchain")

# The two paths quantize slightly different activations (their norms round apart by an ulp),
# so an integer-path rounding may differ: close, not equal.
TOL = {torch.float32: {"atol": 2e-3, "rtol": 2e-3}, torch.bfloat16: {"atol": 6e-2, "rtol": 6e-2}}


def _model(family: str, method: str, dtype: torch.dtype, folder: Path) -> Transformer:
    save_tiny_model(family, folder)
    return load_model(folder, dtype=dtype, quantization=method)


def _fused(model: Transformer) -> list:
    return [block.decode_kernel for block in model.layers]


def _set(model: Transformer, kernels: list) -> None:
    for block, kernel in zip(model.layers, kernels, strict=True):
        block.decode_kernel = kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_decode_rows_over_the_pool_equal_the_modules(
    family: str, method: str, dtype: torch.dtype, tmp_path: Path
) -> None:
    model = _model(family, method, dtype, tmp_path)
    fused = _fused(model)
    assert all(isinstance(k, QuantDecodeLayer) for k in fused)
    # bfloat16 on an AVX512-BF16 CPU: that build's paged attention (used for head_dim 32:
    # qwen3 and gemma3 here), else the portable one (llama's head_dim 16, float32)
    avx512 = dtype == torch.bfloat16 and cpu_kernels() is not None
    assert all(k.bf16_attention == avx512 for k in fused)
    pool = Pool(model)
    pool.cache = type(pool.cache)(model.config, 40, 4, dtype=dtype, device="cpu")
    seqs = [rand_ids(13, 1), rand_ids(3, 2), rand_ids(9, 3)]  # 13 + 2 is past Gemma's window of 6
    tables = [pool.grow([], len(s) + 2) for s in seqs]
    with torch.inference_mode():
        paged_step(model, pool.cache, [], [(t, 0, s) for t, s in zip(tables, seqs, strict=True)])
        for step in range(2):  # two steps: the second reads what the first one wrote
            pairs = enumerate(zip(tables, seqs, strict=True))
            rows = [(t, len(s) + step, 7 + i) for i, (t, s) in pairs]
            fast = paged_step(model, pool.cache, rows, [])
            k_fast = pool.cache.k.clone()
            _set(model, [None] * len(fused))
            slow = paged_step(model, pool.cache, rows, [])
            _set(model, fused)
            assert_close(fast, slow, **TOL[dtype])
            assert_close(pool.cache.k, k_fast, **TOL[dtype])  # same keys written, same slots
    assert torch.equal(fast.argmax(-1), slow.argmax(-1))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_one_sequence_decoding_alone_equals_the_modules(family: str, tmp_path: Path) -> None:
    """What ``generate()`` runs: one sequence's prompt, then its decode rows one at a time
    (the contiguous cache this replaced was its path before)."""
    model = _model(family, "int4", torch.float32, tmp_path)
    fused = _fused(model)
    ids = rand_ids(9, 4)
    logits = {}
    for name, kernels in (("fast", fused), ("slow", [None] * len(fused))):
        _set(model, kernels)
        seq = PagedSequence(model, 32, block_size=4)
        with torch.inference_mode():
            out = [seq.prefill(ids)[-1]]
            for token in (5, 77, 300):  # 9 + 3 positions: past Gemma's window of 6
                out.append(seq.decode(token))
        logits[name] = torch.stack(out)
    assert_close(logits["fast"], logits["slow"], **TOL[torch.float32])


def test_prompt_chunks_and_lora_rows_take_the_modules(tmp_path: Path) -> None:
    model = _model("llama", "int8", torch.float32, tmp_path)
    model.decode_stack = None  # the layers one by one (the stack: below)
    calls: list[bool] = []
    for block in model.layers:
        kernel = block.decode_kernel
        assert kernel is not None

        def counted(x, rope, rows, kernel=kernel):
            y = kernel(x, rope, rows)
            calls.append(y is not None)
            return y

        block.decode_kernel = counted
    pool = Pool(model)
    table = pool.grow([], 8)
    with torch.inference_mode():
        paged_step(model, pool.cache, [], [(table, 0, rand_ids(6, 1))])
        assert calls == []  # a prompt chunk: no decode rows
        paged_step(model, pool.cache, [(table, 6, 3)], [])
        assert calls == [True] * len(model.layers)
        calls.clear()
        lora = LoraServing(model)  # wraps every linear: no adapter on the rows, still fused
        paged_step(model, pool.cache, [(table, 6, 3)], [])
        assert calls == [True] * len(model.layers)
        calls.clear()
        site = lora.sites["layers.1.attn.wo"]
        site.routes = [(torch.tensor([0]), torch.zeros(4, 64), torch.zeros(64, 4))]
        paged_step(model, pool.cache, [(table, 6, 3)], [])
        assert calls == [True, False, True]  # layer 1's rows use an adapter: its modules run


def test_dense_models_get_no_fused_quantized_layer(tmp_path: Path) -> None:
    save_tiny_model("qwen3", tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    assert install_quant_decode(model) == 0
    assert all(block.decode_kernel is None for block in model.layers)


def test_the_op_rejects_a_write_outside_the_pool(tmp_path: Path) -> None:
    model = _model("llama", "int8", torch.float32, tmp_path)
    block = model.layers[0]
    kernel = block.decode_kernel
    assert isinstance(kernel, QuantDecodeLayer)
    seq = PagedSequence(model, 8, block_size=4)
    batch = PagedBatch(seq.cache, [(seq.table, 1)], [], model.windows(), torch.device("cpu"))
    paged = batch.view(False).decode_rows(0)
    assert paged is not None
    bad = paged.write_index + 10_000
    cos, sin = model.rope[False].at(0, 1)
    quantized = kernel.linears()
    assert quantized is not None
    linears, meta = kernel._arguments(quantized, 0)
    with pytest.raises(RuntimeError, match="write_index out of the pool"):
        portable_kernels().quant_decode_layer(
            torch.zeros(1, 64),
            kernel.norms,
            linears,
            meta,
            paged.k_pool,
            paged.v_pool,
            bad,
            paged.tables,
            paged.lengths,
            cos,
            sin,
            kernel.scale,
            kernel.eps,
        )


@pytest.mark.skipif(cpu_kernels() is None, reason="no AVX512-BF16 kernels")
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_decode_rows_over_bf16_panels_equal_the_modules(family: str, tmp_path: Path) -> None:
    """From ``panels_from_rows`` rows the fused layer runs the AVX512-BF16 decode layer over
    the linears' bf16 panel copies (keep_panels); fewer rows stay on the quantized one."""
    model = _model(family, "int4", torch.bfloat16, tmp_path)
    model.decode_stack = None  # the layers one by one (the stack: below)
    assert keep_panels(model, {4: 3, 8: 3}, 1 << 30) > 0
    fused = _fused(model)
    pool = Pool(model)
    pool.cache = type(pool.cache)(model.config, 40, 4, dtype=torch.bfloat16, device="cpu")
    seqs = [rand_ids(13, 1), rand_ids(3, 2), rand_ids(9, 3)]
    tables = [pool.grow([], len(s) + 2) for s in seqs]
    calls: list[bool] = []
    for kernel in fused:
        kernel._panel_layer = _recorded(kernel._panel_layer, calls)
    with torch.inference_mode():
        paged_step(model, pool.cache, [], [(t, 0, s) for t, s in zip(tables, seqs, strict=True)])
        for step, count in ((0, 3), (1, 2)):  # 3 rows: the panels; 2: the quantized layer
            calls.clear()
            pairs = list(enumerate(zip(tables, seqs, strict=True)))[:count]
            rows = [(t, len(s) + step, 7 + i) for i, (t, s) in pairs]
            fast = paged_step(model, pool.cache, rows, [])
            assert calls == ([True] * len(fused) if count == 3 else [])
            _set(model, [None] * len(fused))
            slow = paged_step(model, pool.cache, rows, [])
            _set(model, fused)
            assert_close(fast, slow, **TOL[torch.bfloat16])
            assert torch.equal(fast.argmax(-1), slow.argmax(-1))


def _recorded(fn, calls: list[bool]):  # type: ignore[no-untyped-def]
    def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(True)
        return fn(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize(
    ("family", "dtype", "panels"),
    [
        ("llama", torch.float32, False),
        ("gemma3", torch.float32, False),  # sliding and global layers: two views
        ("qwen3", torch.bfloat16, False),
        ("qwen3", torch.bfloat16, True),
        ("gemma3", torch.bfloat16, True),
    ],
)
def test_the_stack_of_layers_computes_what_the_layers_compute(
    family: str, dtype: torch.dtype, panels: bool, tmp_path: Path
) -> None:
    """QuantDecodeStack runs every layer's decode rows in one call: the same ops, so the
    same bits as the layers called one by one; it steps aside as they would."""
    if panels and cpu_kernels() is None:
        pytest.skip("no AVX512-BF16 kernels")
    model = _model(family, "int4", dtype, tmp_path)
    stack = model.decode_stack
    assert isinstance(stack, QuantDecodeStack)
    if panels:
        assert keep_panels(model, {4: 3, 8: 3}, 1 << 30) > 0
    pool = Pool(model)
    pool.cache = type(pool.cache)(model.config, 40, 4, dtype=dtype, device="cpu")
    seqs = [rand_ids(13, 1), rand_ids(3, 2), rand_ids(9, 3)]
    tables = [pool.grow([], len(s) + 3) for s in seqs]
    with torch.inference_mode():
        paged_step(model, pool.cache, [], [(t, 0, s) for t, s in zip(tables, seqs, strict=True)])
        for step, count in ((0, 3), (1, 2), (2, 1)):
            pairs = list(enumerate(zip(tables, seqs, strict=True)))[:count]
            rows = [(t, len(s) + step, 7 + i) for i, (t, s) in pairs]
            keys = pool.cache.k.clone()
            stacked = paged_step(model, pool.cache, rows, [])
            k_stacked, pool.cache.k[:] = pool.cache.k.clone(), keys
            model.decode_stack = None
            layered = paged_step(model, pool.cache, rows, [])
            model.decode_stack = stack
            assert torch.equal(stacked, layered)
            assert torch.equal(pool.cache.k, k_stacked)
        calls: list[bool] = []
        run = stack.__call__

        def counted(*args):  # type: ignore[no-untyped-def]
            y = run(*args)
            calls.append(y is not None)
            return y

        model.decode_stack = counted
        paged_step(model, pool.cache, [], [(tables[0], 0, seqs[0])])  # a prompt chunk
        assert calls == [False]
        lora = LoraServing(model)
        site = lora.sites["layers.1.attn.wo"]
        base = site.base
        a, b = torch.zeros(4, base.in_features), torch.zeros(base.out_features, 4)
        site.routes = [(torch.tensor([0]), a.to(dtype), b.to(dtype))]
        paged_step(model, pool.cache, [(tables[0], len(seqs[0]), 7)], [])
        assert calls == [False, False]  # a layer's rows use an adapter: the layers run
