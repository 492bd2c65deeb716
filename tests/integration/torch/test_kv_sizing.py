"""KV pool sizing by memory (``--kv-cache-memory``): the flag's forms, a block's bytes, the
budget of a fraction, and the start-up error when one request does not fit."""

import re

import pytest
import torch

from adapters.torch.models.config import ModelConfig, RopeConfig
from adapters.torch.models.paged_kv import PagedKVCache
from adapters.torch.runtime import kv_sizing
from adapters.torch.runtime.kv_sizing import (
    DeviceMemory,
    bytes_per_block,
    cpu_available_memory,
    kv_budget,
    size_kv_cache,
)
from domain.config import EngineConfig
from domain.errors import InvalidParameterError
from domain.memory import MIB, KVCacheMemory, parse_kv_cache_memory

TINY = ModelConfig(
    arch="llama",
    vocab_size=32,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope=RopeConfig(theta=10000.0),
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
# 2 (K and V) * 2 layers * 2 KV heads * 16 positions * 16 dims * 2 bytes (bfloat16)
TINY_BLOCK = 4096


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("512MiB", 512 << 20),
        ("4GiB", 4 << 30),
        ("2GB", 2 * 10**9),
        ("1.5 KiB", 1536),
        ("64kb", 64_000),
        ("1073741824", 1 << 30),
        ("2", 2),
        ("7b", 7),
    ],
)
def test_a_size_parses_to_bytes(text: str, nbytes: int) -> None:
    assert parse_kv_cache_memory(text) == KVCacheMemory(nbytes=nbytes)


@pytest.mark.parametrize(("text", "fraction"), [("0.9", 0.9), ("1", 1.0), (".25", 0.25)])
def test_a_number_up_to_one_is_a_fraction(text: str, fraction: float) -> None:
    assert parse_kv_cache_memory(text) == KVCacheMemory(fraction=fraction)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0", "fraction in (0, 1]"),
        ("-0.5", "fraction in (0, 1]"),
        ("1.5", "whole bytes"),
        ("4 potatoes", "unknown unit 'potatoes'"),
        ("GiB", "is not a size"),
        ("", "is not a size"),
        ("0MiB", "is not a size"),
    ],
)
def test_a_bad_value_is_refused_with_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_kv_cache_memory(text)


def test_a_block_holds_keys_and_values_of_every_layer_and_kv_head() -> None:
    assert bytes_per_block(TINY, 16, torch.bfloat16) == TINY_BLOCK
    assert bytes_per_block(TINY, 32, torch.float32) == 4 * TINY_BLOCK
    cache = PagedKVCache(TINY, 3, 16, dtype=torch.bfloat16, device="cpu")  # what is allocated
    assert cache.k.nbytes + cache.v.nbytes == 3 * TINY_BLOCK


def test_a_fraction_on_cpu_is_of_the_memory_available_now(tmp_path, monkeypatch) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  8000000 kB\nMemFree:  100 kB\nMemAvailable:  1000 kB\n")
    monkeypatch.setattr(kv_sizing, "MEMINFO", meminfo)
    assert cpu_available_memory() == 1_024_000
    engine = EngineConfig(max_model_len=64, max_num_seqs=2)  # 4 blocks per request
    memory = parse_kv_cache_memory("0.5")
    sizing = size_kv_cache(engine, TINY, torch.bfloat16, memory, "cpu")
    assert sizing.num_blocks == 512_000 // TINY_BLOCK == 125
    assert sizing.config.num_kv_blocks == 125 and sizing.config.max_num_seqs == 2
    assert sizing.memory_bytes == 125 * TINY_BLOCK
    assert sizing.max_concurrency == 31  # 125 // 4
    with pytest.raises(
        InvalidParameterError,
        match=r"2\.0 MiB for the KV cache, but only 1000\.0 KiB are available",
    ):
        size_kv_cache(engine, TINY, torch.bfloat16, parse_kv_cache_memory("2MiB"), "cpu")


def test_without_meminfo_the_available_memory_comes_from_elsewhere(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(kv_sizing, "MEMINFO", tmp_path / "absent")
    assert cpu_available_memory() > 0


def test_a_fraction_on_cuda_is_of_the_total_less_what_is_used() -> None:
    """vLLM's --gpu-memory-utilization: x of the device in all, the weights included."""
    device = DeviceMemory(total=1000 * MIB, used=300 * MIB, available=650 * MIB)
    assert kv_budget(KVCacheMemory(fraction=0.9), device) == 600 * MIB
    with pytest.raises(InvalidParameterError, match=r"leaves nothing.*300\.0 MiB are in use"):
        kv_budget(KVCacheMemory(fraction=0.25), device)
    with pytest.raises(InvalidParameterError, match=r"700\.0 MiB.*only 650\.0 MiB are available"):
        kv_budget(KVCacheMemory(fraction=1.0), device)


def test_bytes_size_the_pool_and_max_num_seqs_only_caps_running_requests() -> None:
    engine = EngineConfig(max_model_len=64, max_num_seqs=1)
    device = DeviceMemory(total=1 << 30, used=0, available=1 << 30)
    sizing = size_kv_cache(
        engine, TINY, torch.bfloat16, KVCacheMemory(nbytes=100_000), "cpu", device
    )
    assert sizing.num_blocks == 100_000 // TINY_BLOCK == 24
    assert (sizing.config.max_num_seqs, sizing.max_concurrency) == (1, 6)


def test_without_a_budget_the_pool_is_max_num_seqs_requests_at_max_seq_len() -> None:
    engine = EngineConfig(max_model_len=64, max_num_seqs=3)
    sizing = size_kv_cache(engine, TINY, torch.bfloat16)
    assert sizing.config is engine and engine.num_kv_blocks is None
    assert (sizing.num_blocks, sizing.max_concurrency) == (12, 3)


def test_a_budget_short_of_one_request_fails_saying_the_minimum() -> None:
    engine = EngineConfig(max_model_len=64)  # 4 blocks of 16 = 16 KiB
    device = DeviceMemory(total=1 << 30, used=0, available=1 << 30)
    memory = KVCacheMemory(nbytes=3 * TINY_BLOCK + 100)
    with pytest.raises(InvalidParameterError) as caught:
        size_kv_cache(engine, TINY, torch.bfloat16, memory, "cpu", device)
    assert caught.value.param == "kv_cache_memory"
    assert "hold 3 KV blocks" in str(caught.value)
    assert "max_model_len = 64 positions needs 4 blocks: 16.0 KiB at least" in str(caught.value)
    exact = KVCacheMemory(nbytes=4 * TINY_BLOCK)
    assert size_kv_cache(engine, TINY, torch.bfloat16, exact, "cpu", device).num_blocks == 4


def test_auto_is_a_quarter_of_the_cpu_memory_at_most_4_gib_and_vllms_0_9_on_cuda() -> None:
    engine = EngineConfig(max_model_len=64, max_num_seqs=2)
    small = DeviceMemory(total=400_000, used=0, available=400_000)
    sizing = size_kv_cache(engine, TINY, torch.bfloat16, "auto", "cpu", small)
    assert sizing.num_blocks == 100_000 // TINY_BLOCK  # a quarter of what is available
    assert sizing.config.max_num_seqs == 2  # only caps running requests
    large = DeviceMemory(total=64 << 30, used=0, available=64 << 30)
    assert size_kv_cache(engine, TINY, torch.bfloat16, "auto", "cpu", large).memory_bytes == (
        4 << 30
    )
    gpu = DeviceMemory(total=1000 * MIB, used=300 * MIB, available=700 * MIB)
    sizing = size_kv_cache(engine, TINY, torch.bfloat16, "auto", torch.device("cuda"), gpu)
    assert sizing.num_blocks == 600 * MIB // TINY_BLOCK
