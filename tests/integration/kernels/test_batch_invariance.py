"""Batch invariance (``--batch-invariant``, adapters/torch/runtime/invariant.py): a row's
result is the same bits whatever shares its step — at the kernel level (a quantized linear
row, a paged attention row: alone and among 1-64 rows) and through a model's paged step (a
prompt as rows alone, beside other sequences, split over steps after a cached prefix, and
its decode rows), derived from vLLM's batch-invariance tests (tests/v1/generation/
test_batch_invariance.py: a prompt alone against the same prompt in batches of other
prompts; greedy tokens and logprobs must match exactly)."""

import random
from pathlib import Path

import pytest
import torch
from torch import Tensor

from adapters.torch.cpu.kernels import cpu_kernels
from adapters.torch.cpu.portable import portable_kernels
from adapters.torch.loading.loader import load_model
from adapters.torch.models.layers import PagedBatch
from adapters.torch.models.paged_kv import PagedKVCache
from adapters.torch.models.transformer import Transformer
from adapters.torch.runtime.invariant import NEVER, make_batch_invariant
from tests.support.tiny_models import VOCAB, save_tiny_model

portable = portable_kernels()
pytestmark = pytest.mark.skipif(portable is None, reason="no C++ toolchain")
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("bits", "group", "n", "k"),
    [(4, 32, 960, 576), (4, 32, 576, 1536), (8, 32, 4099, 576)],
    ids=["q4_1-qkv", "q4_1-down", "q8-head"],
)
def test_a_quantized_row_is_the_same_among_1_to_64_rows(
    dtype: torch.dtype, bits: int, group: int, n: int, k: int
) -> None:
    """SmolLM2's shapes (GGUF Q4_1 layers, a Q8_0-style head): every row count up to a full
    batch, the row at each place among them."""
    gen = torch.Generator().manual_seed(n + k)
    if bits == 4:
        qweight = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    else:
        qweight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).half()
    mins = (torch.randn(n, k // group, generator=gen) * 0.05).half() if bits == 4 else None
    x = torch.randn(64, k, generator=gen).to(dtype)

    def run(rows: Tensor) -> Tensor:
        return portable.quant_linear(rows, qweight, scales, mins, bits, group, NEVER)

    alone = torch.cat([run(x[i : i + 1]) for i in range(64)])
    for rows in ROW_COUNTS:
        assert torch.equal(run(x[:rows]), alone[:rows]), rows
    assert torch.equal(run(x.flip(0)), alone.flip(0))  # its place among them


@pytest.mark.skipif(cpu_kernels() is None, reason="no AVX512-BF16 kernels")
def test_bf16_paged_attention_rows_are_the_same_among_1_to_64_rows() -> None:
    """One long row alone is the case the kernel splits across threads (fewer (row, KV
    head) pairs than twice the threads): with the split off it rounds as in any batch."""
    kernels = cpu_kernels()
    assert kernels is not None
    heads, kv_heads, dim, block = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([700, *torch.randint(1, 700, (63,), generator=gen).tolist()])
    blocks_each = -(-700 // block)
    pool_blocks = 64 * blocks_each
    k_pool = torch.randn(pool_blocks, kv_heads, block, dim, generator=gen).bfloat16()
    v_pool = torch.randn(pool_blocks, kv_heads, block, dim, generator=gen).bfloat16()
    order = torch.randperm(pool_blocks, generator=gen).to(torch.int32)
    tables = order.view(64, blocks_each)
    q = torch.randn(64, heads, 1, dim, generator=gen).bfloat16()

    def run(first: int, rows: int) -> Tensor:
        end = first + rows
        return kernels.paged_attention(
            q[first:end], k_pool, v_pool, tables[first:end], lengths[first:end], 0, dim**-0.5
        )

    was = kernels.set_split_keys(False)
    try:
        alone = torch.cat([run(i, 1) for i in range(64)])
        for rows in ROW_COUNTS:
            assert torch.equal(run(0, rows), alone[:rows]), rows
    finally:
        kernels.set_split_keys(was)


# --- a model's paged steps, every token a row (the runner's layout under --batch-invariant)


class Steps:
    """Paged steps over one pool whose blocks are handed out in a scrambled order; every
    token is a row at its position (as the runner lays out prompt chunks when invariant)."""

    def __init__(self, model: Transformer, num_blocks: int = 96, block: int = 4) -> None:
        weight = model.embed_tokens.weight
        self.model, self.block = model, block
        self.cache = PagedKVCache(model.config, num_blocks, block, dtype=weight.dtype, device="cpu")
        self.free = list(range(num_blocks))
        random.Random(1).shuffle(self.free)

    def table(self, length: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-length // self.block))]

    def run(self, parts: list[tuple[list[int], int, list[int]]]) -> list[Tensor]:
        """One step of ``(table, start, tokens)`` parts; each part's logits ``[T, vocab]``."""
        rows = [(table, start + i) for table, start, ids in parts for i in range(len(ids))]
        tokens = [t for _, _, ids in parts for t in ids]
        batch = PagedBatch(self.cache, rows, [], self.model.windows(), torch.device("cpu"))
        with torch.inference_mode():
            logits = self.model.forward_mixed(
                torch.tensor(tokens), batch, torch.arange(len(tokens))
            )
        return list(logits.split([len(ids) for _, _, ids in parts]))


def ids(length: int, seed: int) -> list[int]:
    return torch.randint(
        0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["gguf-like-int4", "int8"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_a_sequence_rounds_alike_whatever_shares_its_steps(
    family: str, method: str, dtype: torch.dtype, tmp_path: Path
) -> None:
    save_tiny_model(family, tmp_path)
    model = load_model(tmp_path, dtype=dtype, quantization="int4" if method != "int8" else "int8")
    make_batch_invariant(model)
    prompt, generated = ids(19, 1), ids(3, 2)
    full = prompt + generated

    # alone: the prompt in one step, then each generated token a decode row
    alone = Steps(model)
    table = alone.table(len(full))
    want = [alone.run([(table, 0, prompt)])[0]]
    for i, token in enumerate(generated):
        want.append(alone.run([(table, len(prompt) + i, [token])])[0])
    reference = torch.cat(want)

    # among others: its prompt split 7 + 12 over two steps (the second as after a prefix
    # cache hit: 12 rows alone, fewer than the default switch to dequantized tiles), the
    # first beside two other prompts (52 rows); then its decode rows beside other
    # sequences' prompt tokens
    crowd = Steps(model)
    table = crowd.table(len(full))
    others = [(crowd.table(40), 0, ids(40, 3)), (crowd.table(5), 0, ids(5, 4))]
    got = [crowd.run([others[0], (table, 0, prompt[:7]), others[1]])[1]]
    got.append(crowd.run([(table, 7, prompt[7:])])[0])
    for i, token in enumerate(generated):
        step = [(crowd.table(2 + i), 0, ids(2 + i, 6 + i)), (table, len(prompt) + i, [token])]
        got.append(crowd.run(step)[1])
    assert torch.equal(torch.cat(got), reference)

    # drafts: the generated tokens verified in one step (speculation's layout)
    drafted = Steps(model)
    table = drafted.table(len(full))
    first = drafted.run([(table, 0, prompt)])[0]
    rest = drafted.run([(drafted.table(8), 0, ids(8, 9)), (table, len(prompt), generated)])[1]
    assert torch.equal(torch.cat([first, rest]), reference)
