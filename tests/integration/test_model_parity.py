"""Our models against transformers on tiny random configs (fp32, CPU)."""

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from adapters.torch.loader import load_model
from adapters.torch.models.kv_cache import KVCache
from adapters.torch.models.transformer import Transformer
from tests.integration.tiny_models import VOCAB, save_tiny_model

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


def test_decoding_with_the_cache_equals_the_full_forward(pair) -> None:
    _, ours = pair
    ids = _tokens(1, 18)
    full = ours(ids)
    cache = KVCache.from_model_config(ours.config, 32, dtype=torch.float32)
    prefill = ours(ids[:, :10], kv_cache=cache)
    assert prefill.shape == (1, 1, VOCAB)
    assert_close(prefill[:, 0], full[:, 9], **TOL)
    for pos in range(10, 18):
        step = ours(ids[:, pos : pos + 1], kv_cache=cache)
        assert_close(step[:, 0], full[:, pos], **TOL)
    assert cache.seq_len == 18


def test_chunked_prefill_through_the_cache_equals_the_full_forward(pair) -> None:
    _, ours = pair
    ids = _tokens(1, 16)
    full = ours(ids)
    cache = KVCache.from_model_config(ours.config, 16, dtype=torch.float32)
    ours(ids[:, :7], kv_cache=cache)
    padding = torch.ones(1, 16, dtype=torch.bool)
    rest = ours(ids[:, 7:], kv_cache=cache, padding_mask=padding)
    assert_close(rest, full[:, 7:], **TOL)


def test_right_padded_batch_equals_each_sequence_alone(pair) -> None:
    _, ours = pair
    lengths, steps = [3, 9, 6], 5
    prompts = [_tokens(1, n, seed=n)[0] for n in lengths]
    width = max(lengths)
    batch = torch.zeros(len(lengths), width, dtype=torch.long)
    padding = torch.zeros(len(lengths), width + steps, dtype=torch.bool)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = p
        padding[i, : len(p)] = True
    cache = KVCache.from_model_config(ours.config, width + steps, batch_size=3, dtype=torch.float32)
    logits = ours(batch, kv_cache=cache, padding_mask=padding)
    assert logits.shape == (3, width, VOCAB)
    alone = [ours(p[None]) for p in prompts]
    for i, n in enumerate(lengths):
        assert_close(logits[i, n - 1], alone[i][0, -1], **TOL)
    # Decode with the seed's shared positions: the longest row has no padding gap, so each
    # step must equal its unpadded continuation; padding never leaks into any row.
    forced = _tokens(3, steps, seed=99)
    longest = lengths.index(width)
    for s in range(steps):
        padding[:, width + s] = True
        step = ours(forced[:, s : s + 1], kv_cache=cache, padding_mask=padding)
        seq = torch.cat([prompts[longest], forced[longest, : s + 1]])[None]
        assert_close(step[longest, 0], ours(seq)[0, -1], **TOL)
        assert torch.isfinite(step).all()


def test_forward_without_padding_mask_is_unchanged_by_the_padding_path(pair) -> None:
    _, ours = pair
    ids = _tokens(1, 12)
    cache = KVCache.from_model_config(ours.config, 12, dtype=torch.float32)
    padded = ours(ids, kv_cache=cache, padding_mask=torch.ones(1, 12, dtype=torch.bool))
    assert_close(padded, ours(ids), **TOL)


def test_sliding_window_is_exercised_beyond_the_window(tmp_path: Path) -> None:
    reference = save_tiny_model("gemma3", tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    assert ours.config.sliding_window == 6
    ids = _tokens(1, 40)
    with torch.no_grad():
        assert_close(ours(ids), reference(ids).logits, **TOL)
