"""Weight-only quantization of a model's linears: ``int8`` (per output channel), ``int4``
(group-wise, asymmetric) and ``gguf`` (the GGUF file's own quantized blocks, repacked).

Decode reads every weight once per step, so its speed follows the weights' bytes: int8
halves bf16's, int4 with float16 scales and mins quarters it (4.5-5 bits a weight).

The format (:mod:`adapters.torch.quant_format`): quantized values, float16 scales and
optional mins per group, or GGUF's K-quant super-blocks kept whole.

:class:`QuantLinear` runs it with the portable CPU kernel (``cpu/csrc/portable/quant_linear.cpp``:
int8 dot products against activations quantized per 32 values for a few rows, dequantized
tiles and a GEMM for many) where it is built, and everywhere else (CUDA, no compiler)
dequantizes the weight for each call.
"""

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from adapters.torch.cpu.kernels import cpu_kernels
from adapters.torch.cpu.portable import portable_kernels
from adapters.torch.models.transformer import Transformer
from adapters.torch.quant_format import (
    QuantizedWeight,
    concat_rows,
    dequantize,
    narrow_to_6bit,
    plain_blocks,
    quantize_int4,
    quantize_int8,
)
from domain.config import QUANTIZATION_METHODS
from domain.errors import ModelLoadError

# Rows from which the kernel dequantizes tiles for a GEMM instead of int8 dot products.
DENSE_FROM_ROWS = 16
# An 8-bit LM head keeps a dequantized copy up to this size (see keep_dense_head).
DENSE_HEAD_MAX_BYTES = 512 << 20
# A quantized linear's rows switch to its bf16 panel copy (keep_panels) from this many:
# never, unless this CPU's tuning measured a crossover.
NEVER = 1 << 30
QUANTIZED_FILE = "quantized.safetensors"
QUANTIZATION_FILE = "quantization.json"
FORMAT = "infer-quantized-v1"
# HF module names -> ours where the loader fuses them: (module, index in the fused rows).
FUSED_LINEARS = {
    "self_attn.q_proj": ("attn.wqkv", 0),
    "self_attn.k_proj": ("attn.wqkv", 1),
    "self_attn.v_proj": ("attn.wqkv", 2),
    "mlp.gate_proj": ("mlp.w13", 0),
    "mlp.up_proj": ("mlp.w13", 1),
}
_HF_LINEARS = FUSED_LINEARS | {"self_attn.o_proj": ("attn.wo", 0), "mlp.down_proj": ("mlp.w2", 0)}


class QuantLinear(nn.Module):
    """``y = x @ W.T (+ b)`` with ``W`` quantized; a drop-in for an inference ``nn.Linear``."""

    qweight: Tensor
    scales: Tensor
    mins: Tensor | None

    def __init__(self, weight: QuantizedWeight, bias: Tensor | None = None) -> None:
        super().__init__()
        weight.check()
        self.out_features, self.in_features = weight.shape
        self.bits, self.group_size = weight.bits, weight.group_size
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)
        self.bias = bias
        self.dense_from_rows = DENSE_FROM_ROWS
        self.kernel = _kernel() if weight.qweight.device.type == "cpu" else None
        self.dense: Tensor | None = None  # W dequantized once (keep_dense_head)
        # W dequantized to bf16 once, in the AVX512-BF16 kernels' panels (keep_panels), for
        # steps of panels_from_rows rows or more
        self.panels: Tensor | None = None
        self.panels_from_rows = NEVER

    @property
    def weight_q(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scales, self.mins, self.bits, self.group_size)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        # Trainable (a LoRA trainer on the engine's weights): the gradient with respect to
        # x is dy @ W, W dequantized for the call (the weights are frozen).
        if torch.is_grad_enabled() and flat.requires_grad:
            y = _Trainable.apply(flat, self)
        else:
            y = self.product(flat)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def product(self, flat: Tensor) -> Tensor:
        """``flat @ W.T`` for ``flat`` ``[M, K]``: by the path its row count takes, or the
        dequantized tiles' in a :func:`prompt_rows` block."""
        prompt, chunked = _PROMPT_ROWS.get(), _PROMPT_STEP.get()
        if (
            self.panels is not None
            and (chunked or len(flat) >= self.panels_from_rows)
            and flat.dtype == torch.bfloat16
            and not prompt
        ):
            gemm = cast(Any, cpu_kernels()).gemm_packed
            return cast(Tensor, gemm(flat.contiguous(), self.panels, self.out_features))
        switch = 1 if prompt or chunked else self.dense_from_rows
        if self.dense is not None and len(flat) >= switch:
            return F.linear(flat.to(self.dense.dtype), self.dense).to(flat.dtype)
        if self.kernel is not None and flat.dtype in (torch.float32, torch.bfloat16):
            return cast(
                Tensor,
                self.kernel(
                    flat.contiguous(),
                    self.qweight,
                    self.scales,
                    self.mins,
                    self.bits,
                    self.group_size,
                    switch,
                ),
            )
        return F.linear(flat, dequantize(self.weight_q, flat.dtype))

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """The dense ``[N, K]`` weight in ``dtype`` (the C++ op where it is built)."""
        if self.dense is not None and self.dense.dtype == dtype:
            return self.dense
        op = getattr(portable_kernels(), "quant_dequantize", None)
        if op is not None and self.qweight.device.type == "cpu":
            w = self.weight_q
            return cast(Tensor, op(w.qweight, w.scales, w.mins, w.bits, w.group_size, dtype))
        return dequantize(self.weight_q, dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}, mins={self.mins is not None}"
        )


class _Trainable(torch.autograd.Function):
    """A frozen quantized linear in a training forward: the serving path's product, and
    the gradient with respect to ``x``, ``dy @ W`` (``W`` dequantized: the trainer keeps it)."""

    @staticmethod
    def forward(ctx: Any, flat: Tensor, linear: QuantLinear) -> Tensor:
        ctx.linear = linear
        return linear.product(flat)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None]:
        return dy @ ctx.linear.dequantized(dy.dtype), None


# Set while a step scores prompt tokens (the runner): every row through the dequantized
# tiles, whatever their count, so that a prompt's logprobs (Tinker's compute_logprobs) round
# as a training forward's (the trainer's linears take the tiles for every row count).
_PROMPT_ROWS: ContextVar[bool] = ContextVar("prompt_rows", default=False)


# Set while a step runs prompt chunks (the runner): its rows take the float path (the bf16
# panels where kept, else the tiles) whatever their count, so that a prompt's last tokens
# computed after a cached prefix round as the same tokens computed with the whole prompt
# (a chunk of a few rows would otherwise take the integer path, activations rounded per
# 32: the same greedy request gave another answer the second time, from the prefix cache).
_PROMPT_STEP: ContextVar[bool] = ContextVar("prompt_step", default=False)


@contextmanager
def prompt_step(on: bool = True) -> Iterator[None]:
    """Within: quantized linears take the float path for any row count."""
    token = _PROMPT_STEP.set(on)
    try:
        yield
    finally:
        _PROMPT_STEP.reset(token)


@contextmanager
def prompt_rows(on: bool = True) -> Iterator[None]:
    """Within: quantized linears take the dequantized-tiles path for any row count."""
    token = _PROMPT_ROWS.set(on)
    try:
        yield
    finally:
        _PROMPT_ROWS.reset(token)


def _kernel() -> Any | None:
    kernels = portable_kernels()
    return getattr(kernels, "quant_linear", None)


# (method, is the LM head) -> quantizer. The LM head is int8 in groups of 32 (llama.cpp's
# Q8_0) for both: on SmolLM2-135M an int4 head costs 15 points of top-1 agreement and a
# per-channel int8 head 3, a group-32 int8 head none (benchmarks/README.md).
_QUANTIZERS = {
    ("int8", False): quantize_int8,
    ("int4", False): quantize_int4,
    ("int8", True): lambda w: quantize_int8(w, 32),
    ("int4", True): lambda w: quantize_int8(w, 32),
}


def linear_paths(model: Transformer, *, lm_head: bool) -> list[str]:
    """The module paths of the linears quantization replaces."""
    paths = [
        f"layers.{i}.{name}"
        for i in range(len(model.layers))
        for name in ("attn.wqkv", "attn.wo", "mlp.w13", "mlp.w2")
    ]
    return [*paths, "lm_head"] if lm_head else paths


def quantize_model(
    model: Transformer, method: str, *, folder: Path | None = None, lm_head: bool = True
) -> int:
    """Swap the model's linears for :class:`QuantLinear` (in place); returns the weights'
    bytes after. ``gguf`` takes the blocks ``folder`` holds (a converted GGUF); ``lm_head``:
    the LM head too (the embedding table stays dense either way: a lookup reads one row)."""
    if method not in QUANTIZATION_METHODS:
        methods = ", ".join(QUANTIZATION_METHODS)
        raise ValueError(f"quantization must be one of {methods}, got {method!r}")
    if method == "gguf":
        if folder is None:
            raise ModelLoadError("gguf quantization needs the model's folder")
        weights = _gguf_weights(folder, model)
    else:
        weights = {}
        for path in linear_paths(model, lm_head=lm_head):
            dense = _dense(model.get_submodule(path))
            device = dense.device
            weights[path] = _to(_QUANTIZERS[method, path == "lm_head"](dense), device)
    total = 0
    for path, weight in weights.items():
        old = model.get_submodule(path)
        bias = getattr(old, "bias", None)
        model.set_submodule(path, QuantLinear(weight, bias))
        total += weight.nbytes
    return total


def keep_dense_head(model: Transformer, dtype: torch.dtype) -> int:
    """Give an 8-bit (or 6-bit: a GGUF's Q6_K) LM head on the CPU kernel a dequantized copy
    in ``dtype`` (up to
    :data:`DENSE_HEAD_MAX_BYTES`) for the rows the kernel's dense path takes (``rows >=
    dense_from_rows``): the same weights that path dequantizes tile by tile on every call,
    dequantized once. The head is the largest linear of a small model and the one the
    integer path is slowest on (int16 activations against int8 weights): at 16 rows of
    SmolLM2-135M's (49152 x 576) the per-call dequantization took 7 ms, F.linear on the copy
    2.4 ms, a sixth of the whole decode step; one row stays on the 8-bit integer path, twice
    as fast as the copy (it reads half the bytes). Returns the copy's bytes (0: none kept)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, QuantLinear) or head.kernel is None or head.bits not in (6, 8):
        return 0
    nbytes = head.out_features * head.in_features * dtype.itemsize
    if nbytes > DENSE_HEAD_MAX_BYTES:
        return 0
    head.dense = dequantize(head.weight_q, dtype)
    return nbytes


def keep_panels(model: nn.Module, switches: Mapping[int, int], max_bytes: int) -> int:
    """Give the CPU kernel's quantized linears of the formats in ``switches`` (bits -> rows)
    a bf16 copy in the AVX512-BF16 kernels' panels, taken from that many rows on (decode
    steps of many rows are compute-bound: there the bf16 panel GEMM beats both the integer
    dot products and tiles dequantized on every call; SmolLM2-135M's decode step at 64 rows
    46.5 -> 34.7 ms on a Zen 5), all of them or none: not where the copies would take more
    than ``max_bytes``, nor without those kernels. An LM head's dense copy goes where its
    panels take over from no more rows. Returns the copies' bytes (0: none kept)."""
    kernels = cpu_kernels()
    linears = [
        m
        for m in model.modules()
        if isinstance(m, QuantLinear)
        and m.kernel is not None
        and m.bits in switches
        and m.in_features % 2 == 0
    ]
    nbytes = sum(m.out_features * m.in_features * 2 for m in linears)
    if kernels is None or not linears or nbytes > max_bytes:
        return 0
    for m in linears:
        m.panels = kernels.pack_panels(m.dequantized(torch.bfloat16).contiguous())
        m.panels_from_rows = switches[m.bits]
        if m.dense is not None and m.panels_from_rows <= m.dense_from_rows:
            m.dense = None
    return nbytes


def _dense(module: nn.Module) -> Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(module, nn.Linear) or not isinstance(weight, Tensor):
        raise ValueError(f"cannot quantize {type(module).__name__}: not a plain nn.Linear")
    return weight


def _to(w: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    mins = None if w.mins is None else w.mins.to(device)
    return QuantizedWeight(w.qweight.to(device), w.scales.to(device), mins, w.bits, w.group_size)


def has_gguf_blocks(folder: Path) -> bool:
    """Whether ``folder`` (a converted GGUF) kept the file's quantized blocks."""
    return (folder / QUANTIZATION_FILE).is_file() and (folder / QUANTIZED_FILE).is_file()


def _gguf_weights(folder: Path, model: Transformer) -> dict[str, QuantizedWeight]:
    """Our module paths -> the GGUF's blocks, fused projections concatenated; a linear
    whose parts were not all quantized in the file stays dense."""
    if not has_gguf_blocks(folder):
        raise ModelLoadError(
            f"{folder}: no GGUF quantized weights (quantization gguf serves a .gguf model)"
        )
    try:
        meta = json.loads((folder / QUANTIZATION_FILE).read_text())
        entries: dict[str, dict[str, int]] = meta["tensors"]
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, not {FORMAT}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{folder / QUANTIZATION_FILE}: unreadable ({e})") from e
    device = model.embed_tokens.weight.device
    kernels = portable_kernels() if device.type == "cpu" else None
    # Where the kernel's 6-bit path is vector code (AVX-512BW), the K-quants' super-blocks as
    # they are and Q5_0's values (int8 in the file's cache) in 6 bits (7 bits a weight read
    # per token instead of 8.5); elsewhere the K-quants in the block formats
    six = kernels is not None and 6 in getattr(kernels, "fast_bits", ())
    parts: dict[str, dict[int, QuantizedWeight]] = {}
    try:
        with safe_open(str(folder / QUANTIZED_FILE), framework="pt") as f:
            stored = set(f.keys())
            for name, entry in entries.items():
                path, index = _our_path(name)
                mins_key = f"{name}.mins"
                weight = QuantizedWeight(
                    f.get_tensor(f"{name}.qweight"),
                    f.get_tensor(f"{name}.scales"),
                    f.get_tensor(mins_key) if mins_key in stored else None,
                    int(entry["bits"]),
                    int(entry["group_size"]),
                )
                weight.check()
                weight = narrow_to_6bit(weight) if six else plain_blocks(weight)
                parts.setdefault(path, {})[index] = _to(weight, device)
    except (SafetensorError, OSError, RuntimeError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{folder / QUANTIZED_FILE}: unreadable ({e})") from e
    weights = {}
    for path, pieces in parts.items():
        module = model.get_submodule(path)
        want = _fused_count(path)
        if len(pieces) != want or sorted(pieces) != list(range(want)):
            continue  # some parts were left dense in the file
        weight = concat_rows([pieces[i] for i in range(want)])
        if weight.shape != (module.out_features, module.in_features):
            raise ModelLoadError(f"{folder}: quantized {path} is {weight.shape}")
        weights[path] = weight
    return weights


def _our_path(hf_name: str) -> tuple[str, int]:
    if hf_name == "lm_head":
        return "lm_head", 0
    prefix, _, rest = hf_name.removeprefix("model.").partition(".")
    layer, _, module = rest.partition(".")
    if prefix != "layers" or module not in _HF_LINEARS:
        raise ValueError(f"unexpected quantized tensor {hf_name!r}")
    target, index = _HF_LINEARS[module]
    return f"layers.{layer}.{target}", index


def _fused_count(path: str) -> int:
    return 3 if path.endswith("wqkv") else 2 if path.endswith("w13") else 1


@dataclass(frozen=True)
class Agreement:
    """How closely a quantized model follows its reference over some prompts, teacher
    forced: ``top1`` the share of positions whose argmax next token is the same,
    ``last_top1`` that share at each prompt's last position only, ``mean_kl`` the mean
    KL(reference || model) of the next-token distributions in nats."""

    positions: int
    top1: float
    last_top1: float
    mean_kl: float


@torch.inference_mode()
def agreement(reference: Transformer, model: Transformer, prompts: list[list[int]]) -> Agreement:
    """:class:`Agreement` of ``model`` with ``reference`` on ``prompts`` (token ids)."""
    same = last_same = positions = 0
    kl = 0.0
    device = reference.embed_tokens.weight.device
    for ids in prompts:
        batch = torch.tensor([ids], device=device)
        ref = reference(batch)[0].float().log_softmax(-1)
        got = model(batch)[0].float().log_softmax(-1)
        matches = ref.argmax(-1) == got.argmax(-1)
        same += int(matches.sum())
        last_same += int(matches[-1])
        positions += len(ids)
        kl += float((ref.exp() * (ref - got)).sum())
    n = max(positions, 1)
    return Agreement(positions, same / n, last_same / max(len(prompts), 1), kl / n)
