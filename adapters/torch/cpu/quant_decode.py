"""A quantized model's decode steps, one call per layer: the portable ``quant_decode_layer``.

A decode step of a small model on a CPU is mostly per-op overhead: SmolLM2-135M's 30
layers run ~40 Python-level ops each, ~10 ms a token next to ~6 ms of quantized GEMVs. When
every linear of a Llama, Qwen3 or Gemma 3 block is a :class:`~adapters.torch.quant.QuantLinear`
on the portable kernel, :func:`install_quant_decode` gives the block a ``decode_kernel``
that runs a step of decode rows (the engine's, over the paged KV pool) as one C++ call:
the same quantized linears and paged attention (for a bf16 model the AVX512-BF16 build's
where the CPU has it: the op ``infer::paged_attention_bf16``), the norms, RoPE and gating
as loops. It steps aside (returns None: the modules run) for prompt chunks, for a step
whose rows use a LoRA adapter (the served adapters wrap the linears: the wrapper must
run), and for any dtype other than the model's.
``INFER_CPU_KERNELS=0`` (no portable kernels) leaves the modules' path everywhere.
"""

from typing import Any, cast

import torch
from torch import Tensor, nn

from adapters.torch.cpu.kernels import cpu_kernels
from adapters.torch.cpu.portable import portable_kernels
from adapters.torch.models.gemma3 import Gemma3Block
from adapters.torch.models.layers import PagedBatch, PagedDecodeRows, gelu_tanh
from adapters.torch.models.llama import LlamaBlock
from adapters.torch.models.transformer import Transformer
from adapters.torch.quant import QuantLinear


def install_quant_decode(model: nn.Module) -> int:
    """Give every Llama / Qwen3 / Gemma 3 block whose linears are all quantized the fused
    decode layer, and a model whose every block has one the stack of them
    (:class:`QuantDecodeStack`); returns how many blocks got one (0 without the portable
    kernels)."""
    kernels = portable_kernels()
    kernel = getattr(kernels, "quant_decode_layer", None)
    if kernel is None:
        return 0
    installed = 0
    for module in model.modules():
        if isinstance(module, LlamaBlock | Gemma3Block) and QuantDecodeLayer.applies(module):
            module.decode_kernel = QuantDecodeLayer(module, kernel)
            installed += 1
    if isinstance(model, Transformer) and QuantDecodeStack.applies(model):
        model.decode_stack = QuantDecodeStack(model)
    return installed


class QuantDecodeLayer:
    """One block's decode rows as one ``quant_decode_layer`` call (see the module doc)."""

    def __init__(self, block: LlamaBlock | Gemma3Block, kernel: Any) -> None:
        self.block, self.kernel = block, kernel
        attn, gemma = block.attn, isinstance(block, Gemma3Block)
        first = _norm(block.input_layernorm)
        mlp_norm = block.pre_feedforward_layernorm if gemma else block.post_attention_layernorm
        self.norms = [
            first.weight,
            _norm(block.post_attention_layernorm).weight if gemma else None,
            _norm(mlp_norm).weight,
            _norm(block.post_feedforward_layernorm).weight if gemma else None,
            _norm(attn.q_norm).weight if attn.q_norm is not None else None,
            _norm(attn.k_norm).weight if attn.k_norm is not None else None,
        ]
        self.dtype = first.weight.dtype
        self.eps, self.scale = first.eps, attn.scale
        mlp = block.mlp  # a GatedMLP, or the AVX512 kernels' wrapper of one (``.gelu``)
        gelu = bool(getattr(mlp, "gelu", False)) or getattr(mlp, "act", None) is gelu_tanh
        self.shape = [attn.n_heads, attn.n_kv, attn.head_dim, int(first.unit_offset), int(gelu)]
        # The AVX512-BF16 build's paged attention (the op infer::paged_attention_bf16) where
        # it is loaded (bf16 only; ~3x the portable one), else the portable one: chosen once.
        self.bf16_attention = self.dtype == torch.bfloat16 and cpu_kernels() is not None
        self._key: tuple[Any, ...] | None = None
        self._linears: list[Tensor | None] = []
        self._meta: list[int] = []

    @staticmethod
    def applies(block: LlamaBlock | Gemma3Block) -> bool:
        linears = _linears(block)
        return (
            linears is not None
            and all(m.kernel is not None for m in linears)
            and linears[2].out_features % 2 == 0
        )

    def linears(self) -> list[QuantLinear] | None:
        """The block's quantized linears now, or None (see :func:`_linears`)."""
        return _linears(self.block)

    def __call__(
        self, x: Tensor, rope: tuple[Tensor, Tensor], rows: PagedDecodeRows
    ) -> Tensor | None:
        linears = _linears(self.block)
        if linears is None or x.dtype != self.dtype:
            return None  # a LoRA adapter on this step's rows, or another dtype
        if rows.k_pool.dtype != x.dtype:
            return None
        cos, sin = rope
        flat = x.reshape(-1, x.shape[-1])
        panels = self._panels(linears, len(flat))
        if panels is not None:
            return self._panel_layer(flat, panels, rope, rows).view(x.shape)
        y = self.kernel(
            x.reshape(-1, x.shape[-1]),
            self.norms,
            *self._arguments(linears, rows.window),
            rows.k_pool,
            rows.v_pool,
            rows.write_index,
            rows.tables,
            rows.lengths,
            cos,
            sin,
            self.scale,
            self.eps,
        )
        return y.view(x.shape)

    def _panels(self, linears: list[QuantLinear], rows: int) -> list[Tensor] | None:
        """The four linears' bf16 panels where a step of ``rows`` rows takes them (every
        linear's switch reached; no bias: the bf16 layer has none), else None."""
        if not self.bf16_attention or self.shape[2] % 32:
            return None
        panels = []
        for m in linears:
            if m.panels is None or rows < m.panels_from_rows or m.bias is not None:
                return None
            panels.append(m.panels)
        return panels

    def _panel_layer(
        self, x: Tensor, panels: list[Tensor], rope: tuple[Tensor, Tensor], rows: PagedDecodeRows
    ) -> Tensor:
        """The step as the AVX512-BF16 kernels' decode layer over the linears' bf16
        panels (what a bf16 model's :class:`~.fused_decode.FusedDecodeLayer` runs)."""
        n = self.norms  # input, post-attention, pre-MLP, post-MLP, q, k
        heads, kv_heads, _, unit_offset, gelu = self.shape
        kernels: Any = cpu_kernels()
        return cast(
            Tensor,
            kernels.decode_layer_paged(
                x,
                n[0],
                panels[0],
                panels[1],
                n[1],
                n[2],
                panels[2],
                panels[3],
                n[3],
                n[4],
                n[5],
                bool(unit_offset),
                bool(gelu),
                panels[3].shape[1] * 2,
                rows.k_pool,
                rows.v_pool,
                rows.write_index,
                rows.tables,
                rows.lengths,
                rows.window,
                *rope,
                heads,
                kv_heads,
                self.scale,
                self.eps,
            ),
        )

    def _arguments(self, linears: list[QuantLinear], window: int) -> tuple[list, list[int]]:
        """The op's linear entries and meta, rebuilt only when a module or setting changed."""
        key = (*map(id, linears), window, *(m.dense_from_rows for m in linears))
        if key != self._key:
            self._linears = [t for m in linears for t in (m.qweight, m.scales, m.mins, m.bias)]
            each = [v for m in linears for v in (m.bits, m.group_size, m.dense_from_rows)]
            self._meta = [*self.shape, window, int(self.bf16_attention), *each]
            self._key = key
        return self._linears, self._meta


class QuantDecodeStack:
    """A model's decode steps as one call over all its fused decode layers
    (``torch.classes.infer.DecodeStack``): each layer's arguments are handed to C++ once
    (again when a layer's linears or settings change), so a step pays the blocks'
    Python — the module calls, the op's argument lists, ~1 ms of a 6.5 ms one-row step of
    SmolLM2-135M — once instead of per layer. Each layer computes as its
    :class:`QuantDecodeLayer` (the same op, or the bf16 layer over its panel copies from
    the same row count). Steps aside (None: the layers run) as each layer would: prompt
    chunks, rows with a LoRA adapter, another dtype."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.layers = [cast(QuantDecodeLayer, block.decode_kernel) for block in model.layers]
        self._key: tuple[Any, ...] | None = None
        self._stack: Any = None

    @staticmethod
    def applies(model: Transformer) -> bool:
        try:
            torch.classes.infer.DecodeStack  # noqa: B018 (registered by the portable library)
        except (AttributeError, RuntimeError):
            return False
        return all(isinstance(block.decode_kernel, QuantDecodeLayer) for block in model.layers)

    def __call__(
        self, x: Tensor, ropes: dict[bool, tuple[Tensor, Tensor]], batch: PagedBatch
    ) -> Tensor | None:
        if batch.chunks or not batch.rows or not batch.fused:
            return None
        views = sorted(batch.decode_masks)  # False (global), then True (sliding)
        masks = [batch.decode_masks[v] for v in views]
        cache = batch.cache
        stack = self._current([m.window for m in masks], views, x, cache)
        if stack is None:
            return None
        flat = x.reshape(-1, x.shape[-1])
        y = stack.run(
            flat,
            batch.write_index,
            [m.tables for m in masks],
            [m.lengths for m in masks],
            [ropes[v][0] for v in views],
            [ropes[v][1] for v in views],
        )
        return cast(Tensor, y).view(x.shape)

    def _current(self, windows: list[int], views: list[bool], x: Tensor, cache: Any) -> Any:
        """The C++ stack for the layers as they are now (built again when a layer's linears,
        switches or panels, the pools or the windows changed), or None where a layer would
        step aside."""
        found = []
        for layer in self.layers:
            linears = _linears(layer.block)
            if linears is None or x.dtype != layer.dtype:
                return None
            found.append(linears)
        key = (
            tuple(windows),
            id(cache.k_layers),
            *(id(m) for linears in found for m in linears),
            *(
                (m.dense_from_rows, m.panels_from_rows, id(m.panels))
                for linears in found
                for m in linears
            ),
        )
        if key != self._key:
            self._stack = self._build(found, windows, views, cache)
            self._key = key
        return self._stack

    def _build(
        self, found: list[list[QuantLinear]], windows: list[int], views: list[bool], cache: Any
    ) -> Any:
        stack = torch.classes.infer.DecodeStack()
        for i, (layer, linears) in enumerate(zip(self.layers, found, strict=True)):
            view = views.index(self.model.sliding[i])
            tensors, meta = layer._arguments(linears, windows[view])
            usable = (  # as QuantDecodeLayer._panels: the bf16 layer has no bias
                layer.bf16_attention
                and layer.shape[2] % 32 == 0
                and all(m.panels is not None and m.bias is None for m in linears)
            )
            stack.add(
                layer.norms,
                tensors,
                meta,
                cache.k_layers[layer.block.attn.layer],
                cache.v_layers[layer.block.attn.layer],
                view,
                [m.panels for m in linears] if usable else [],
                max(m.panels_from_rows for m in linears) if usable else 1 << 62,
                linears[3].in_features,
                layer.scale,
                layer.eps,
            )
        return stack


def _linears(block: LlamaBlock | Gemma3Block) -> list[QuantLinear] | None:
    """The block's four linears as quantized ones, or None: one is dense, or a served LoRA
    adapter applies to this step's rows (its wrapper, ``base`` + ``routes``, must run)."""
    # Submodules read from ``_modules``: ``nn.Module.__getattr__`` costs ~1 µs a lookup, and
    # this runs for every layer of every decode step.
    attn = cast(nn.Module, block._modules["attn"])._modules
    mlp = cast(nn.Module, block._modules["mlp"])._modules
    found: list[QuantLinear] = []
    for module in (attn["wqkv"], attn["wo"], mlp["w13"], mlp["w2"]):
        while not isinstance(module, QuantLinear):
            base = module._modules.get("base") if module is not None else None
            if getattr(module, "routes", None) or base is None:
                return None
            module = base
        found.append(module)
    return found


def _norm(module: object) -> Any:
    """An RMSNorm, or the one a CPU kernel wrapper holds (``.norm``)."""
    return getattr(module, "norm", module)
