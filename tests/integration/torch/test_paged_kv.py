"""Attention through the paged KV cache equals the no-cache forward (fp32, every family)."""

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from adapters.torch.cpu.kernels import cpu_kernels
from adapters.torch.cpu.portable import install_paged_attention, portable_kernels
from adapters.torch.loading.loader import load_model
from adapters.torch.models.attention_backend import SDPA
from adapters.torch.models.layers import Attention
from adapters.torch.models.paged_kv import PagedKVCache, block_tables, gather, slot_mapping
from adapters.torch.models.transformer import Transformer
from tests.support.paged_forward import BLOCK, Pool, full_logits, paged_step, rand_ids
from tests.support.tiny_models import save_tiny_model

TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def model(request, tmp_path_factory) -> Transformer:
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_model(request.param, folder)
    return load_model(folder, dtype=torch.float32)


@torch.inference_mode()
def test_prefill_decode_rows_and_a_chunk_after_a_cached_prefix_equal_the_full_forward(
    model: Transformer,
) -> None:
    # Three sequences prefilled in one step (blocks handed out scrambled), then one step of
    # two decode rows at different lengths beside a 7-token chunk after sequence 0's 10
    # cached positions (past Gemma's sliding window of 6), then a decode step for all three.
    pool = Pool(model)
    seqs = [rand_ids(17, 1), rand_ids(3, 2), rand_ids(6, 3)]
    tables: list[list[int]] = [[], [], []]
    prompts = [(pool.grow(tables[0], 10), 0, seqs[0][:10])]
    prompts += [(pool.grow(tables[i], 2 if i == 1 else 5), 0, seqs[i][:-1]) for i in (1, 2)]
    logits = paged_step(model, pool.cache, [], prompts)
    assert_close(logits[:10], full_logits(model, seqs[0][:10]), **TOL)
    assert_close(logits[10:12], full_logits(model, seqs[1][:2]), **TOL)
    assert_close(logits[12:], full_logits(model, seqs[2][:5]), **TOL)

    rows = [(pool.grow(tables[1], 3), 2, seqs[1][2]), (pool.grow(tables[2], 6), 5, seqs[2][5])]
    logits = paged_step(model, pool.cache, rows, [(pool.grow(tables[0], 17), 10, seqs[0][10:])])
    assert_close(logits[0], full_logits(model, seqs[1])[-1], **TOL)
    assert_close(logits[1], full_logits(model, seqs[2])[-1], **TOL)
    assert_close(logits[2:], full_logits(model, seqs[0])[10:], **TOL)

    extra = [rand_ids(1, 10 + i)[0] for i in range(3)]
    rows = [(pool.grow(tables[i], len(seq) + 1), len(seq), extra[i]) for i, seq in enumerate(seqs)]
    logits = paged_step(model, pool.cache, rows, [])
    for i, seq in enumerate(seqs):
        assert_close(logits[i], full_logits(model, [*seq, extra[i]])[-1], **TOL)
    assert len({b for t in tables for b in t}) == sum(len(t) for t in tables)  # no sharing


@torch.inference_mode()
def test_a_copied_block_lets_a_sibling_diverge_from_a_shared_prefix(model: Transformer) -> None:
    # Two choices share a 9-token prompt's blocks; the last, partly filled block is copied
    # (copy-on-write) before each writes its own next token into it.
    pool = Pool(model, seed=1)
    prompt = rand_ids(9, 4)
    shared = pool.grow([], 9)
    paged_step(model, pool.cache, [], [(shared, 0, prompt)])
    sibling = [*shared[:-1], pool.free.pop()]
    pool.cache.copy_blocks([(shared[-1], sibling[-1])])
    a, b = rand_ids(2, 5)
    logits = paged_step(model, pool.cache, [(shared, 9, a), (sibling, 9, b)], [])
    assert_close(logits[0], full_logits(model, [*prompt, a])[-1], **TOL)
    assert_close(logits[1], full_logits(model, [*prompt, b])[-1], **TOL)
    # position 8 (offset 0) was copied; position 9 (offset 1) is each choice's own
    k = pool.cache.k
    assert torch.equal(k[:, shared[-1], :, 0], k[:, sibling[-1], :, 0])
    assert not torch.equal(k[:, shared[-1], :, 1], k[:, sibling[-1], :, 1])


def test_slot_mapping_and_gather_read_back_what_was_written_in_table_order() -> None:
    pool = torch.zeros(6, 2, BLOCK, 8)
    table = [4, 0, 5]
    slots = slot_mapping(table, 2, 9, BLOCK)
    assert slots == [18, 19, 0, 1, 2, 3, 20, 21, 22]
    written = torch.randn(9, 2, 8)
    blocks, offsets = torch.tensor(slots) // BLOCK, torch.tensor(slots) % BLOCK
    pool[blocks, :, offsets] = written
    got = gather(pool, block_tables([table, [1]], "cpu"), 11)
    assert got.shape == (2, 2, 11, 8)
    assert torch.equal(got[0, :, 2:].transpose(0, 1), written)
    assert block_tables([table, [1]], "cpu").tolist() == [[4, 0, 5], [1, 0, 0]]


kernels = cpu_kernels()
portable = portable_kernels()
# (the kernels module, dtype): the portable kernel wherever a compiler is, in float32 and
# bf16; the AVX512-BF16 one (csrc/avx512_bf16/attention.cpp) in bf16 where that CPU is.
PAGED_KERNELS = [
    pytest.param(portable, torch.float32, id="portable-fp32"),
    pytest.param(portable, torch.bfloat16, id="portable-bf16"),
    pytest.param(kernels, torch.bfloat16, id="avx512-bf16"),
]


@pytest.mark.parametrize(("impl", "dtype"), PAGED_KERNELS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "lengths", "window"),
    [
        (9, 3, 64, [37], 0),  # one row
        (9, 3, 64, [600], 0),  # one long row: split into pieces
        (9, 3, 64, [37, 1, 20, 64], 0),  # rows at different lengths
        (4, 1, 256, [5, 300], 0),
        (8, 8, 32, [40, 2, 9], 6),  # sliding window
        (15, 5, 64, [700], 100),  # a long row under a window
    ],
)
def test_the_paged_decode_kernel_equals_attention_over_the_gathered_blocks(
    impl: Any,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    dim: int,
    lengths: list[int],
    window: int,
) -> None:
    if impl is None:
        pytest.skip("no C++ toolchain, or (AVX512-BF16 kernels) not this CPU")
    torch.manual_seed(len(lengths) + dim)
    size, bf16 = 16, dtype
    blocks = [-(-n // size) for n in lengths]
    order = torch.randperm(sum(blocks) + 3).tolist()  # scrambled, a few blocks unused
    tables, at = [], 0
    for n in blocks:
        tables.append(order[at : at + n])
        at += n
    k_pool, v_pool = torch.randn(2, len(order), kv_heads, size, dim, dtype=bf16)
    tables_t = block_tables(tables, "cpu")
    lengths_t = torch.tensor(lengths)
    q = torch.randn(len(lengths), 1, heads, dim, dtype=bf16).transpose(1, 2)
    got = impl.paged_attention(q, k_pool, v_pool, tables_t, lengths_t, window, 0.1)
    assert got.shape == q.shape
    k, v = gather(k_pool, tables_t, max(lengths)), gather(v_pool, tables_t, max(lengths))
    expected = torch.empty(q.shape, dtype=torch.float32)
    for r, n in enumerate(lengths):
        start = max(0, n - window) if window else 0
        expected[r : r + 1] = F.scaled_dot_product_attention(
            q[r : r + 1].float(),
            k[r : r + 1, :, start:n].float(),
            v[r : r + 1, :, start:n].float(),
            scale=0.1,
            enable_gqa=True,
        )
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)
    if impl is kernels and portable is not None:  # the two builds' paged kernels agree
        other = portable.paged_attention(q, k_pool, v_pool, tables_t, lengths_t, window, 0.1)
        assert_close(got, other, atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(portable is None, reason="no C++ toolchain")
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_portable_paged_kernel_in_the_model_equals_the_gathered_path(
    family: str, tmp_path: Path
) -> None:
    save_tiny_model(family, tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    assert all(a.backend.name == "portable" for a in attention)  # installed by the loader
    assert install_paged_attention(model)  # idempotent: the same backend
    assert all(a.backend.name == "portable" for a in attention)
    pool = Pool(model)
    seqs = [rand_ids(13, 1), rand_ids(3, 2), rand_ids(9, 3)]  # 13 + 1 is past Gemma's window of 6
    tables = [pool.grow([], len(s) + 1) for s in seqs]
    with torch.inference_mode():
        paged_step(model, pool.cache, [], [(t, 0, s) for t, s in zip(tables, seqs, strict=True)])
        rows = [(t, len(s), 7 + i) for i, (t, s) in enumerate(zip(tables, seqs, strict=True))]
        fast = paged_step(model, pool.cache, rows, [])
        for a in attention:
            a.backend = SDPA
        slow = paged_step(model, pool.cache, rows, [])
    assert_close(fast, slow, **TOL)
    for i, seq in enumerate(seqs):
        assert_close(fast[i], full_logits(model, [*seq, 7 + i])[-1], **TOL)


@pytest.mark.skipif(
    kernels is None,
    reason="no AVX512-BF16 or no C++ toolchain",
)
def test_the_paged_kernel_in_the_model_equals_the_gathered_path(tmp_path: Path) -> None:
    save_tiny_model("gemma3", tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    assert all(a.backend.paged is not None for a in attention)
    pool = Pool(model)
    pool.cache = PagedKVCache(model.config, 40, BLOCK, dtype=torch.bfloat16, device="cpu")
    seqs = [rand_ids(13, 1), rand_ids(3, 2)]
    tables = [pool.grow([], 14), pool.grow([], 4)]
    with torch.inference_mode():
        paged_step(model, pool.cache, [], [(t, 0, s) for t, s in zip(tables, seqs, strict=True)])
        rows = [(tables[0], 13, 7), (tables[1], 3, 9)]
        fast = paged_step(model, pool.cache, rows, [])
        for a in attention:
            a.backend = SDPA
        slow = paged_step(model, pool.cache, rows, [])
    assert_close(fast, slow, atol=0.05, rtol=0.02)


@pytest.mark.skipif(portable is None, reason="no C++ toolchain")
def test_the_portable_kernel_never_reads_past_a_rows_length() -> None:
    """The runner leaves the pool uninitialized when decode rows read it through this
    kernel: positions past a row's length (the rest of its last block, unused blocks) hold
    NaN here and must not reach the output."""
    torch.manual_seed(3)
    k_pool = torch.full((6, 2, 16, 32), float("nan"))
    v_pool = torch.full((6, 2, 16, 32), float("nan"))
    tables = [[4, 1], [2]]
    lengths = [20, 5]
    for table, n in zip(tables, lengths, strict=True):
        for p in range(n):
            k_pool[table[p // 16], :, p % 16] = torch.randn(2, 32)
            v_pool[table[p // 16], :, p % 16] = torch.randn(2, 32)
    q = torch.randn(2, 4, 1, 32)
    got = portable.paged_attention(
        q, k_pool, v_pool, block_tables(tables, "cpu"), torch.tensor(lengths), 0, 0.2
    )
    assert torch.isfinite(got).all()
    with pytest.raises(RuntimeError, match="out of its table"):
        portable.paged_attention(
            q, k_pool, v_pool, block_tables(tables, "cpu"), torch.tensor([33, 5]), 0, 0.2
        )


@pytest.mark.parametrize("kernel_built", [True, False])
def test_the_runner_zeroes_the_pool_only_when_decode_rows_gather(
    kernel_built: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uninitialized only where every layer reads the pool through a paged kernel; where a
    layer gathers (no compiler), the padding it reads must be finite: zeros."""
    from adapters.torch.runtime import runner as runner_module
    from domain.config import EngineConfig

    if kernel_built and portable is None:
        pytest.skip("no C++ toolchain")
    if not kernel_built:  # as on a machine without a compiler
        monkeypatch.setattr("adapters.torch.cpu.portable.portable_kernels", lambda: None)
    made: list[bool] = []
    real = runner_module.PagedKVCache

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(kwargs["zeroed"])
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_module, "PagedKVCache", recording)
    save_tiny_model("llama", tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    runner = runner_module.TorchModelRunner(model, EngineConfig(max_num_seqs=2, max_model_len=64))
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    assert all((a.backend.paged is not None) == kernel_built for a in attention)
    assert made == [not kernel_built]
    if not kernel_built:
        assert not runner.cache.k.any() and not runner.cache.v.any()
