"""Our models against transformers on tiny random configs (fp32, CPU)."""

from itertools import accumulate
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from adapters.torch.loading.loader import load_model
from adapters.torch.models.layers import PagedBatch
from adapters.torch.models.paged_kv import PagedKVCache
from adapters.torch.models.transformer import Transformer
from tests.support.paged_forward import PagedSequence
from tests.support.tiny_models import VOCAB, save_tiny_model

ARCHS = ["llama", "qwen3", "gemma3"]
TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, Transformer]:
    folder = tmp_path_factory.mktemp(request.param)
    reference = save_tiny_model(request.param, folder)
    ours = load_model(folder, dtype=torch.float32)
    return reference, ours


def _tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_full_forward_logits_match_transformers(pair) -> None:
    reference, ours = pair
    ids = _tokens(2, 20)
    with torch.no_grad():
        expected = reference(ids).logits
    assert_close(ours(ids), expected, **TOL)


def test_decoding_through_the_paged_cache_equals_the_full_forward(pair) -> None:
    _, ours = pair
    ids = _tokens(1, 18)
    full = ours(ids)
    seq = PagedSequence(ours, 32, block_size=4)
    prefill = seq.prefill(ids[0, :10])
    assert prefill.shape == (10, VOCAB)
    assert_close(prefill, full[0, :10], **TOL)
    for pos in range(10, 18):
        assert_close(seq.decode(ids[0, pos]), full[0, pos], **TOL)
    assert seq.length == 18


def test_chunked_prefill_through_the_paged_cache_equals_the_full_forward(pair) -> None:
    _, ours = pair
    ids = _tokens(1, 16)
    full = ours(ids)
    seq = PagedSequence(ours, 16, block_size=4)
    seq.prefill(ids[0, :7])
    assert_close(seq.prefill(ids[0, 7:]), full[0, 7:], **TOL)


def test_sequences_of_different_lengths_in_one_step_equal_each_alone(pair) -> None:
    """Prompt chunks of several lengths in one step, then their decode rows together (each
    row at its own position): every row equals its sequence's no-cache forward."""
    _, ours = pair
    lengths, steps, block = [3, 9, 6], 5, 4
    prompts = [_tokens(1, n, seed=n)[0].tolist() for n in lengths]
    capacity = -(-(max(lengths) + steps) // block)
    cache = PagedKVCache(
        ours.config, capacity * len(lengths), block, dtype=torch.float32, device="cpu"
    )
    tables = [list(range(i * capacity, (i + 1) * capacity)) for i in range(len(lengths))]
    windows, cpu = ours.windows(), torch.device("cpu")
    tokens = [t for p in prompts for t in p]
    chunks = [(table, 0, len(p)) for table, p in zip(tables, prompts, strict=True)]
    ends = torch.tensor(list(accumulate(lengths))) - 1
    logits = ours.forward_mixed(
        torch.tensor(tokens), PagedBatch(cache, [], chunks, windows, cpu), ends
    )
    for i, p in enumerate(prompts):
        assert_close(logits[i], ours(torch.tensor([p]))[0, -1], **TOL)
    forced = _tokens(3, steps, seed=99)
    for s in range(steps):
        rows = [(table, n + s) for table, n in zip(tables, lengths, strict=True)]
        batch = PagedBatch(cache, rows, [], windows, cpu)
        step = ours.forward_mixed(forced[:, s], batch, torch.arange(len(lengths)))
        for i, p in enumerate(prompts):
            seq = torch.tensor([[*p, *forced[i, : s + 1].tolist()]])
            assert_close(step[i], ours(seq)[0, -1], **TOL)


def test_sliding_window_is_exercised_beyond_the_window(tmp_path: Path) -> None:
    reference = save_tiny_model("gemma3", tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    assert ours.config.sliding_window == 6
    ids = _tokens(1, 40)
    with torch.no_grad():
        assert_close(ours(ids), reference(ids).logits, **TOL)
