"""The decode step over static buffers (what a CUDA graph captures), on the CPU.

:class:`DecodeGraphs` without capture runs the same static-buffer forward eagerly: rows
padded to the captured size, their inputs copied in as one table, padding rows writing a
scratch block. Its logits must equal the eager paged step's, and the padding must leave
every sequence's KV as it was (the next step still equals the full forward)."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.testing import assert_close

from adapters.torch.cuda.graphs import DecodeGraphs, graph_sizes
from adapters.torch.loading.loader import load_model
from adapters.torch.models.attention_backend import PagedDecodeAttention
from adapters.torch.models.layers import Attention
from adapters.torch.models.paged_kv import PagedKVCache, gather
from adapters.torch.models.transformer import Transformer
from tests.support.paged_forward import full_logits, paged_step, rand_ids
from tests.support.tiny_models import save_tiny_model

TOL = {"atol": 1e-4, "rtol": 1e-4}
BLOCK, BLOCKS, MAX_BLOCKS = 4, 30, 8


def _reference_paged(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    tables: Tensor,
    lengths: Tensor,
    window: int,
    scale: float,
) -> Tensor:
    """The paged kernel's contract, row by row over gathered blocks (any int tables)."""
    out = torch.empty_like(q)
    for r in range(q.shape[0]):
        n = int(lengths[r])
        start = max(0, n - window) if window else 0
        table = tables[r : r + 1].int()
        k, v = gather(k_pool, table, n)[:, :, start:n], gather(v_pool, table, n)[:, :, start:n]
        out[r : r + 1] = F.scaled_dot_product_attention(
            q[r : r + 1], k, v, scale=scale, enable_gqa=True
        )
    return out


@pytest.fixture(params=["llama", "qwen3", "gemma3"])
def model(request, tmp_path: Path) -> Transformer:
    save_tiny_model(request.param, tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = PagedDecodeAttention(_reference_paged, "reference")
    return model


def test_graph_sizes_pad_to_the_next_captured_size() -> None:
    assert graph_sizes(1) == [1]
    assert graph_sizes(3) == [1, 2, 3]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_sizes(256)[-3:] == [224, 240, 256]
    assert graph_sizes(4096)[-1] == 512


@torch.inference_mode()
def test_static_decode_rows_equal_the_eager_step_and_padding_touches_no_sequence(
    model: Transformer,
) -> None:
    cache = PagedKVCache(model.config, BLOCKS + 1, BLOCK, dtype=torch.float32, device="cpu")
    graphs = DecodeGraphs(model, cache, 6, MAX_BLOCKS, scratch_block=BLOCKS, capture=False)
    assert graphs.sizes == [1, 2, 4, 6] and not graphs.graphs
    seqs = [rand_ids(13, 1), rand_ids(3, 2), rand_ids(9, 3)]  # 13 + 2 is past Gemma's window of 6
    order = list(range(BLOCKS))[::-1]  # blocks handed out high first, scrambled by sequence
    tables = [[order.pop() for _ in range(-(-(len(s) + 2) // BLOCK))] for s in seqs]
    paged_step(model, cache, [], [(t, 0, s) for t, s in zip(tables, seqs, strict=True)])
    for extra in (7, 8):  # two decode steps: 3 rows padded to 4
        tokens = [extra + i for i in range(3)]
        positions = [len(s) for s in seqs]
        before = cache.k.clone(), cache.v.clone()
        got = graphs.forward(tokens, tables, positions)
        assert got.shape == (3, model.config.vocab_size)
        assert cache.k[:, BLOCKS].any()  # the padding row wrote the scratch block
        # the step wrote the rows' KV; write it again the eager way and compare logits
        cache.k.copy_(before[0])
        cache.v.copy_(before[1])
        eager = paged_step(
            model, cache, [(t, p, x) for t, p, x in zip(tables, positions, tokens, strict=True)], []
        )
        assert_close(got, eager, **TOL)
        for i, seq in enumerate(seqs):
            seq.append(tokens[i])
            assert_close(got[i], full_logits(model, seq)[-1], **TOL)
    assert graphs.steps == 2
    # no block a sequence could be given was written
    assert not cache.k[:, order].any() and not cache.v[:, order].any()
    one = graphs.forward([5], [tables[1]], [len(seqs[1])])  # size 1: no padding
    assert_close(one[0], full_logits(model, [*seqs[1], 5])[-1], **TOL)
