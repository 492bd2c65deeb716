"""The compiled CPU decode kernels agree with the PyTorch ops they replace."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

from adapters.torch.cpu.fused_decode import (
    FusedDecodeLayer,
    KernelGatedMLP,
    KernelRMSNorm,
    PackedLinear,
)
from adapters.torch.cpu.kernels import cpu_kernels
from adapters.torch.loading.loader import load_model
from adapters.torch.models.attention_backend import SDPA, CpuBf16Attention
from adapters.torch.models.config import RopeConfig
from adapters.torch.models.layers import (
    Attention,
    PagedBatch,
    RMSNorm,
    RotaryTable,
    apply_rope,
    gelu_tanh,
)
from adapters.torch.models.paged_kv import PagedKVCache, write_index
from tests.support.paged_forward import PagedSequence
from tests.support.tiny_models import save_tiny_model

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no AVX512-BF16 or no C++ toolchain")
BF16 = torch.bfloat16


@pytest.mark.parametrize(
    ("rows", "n_out", "k_in"),
    [
        (1, 1001, 576),
        (5, 960, 576),
        (6, 64, 32),
        (7, 1001, 576),
        (64, 130, 1536),
        (700, 96, 576),
        (13, 70, 4608),  # a long K, taken in parts
    ],
)
def test_gemm_packed_matches_a_float32_matmul_within_bf16_rounding(
    rows: int, n_out: int, k_in: int
) -> None:
    # Row counts around the 6-row tile, output widths off the 64-column panel, an input split
    # into row blocks (700 x 576 bf16 > 256 KiB), a K long enough to be taken in parts: each
    # output is a float32 dot product rounded once to bf16.
    torch.manual_seed(rows)
    w = torch.randn(n_out, k_in, dtype=BF16)
    x = torch.randn(rows, 1, k_in, dtype=BF16)
    panels = kernels.pack_panels(w)
    assert panels.shape == ((n_out + 63) // 64, k_in // 2, 64, 2)
    y = kernels.gemm_packed(x, panels, n_out)
    assert y.shape == (rows, 1, n_out) and y.dtype == BF16
    assert_close(y, (x.float() @ w.float().T).to(BF16), atol=0.05, rtol=1e-2)


def test_packed_linear_takes_strided_inputs_and_adds_its_bias() -> None:
    torch.manual_seed(3)
    linear = nn.Linear(576, 200, bias=True).to(BF16)
    x = torch.randn(576, 4, dtype=BF16).T  # not contiguous
    assert_close(PackedLinear(linear, kernels)(x), linear(x), atol=0.05, rtol=1e-2)


@pytest.mark.parametrize(
    ("x_shape", "table_rows"),
    [((1, 7, 12, 64), 1), ((5, 1, 12, 64), 5), ((2, 3, 5, 256), 1), ((1, 4, 6, 32), 1)],
)
def test_rope_kernel_matches_apply_rope(x_shape: tuple[int, ...], table_rows: int) -> None:
    # qk is a strided view (queries and keys of a fused projection, values beside them); the
    # tables are one row per token ([1, T, 1, D]) or per batch row ([B, 1, 1, D]).
    torch.manual_seed(5)
    batch, tokens, heads, dim = x_shape
    qkv = torch.randn(batch, tokens, heads + 2, dim, dtype=BF16)
    qk = qkv[:, :, :heads]
    table = RotaryTable(RopeConfig(theta=10000.0), dim, 64, BF16, "cpu")
    positions = torch.randint(0, 64, (table_rows * tokens,))
    cos = table.cos[positions].view(table_rows, tokens, 1, dim)
    sin = table.sin[positions].view(table_rows, tokens, 1, dim)
    got = kernels.rope(qk, cos, sin)
    assert got.is_contiguous()
    assert_close(got, apply_rope(qk, cos, sin), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize(("rows", "dim"), [(15, 576), (40, 100)])  # 100: a tail past 6 x 16
def test_rms_norm_matches_the_module(unit_offset: bool, rows: int, dim: int) -> None:
    torch.manual_seed(1)
    norm = RMSNorm(dim, 1e-5, unit_offset=unit_offset).to(BF16)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(rows // 5, 5, dim, dtype=BF16)
    assert_close(kernels.rms_norm(x, norm.weight, norm.eps, unit_offset), norm(x))


def test_silu_mul_matches_the_pytorch_ops() -> None:
    torch.manual_seed(2)
    gate_up = torch.randn(4, 2 * 1536, dtype=BF16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up)


def _reference_attention(
    q: Tensor, k: Tensor, v: Tensor, lengths: list[int], window: int
) -> Tensor:
    """SDPA in float32, one query at a time over its own keys (causal, sliding window)."""
    batch, _, queries, _ = q.shape
    out = torch.empty(q.shape, dtype=torch.float32)
    for b in range(batch):
        length = lengths[b if len(lengths) > 1 else 0]
        for t in range(queries):
            end = length - queries + t + 1
            start = max(0, end - window) if window else 0
            kb, vb = k[b : b + 1, :, start:end].float(), v[b : b + 1, :, start:end].float()
            qt = q[b : b + 1, :, t : t + 1].float()
            out[b : b + 1, :, t : t + 1] = F.scaled_dot_product_attention(
                qt, kb, vb, scale=0.1, enable_gqa=True
            )
    return out.to(BF16)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "batch", "queries", "lengths", "window"),
    [
        (9, 3, 64, 1, 1, [37], 0),  # a one-query chunk (the last token of a cached prompt)
        (9, 3, 64, 4, 1, [37, 1, 20, 64], 0),  # one-query chunks at different positions
        (4, 1, 256, 2, 1, [5, 3], 0),
        (8, 8, 32, 3, 1, [40, 2, 9], 6),  # sliding window
        (9, 3, 64, 1, 20, [20], 0),  # a prompt
        (9, 3, 64, 1, 7, [30], 0),  # a prompt chunk after 23 cached positions
        (4, 2, 32, 1, 12, [25], 5),  # a prompt chunk under a sliding window
        (4, 4, 32, 2, 3, [9], 0),  # two rows of one length, given once
        (12, 2, 64, 1, 40, [77], 0),  # a prompt chunk, groups of 6 heads, several key blocks
        (4, 1, 256, 1, 33, [50], 0),
        (9, 3, 64, 2, 19, [45, 19], 13),  # two rows' chunks, a window off the key blocks
        # Prompt tiles: 8 heads per KV head (rows split 6 + 2), 5 (one query per tile, under a
        # window), 1 (six queries per tile, the last tile partial)
        (8, 1, 64, 1, 21, [40], 0),
        (10, 2, 64, 1, 9, [30], 7),
        (4, 4, 32, 1, 17, [50], 0),
        # One query over many keys (the decode rows' pieces are paged_attention's, below)
        (4, 1, 256, 1, 1, [700], 0),  # Gemma's single KV head
        (9, 3, 64, 1, 1, [300], 0),
        (8, 1, 64, 1, 1, [600], 300),
        (4, 1, 64, 2, 1, [500, 1], 0),
    ],
)
def test_prompt_attention_kernel_matches_sdpa(
    heads: int, kv_heads: int, dim: int, batch: int, queries: int, lengths: list[int], window: int
) -> None:
    torch.manual_seed(3)
    longest = max(lengths)
    q = torch.randn(batch, queries, heads, dim, dtype=BF16).transpose(1, 2)  # as in Attention
    cache = torch.randn(2, batch + 1, kv_heads, longest + 8, dim, dtype=BF16)  # views, as a cache
    k, v = cache[0, :batch, :, :longest], cache[1, :batch, :, :longest]
    got = kernels.prompt_attention(q, k, v, torch.tensor(lengths), window, 0.1)
    assert got.shape == q.shape
    assert_close(got, _reference_attention(q, k, v, lengths, window), atol=2e-2, rtol=2e-2)
    if len(lengths) == 1 and batch == 1:  # no lengths: every key
        empty = torch.empty(0, dtype=torch.long)
        every = kernels.prompt_attention(q, k, v, empty, window, 0.1)
        assert torch.equal(every, got)


@pytest.mark.parametrize("queries", [1, 21])
def test_attention_never_reads_the_cache_past_a_rows_length(queries: int) -> None:
    # Positions past a row's length hold anything (an uninitialized cache): NaN must not leak
    # through a key block or a pair of value rows that straddles the end.
    torch.manual_seed(4)
    q = torch.randn(1, queries, 9, 64, dtype=BF16).transpose(1, 2)
    k, v = torch.randn(2, 1, 3, 64, 64, dtype=BF16)
    k[:, :, 37:], v[:, :, 37:] = float("nan"), float("nan")
    got = kernels.prompt_attention(q, k, v, torch.tensor([37]), 0, 0.1)
    assert not got.isnan().any()
    assert_close(got, _reference_attention(q, k, v, [37], 0), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [0, 20])
def test_prompt_attention_rounds_one_query_as_it_rounds_among_others(window: int) -> None:
    """A prompt chunk of one query (the last token of a cached prompt) through
    ``prompt_attention`` gives what that query gives inside a longer chunk, bit for bit; the
    decode rows' path (``paged_attention``) rounds P @ V differently."""
    torch.manual_seed(7)
    q = torch.randn(1, 5, 9, 64, dtype=BF16).transpose(1, 2)  # queries at positions 33..37
    k, v = torch.randn(2, 1, 3, 38, 64, dtype=BF16)
    chunk = kernels.prompt_attention(q, k, v, torch.tensor([38]), window, 0.1)
    for t in range(5):
        end = 34 + t
        one = kernels.prompt_attention(
            q[:, :, t : t + 1], k[:, :, :end], v[:, :, :end], torch.tensor([end]), window, 0.1
        )
        assert torch.equal(one[:, :, 0], chunk[:, :, t])
    if window == 0:  # the decode rows' path (a pool of one block): the same up to rounding
        pool_k, pool_v = k[:, :, :34].contiguous(), v[:, :, :34].contiguous()
        table = torch.zeros(1, 1, dtype=torch.int32)
        decode = kernels.paged_attention(
            q[:, :, :1].contiguous(), pool_k, pool_v, table, torch.tensor([34]), 0, 0.1
        )
        assert_close(decode, chunk[:, :, :1], atol=2e-2, rtol=2e-2)


def _scattered_pool(
    lengths: list[int], kv_heads: int, dim: int, block: int, seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Rows' keys and values ``[R, Hkv, max(lengths), D]`` (NaN past each row's length, as
    an uninitialized cache) and the same keys scattered over a NaN-filled pool through
    shuffled block tables: (k, v, k_pool, v_pool, tables)."""
    gen = torch.Generator().manual_seed(seed)
    longest, rows = max(lengths), len(lengths)
    k = torch.randn(rows, kv_heads, longest, dim, generator=gen).to(BF16)
    v = torch.randn(rows, kv_heads, longest, dim, generator=gen).to(BF16)
    for r, n in enumerate(lengths):
        k[r, :, n:], v[r, :, n:] = float("nan"), float("nan")
    per_row = -(-longest // block)
    order = torch.randperm(rows * per_row + 3, generator=gen)  # 3 blocks no row uses
    tables = order[: rows * per_row].view(rows, per_row).to(torch.int32)
    k_pool = torch.full((len(order), kv_heads, block, dim), float("nan"), dtype=BF16)
    v_pool = k_pool.clone()
    for r in range(rows):
        for b in range(per_row):
            part = slice(b * block, min(longest, (b + 1) * block))
            size = part.stop - part.start
            k_pool[tables[r, b], :, :size] = k[r, :, part]
            v_pool[tables[r, b], :, :size] = v[r, :, part]
    return k, v, k_pool, v_pool, tables


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "lengths", "window", "block"),
    [
        (9, 3, 64, [37, 1, 16, 300, 5], 0, 16),  # SmolLM2's heads, rows shorter than a block
        (4, 1, 256, [700], 0, 16),  # one long row, split in pieces (flash decoding)
        (8, 2, 64, [700, 33], 300, 16),  # a sliding window starting mid-block
        (6, 2, 96, [40, 17, 64, 9] * 9, 24, 8),  # many rows, a 32-column tail, blocks of 8
    ],
)
def test_paged_attention_through_scattered_tables_equals_blocks_in_order_bit_for_bit(
    heads: int, kv_heads: int, dim: int, lengths: list[int], window: int, block: int
) -> None:
    """Through shuffled block tables the decode rows compute what they compute over each
    row's blocks in order (scores, softmax, P @ V in the same order), never reading a
    position past a row's length (NaN there) or a block outside its table; and what SDPA
    computes, up to bf16 rounding."""
    k, v, k_pool, v_pool, tables = _scattered_pool(lengths, kv_heads, dim, block, seed=5)
    q = torch.randn(len(lengths), heads, 1, dim, dtype=BF16)
    lens = torch.tensor(lengths)
    got = kernels.paged_attention(q, k_pool, v_pool, tables, lens, window, 0.1)
    assert got.shape == q.shape and not got.isnan().any()
    rows, per_row = tables.shape
    pad = per_row * block - k.shape[2]
    in_order = [
        F.pad(t, (0, 0, 0, pad), value=float("nan"))
        .view(rows, kv_heads, per_row, block, dim)
        .transpose(1, 2)
        .reshape(rows * per_row, kv_heads, block, dim)
        .contiguous()
        for t in (k, v)
    ]
    ordered = torch.arange(rows * per_row, dtype=torch.int32).view(rows, per_row)
    assert torch.equal(got, kernels.paged_attention(q, *in_order, ordered, lens, window, 0.1))
    clean = [torch.nan_to_num(t) for t in (k, v)]
    assert_close(got, _reference_attention(q, *clean, lengths, window), atol=2e-2, rtol=2e-2)


def test_paged_attention_refuses_rows_past_their_tables_and_blocks_outside_the_pool() -> None:
    _, _, k_pool, v_pool, tables = _scattered_pool([20, 5], 2, 32, 16, seed=6)
    q = torch.randn(2, 4, 1, 32, dtype=BF16)
    with pytest.raises(RuntimeError, match="past its table"):
        kernels.paged_attention(q, k_pool, v_pool, tables, torch.tensor([33, 5]), 0, 0.2)
    tables[1, 0] = k_pool.shape[0]
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.paged_attention(q, k_pool, v_pool, tables, torch.tensor([20, 5]), 0, 0.2)
    with pytest.raises(RuntimeError, match="int32"):
        kernels.paged_attention(q, k_pool, v_pool, tables.long(), torch.tensor([20, 5]), 0, 0.2)


def test_write_pool_puts_each_head_at_its_write_index() -> None:
    pool = torch.zeros(4, 3, 8, 32, dtype=BF16)
    new = torch.randn(2, 1, 3, 32, dtype=BF16).transpose(1, 2)  # [R, Hkv, 1, D], strided
    slots = torch.tensor([8 * 2 + 5, 0])  # row 0: block 2, offset 5; row 1: block 0, offset 0
    index = write_index(slots, 3, 8)
    kernels.write_pool(pool, new, index)
    expected = torch.zeros_like(pool)
    expected.view(-1, 32).index_copy_(0, index, new.reshape(-1, 32))
    assert torch.equal(pool, expected) and torch.equal(pool[2, :, 5], new[0, :, 0])
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.write_pool(pool, new, index + pool.numel() // 32)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_attention_with_the_kernel_matches_sdpa_in_the_model(arch: str, tmp_path: Path) -> None:
    """Decode rows at different positions and a prompt chunk after cached positions (beyond
    Gemma's sliding window too), through the model."""
    save_tiny_model(arch, tmp_path)
    model = load_model(tmp_path, dtype=BF16)
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    assert all(isinstance(a.backend, CpuBf16Attention) for a in attention)
    cache = PagedKVCache(model.config, 8, 16, dtype=BF16, device="cpu")
    tables = [[5, 0], [3], [6]]
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [3], [40, 41, 42, 43]]
    with torch.inference_mode():
        _prefill(model, cache, tables, prompts)
        # One step: decode rows for sequences 1 and 2 and a prompt chunk of 7 tokens for
        # sequence 0 after its 10 positions (beyond the sliding window).
        tokens = torch.tensor([2, 3, 20, 21, 22, 23, 24, 25, 26])
        sample_rows = torch.tensor([0, 1, 8])

        def step() -> Tensor:
            rows = [(tables[1], 1), (tables[2], 4)]
            batch = PagedBatch(cache, rows, [(tables[0], 10, 7)], model.windows(), tokens.device)
            return model.forward_mixed(tokens, batch, sample_rows)

        fast = step()
        for a in attention:
            a.backend = SDPA
        slow = step()
    assert fast.shape == (3, model.config.vocab_size)
    assert_close(fast, slow, atol=0.05, rtol=0.02)


def _prefill(
    model: nn.Module, cache: PagedKVCache, tables: list[list[int]], prompts: list[list[int]]
) -> None:
    """Every prompt from position 0 into its blocks, in one step."""
    tokens = torch.tensor([t for p in prompts for t in p])
    chunks = [(table, 0, len(p)) for table, p in zip(tables, prompts, strict=True)]
    batch = PagedBatch(cache, [], chunks, model.windows(), torch.device("cpu"))
    model.forward_mixed(tokens, batch, torch.arange(len(tokens)))


def test_argmax_rows_matches_torch_including_ties() -> None:
    torch.manual_seed(4)
    logits = torch.randn(5, 49157, dtype=BF16)  # a vocabulary that is not a multiple of 16
    logits[1, 100] = logits[1, 40000] = 50.0  # a tie: the first index wins
    logits[2, -1] = 60.0  # the maximum in the scalar tail
    logits[3] = -float("inf")
    got = kernels.argmax_rows(logits)
    assert got.tolist() == logits.float().argmax(dim=-1).tolist()
    assert got[1] == 100 and got[2] == 49156


def test_an_optimized_model_decodes_like_the_plain_bf16_model(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path)
    fast = load_model(tmp_path, dtype=BF16)
    plain = load_model(tmp_path, dtype=BF16, prepack=False)
    kinds = {type(m) for m in fast.modules()}
    assert {PackedLinear, KernelRMSNorm, KernelGatedMLP} <= kinds
    ids = [3, 14, 15, 92, 65]
    seqs = [PagedSequence(model, 8) for model in (fast, plain)]
    with torch.inference_mode():
        assert_close(seqs[0].prefill(ids), seqs[1].prefill(ids), atol=0.05, rtol=0.02)
        # one row: the GEMV path
        assert_close(seqs[0].decode(7), seqs[1].decode(7), atol=0.05, rtol=0.02)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {"head_dim": 32, "intermediate_size": 96}),
        ("qwen3", {}),  # QK-norm
        ("gemma3", {}),  # (1 + w) norms around attention and MLP, tanh-GELU, sliding window
    ],
)
def test_the_fused_decode_layer_gives_the_modules_results_bit_for_bit(
    arch: str, overrides: dict, tmp_path: Path
) -> None:
    """Blocks run decode rows as one kernel call (``decode_layer_paged``): for a single
    sequence and for engine steps over the paged pool (decode rows at their own positions,
    past Gemma's sliding window too) the logits are identical to the modules' path. Steps
    with prompt chunks take the modules' path."""
    save_tiny_model(arch, tmp_path, **overrides)
    model = load_model(tmp_path, dtype=BF16)
    blocks = list(model.layers)
    assert blocks and all(isinstance(b.decode_kernel, FusedDecodeLayer) for b in blocks)
    fused = [b.decode_kernel for b in blocks]

    def both(run):  # run() with the fused layers, then with the modules
        results = []
        for kernel in (fused, [None] * len(blocks)):
            for block, k in zip(blocks, kernel, strict=True):
                block.decode_kernel = k
            results.append(run())
        return results

    def generate() -> Tensor:
        seq = PagedSequence(model, 16)
        logits = [seq.prefill([3, 14, 15, 92, 65])[-1:]]
        for token in (7, 8, 9, 10, 11):
            logits.append(seq.decode(token)[None])
        return torch.cat(logits)

    def engine_steps() -> Tensor:
        cache = PagedKVCache(model.config, 8, 16, dtype=BF16, device="cpu")
        tables = [[4], [1], [6]]
        _prefill(model, cache, tables, [[5, 6, 7, 8, 9, 10, 11], [3], [40, 41, 42, 43]])
        logits, cpu = [], torch.device("cpu")
        for step, positions in enumerate(([7, 1, 4], [8, 2, 5])):  # decode rows only
            batch = PagedBatch(
                cache, list(zip(tables, positions, strict=True)), [], model.windows(), cpu
            )
            tokens = torch.tensor([20 + step, 30 + step, 40 + step])
            logits.append(model.forward_mixed(tokens, batch, torch.arange(3)))
        # decode rows and a prompt chunk
        rows = [(tables[0], 9), (tables[1], 3)]
        batch = PagedBatch(cache, rows, [(tables[2], 6, 3)], model.windows(), cpu)
        tokens = torch.tensor([50, 51, 52, 53, 54])
        logits.append(model.forward_mixed(tokens, batch, torch.tensor([0, 1, 4])))
        return torch.cat(logits)

    with torch.inference_mode():
        for run in (generate, engine_steps):
            with_kernel, with_modules = both(run)
            assert torch.equal(with_kernel, with_modules)
    assert with_kernel.shape == (9, model.config.vocab_size)


def test_the_fused_decode_layer_is_left_out_where_it_does_not_apply(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path)  # head_dim 16: no attention kernel, the modules' path
    model = load_model(tmp_path, dtype=BF16)
    assert all(b.decode_kernel is None for b in model.layers)


def test_gelu_tanh_mul_matches_the_pytorch_ops() -> None:
    torch.manual_seed(3)
    gate_up = torch.randn(5, 2 * 1000, dtype=BF16) * 4  # 1000: a tail past 62 x 16
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close(kernels.gelu_tanh_mul(gate_up), gelu_tanh(gate) * up)
