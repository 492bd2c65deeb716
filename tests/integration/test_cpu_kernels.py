"""The compiled CPU decode kernels agree with the PyTorch ops they replace."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from adapters.torch.cpu_inference import KernelRMSNorm, KernelSiluMLP, PackedLinear, cpu_kernels
from adapters.torch.kv_cache import KVCache
from adapters.torch.layers import RMSNorm
from adapters.torch.loader import load_model
from tests.integration.tiny_models import save_tiny_model

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no AVX512-BF16 or no C++ toolchain")
BF16 = torch.bfloat16


def test_gemv_matches_a_float32_matmul_within_bf16_rounding() -> None:
    torch.manual_seed(0)
    w = torch.randn(1000, 576, dtype=BF16)
    x = torch.randn(1, 1, 576, dtype=BF16)
    y = kernels.gemv(x, w)
    assert y.shape == (1, 1, 1000) and y.dtype == BF16
    assert_close(y.float(), x.float() @ w.float().T, atol=0.1, rtol=1e-2)


@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_matches_the_module(unit_offset: bool) -> None:
    torch.manual_seed(1)
    norm = RMSNorm(576, 1e-5, unit_offset=unit_offset).to(BF16)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 576, dtype=BF16)
    assert_close(kernels.rms_norm(x, norm.weight, norm.eps, unit_offset), norm(x))


def test_silu_mul_matches_the_pytorch_ops() -> None:
    torch.manual_seed(2)
    gate_up = torch.randn(4, 2 * 1536, dtype=BF16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "length"), [(9, 3, 64, 37), (4, 1, 256, 5)])
def test_decode_attention_matches_sdpa(heads: int, kv_heads: int, dim: int, length: int) -> None:
    torch.manual_seed(3)
    q = torch.randn(1, 1, heads, dim, dtype=BF16).transpose(1, 2)  # a strided view, as in Attention
    cache = torch.randn(2, 1, kv_heads, length + 8, dim)
    k, v = cache[0, :, :, :length], cache[1, :, :, :length]
    expected = F.scaled_dot_product_attention(q.float(), k, v, scale=0.1, enable_gqa=True)
    assert_close(kernels.decode_attention(q, k, v, 0.1), expected.to(BF16))


def test_an_optimized_model_decodes_like_the_plain_bf16_model(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path)
    fast = load_model(tmp_path, dtype=BF16)
    plain = load_model(tmp_path, dtype=BF16, prepack=False)
    kinds = {type(m) for m in fast.modules()}
    assert {PackedLinear, KernelRMSNorm, KernelSiluMLP} <= kinds
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    caches = [KVCache.from_model_config(fast.config, 8, dtype=torch.float32) for _ in range(2)]
    with torch.inference_mode():
        assert_close(
            fast(ids, kv_cache=caches[0]), plain(ids, kv_cache=caches[1]), atol=0.05, rtol=0.02
        )
        step = torch.tensor([[7]])  # one row: the GEMV path
        assert_close(
            fast(step, kv_cache=caches[0]), plain(step, kv_cache=caches[1]), atol=0.05, rtol=0.02
        )
