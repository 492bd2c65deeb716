"""What the composition root builds from our torch adapters, one function a piece: the
dtype (``--dtype auto`` measured), the model (quantized, each linear's switch tuned), the
engine's KV pool (``--kv-cache-memory``), multi-LoRA serving, the LoRA training backend and
its sampler, the embedding model. The start-up log lines (``dtype auto``, ``quantized
weights``, ``KV cache``) are written here.

A model folder is anything with the fields of :class:`ModelFolder` (the weights adapter's
``ResolvedModel``): adapters do not import each other.
"""

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Protocol

import structlog
import torch

from adapters.torch.cpu.tuning import linear_shapes, tuned
from adapters.torch.embeddings.embedder import TorchEmbedder
from adapters.torch.loading.install import install_trainable_kernels
from adapters.torch.loading.loader import load_model
from adapters.torch.lora.serving import LoraServing
from adapters.torch.lora.training import BaseModelEntry, LoraTrainingBackend
from adapters.torch.models.config import ModelConfig
from adapters.torch.models.transformer import Transformer
from adapters.torch.quant import QuantLinear, has_gguf_blocks, keep_panels
from adapters.torch.runtime.invariant import make_batch_invariant
from adapters.torch.runtime.kv_sizing import auto_panels_memory, bytes_per_block, size_kv_cache
from application.engine.engine_client import EngineClient
from application.serving.embeddings import EmbeddingLimits, EmbeddingService
from application.tinker.engine_sampler import EngineSampler
from domain.config import EngineConfig
from domain.memory import (
    AUTO,
    CPU_AUTO_CAP,
    CPU_AUTO_FRACTION,
    CUDA_AUTO_FRACTION,
    MIB,
    KVCacheMemory,
    human_size,
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# The start-up lines keep the logger name they were written under before they moved here.
log = structlog.get_logger("entrypoints.container")


class ModelFolder(Protocol):
    """A model's Hugging Face-format folder, as the weights adapter resolves it."""

    @property
    def path(self) -> Path: ...
    @property
    def name(self) -> str: ...
    @property
    def random_weights(self) -> bool: ...


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def choose_dtype(flag: str, resolved: ModelFolder, device: str | None) -> str:
    """``--dtype``: a dtype, or ``auto``: bfloat16 on CUDA; on a CPU the faster of bfloat16
    and float32 for this model's linears on this CPU, measured once and cached
    (:mod:`adapters.torch.cpu.tuning`)."""
    if flag != "auto":
        return flag
    if torch.device(device or default_device()).type != "cpu":
        return "bfloat16"
    tuning = tuned(linear_shapes(ModelConfig.from_folder(resolved.path)))
    log.info("dtype auto", dtype=tuning.dtype, cpu=tuning.cpu, reason=tuning.reason)
    return tuning.dtype


def choose_quantization(flag: str | None, resolved: ModelFolder, device: str = "cpu") -> str | None:
    """``--quantization``: a method, ``none`` (None, the default), or ``auto``: on a CPU,
    ``gguf`` for a GGUF model (served from its own quantized blocks, as llama.cpp serves
    it), else none; on a GPU none (the quantized kernels are CPU ones: a GPU would
    dequantize every linear on every call)."""
    if flag is None or flag == "none":
        return None
    if flag == "auto":
        on_cpu = str(device).startswith("cpu")
        return "gguf" if on_cpu and has_gguf_blocks(resolved.path) else None
    return flag


def build_model(
    resolved: ModelFolder,
    dtype: str,
    device: str | None,
    quantization: str | None = None,
    panels_memory: int | None = None,
) -> Transformer:
    """The model on ``device`` (None: CUDA when there is one) in ``dtype``, its linears
    quantized as ``--quantization`` chooses, with bf16 panel copies for steps of many rows
    within ``panels_memory`` bytes (None: :func:`auto_panels_memory`); logs the quantized
    weights once."""
    device = device or default_device()
    if panels_memory is None:
        panels_memory = auto_panels_memory()
    method = choose_quantization(quantization, resolved, device)
    model = load_model(
        resolved.path,
        dtype=DTYPES[dtype],
        device=device,
        random_weights=resolved.random_weights,
        quantization=method,
    )
    if method is not None:
        linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
        switch, panels = _quantized_switch(model, linears, dtype, panels_memory)
        log.info(
            "quantized weights",
            method=method,
            linears=len(linears),
            weights_mib=round(sum(m.weight_q.nbytes for m in linears) / MIB, 1),
            dense_from_rows=switch,
            # an 8-bit LM head's dequantized copy for many rows (keep_dense_head)
            dense_copy_mib=round(sum(m.dense.nbytes for m in linears if m.dense is not None) / MIB),
            # bf16 panel copies for steps of many rows (keep_panels)
            panels_from_rows=panels or None,
            panels_mib=round(sum(m.panels.nbytes for m in linears if m.panels is not None) / MIB),
        )
    return model


def _quantized_switch(
    model: Transformer, linears: list[QuantLinear], dtype: str, panels_memory: int
) -> tuple[dict[int, int] | None, dict[int, int]]:
    """Give each quantized linear this CPU's measured switch from integer dot products to
    dequantized tiles for its weight format and the model's dtype (see
    :mod:`adapters.torch.cpu.tuning`): bits -> rows, None without the kernel; and, where the
    tuning measured bf16 panel copies winning from some row count, those copies within
    ``panels_memory`` bytes (:func:`~adapters.torch.quant.keep_panels`): bits -> rows,
    empty where none are kept."""
    if not linears or linears[0].kernel is None:
        return None, {}
    tuning = tuned(linear_shapes(model.config))
    chosen: dict[int, int] = {}
    panels: dict[int, int] = {}
    for linear in linears:
        switch = tuning.switch(linear.bits, dtype)
        if switch is not None:
            linear.dense_from_rows = chosen[linear.bits] = switch
        # 6-bit weights go with 8-bit's measurement (both integer dots against int8 x)
        from_rows = tuning.panels(8 if linear.bits == 6 else linear.bits, dtype)
        if from_rows is not None:
            panels[linear.bits] = from_rows
    if panels and not keep_panels(model, panels, panels_memory):
        panels = {}
    return chosen or None, panels


def build_engine_config(
    settings: EngineConfig, model: Transformer, memory: KVCacheMemory | str | None
) -> EngineConfig:
    """The torch runner's engine configuration: ``settings`` with as many KV blocks as
    ``memory`` (a budget, or ``auto``) holds on the model's device in its dtype (None:
    ``settings``' blocks); logs the pool and the concurrency once."""
    weight = model.embed_tokens.weight
    sizing = size_kv_cache(settings, model.config, weight.dtype, memory, weight.device)
    config = sizing.config
    if memory == AUTO:
        on_cuda = weight.device.type == "cuda"
        sized_by = (
            f"auto ({CUDA_AUTO_FRACTION:g} of the device's memory, the weights included)"
            if on_cuda
            else f"auto ({CPU_AUTO_FRACTION:g} of the memory available, at most "
            f"{human_size(CPU_AUTO_CAP)})"
        )
    else:
        sized_by = str(memory) if memory is not None else "max_num_seqs"
    log.info(
        "KV cache",
        blocks=sizing.num_blocks,
        block_size=config.kv_block_size,
        tokens=sizing.num_blocks * config.kv_block_size,
        memory_mib=round(sizing.memory_bytes / MIB, 1),
        max_num_seqs=config.max_num_seqs,
        tokens_per_request=config.max_model_len,
        max_concurrency=sizing.max_concurrency,
        sized_by=sized_by,
    )
    return config


def kv_pool_bytes(config: EngineConfig, model: Transformer) -> int:
    """The bytes of the KV pool ``config`` gives the scheduler, in the model's layout and
    dtype (what ``infer:kv_cache_bytes`` reports a fraction of)."""
    per_block = bytes_per_block(model.config, config.kv_block_size, model.embed_tokens.weight.dtype)
    return config.kv_blocks * per_block


def build_lora_serving(
    model: Transformer,
    tinker: bool,
    lora_modules: Sequence[object],
    max_adapters: int,
    enable_lora: bool = False,
    max_rank: int | None = None,
) -> LoraServing | None:
    """Multi-LoRA serving, for Tinker's samples (``tinker``: the API is on), the
    ``--lora-modules`` and adapters loaded at run time (``--enable-lora``), folders of rank
    up to ``max_rank``; None when none needs it (the layers' linears stay unwrapped)."""
    if not tinker and not lora_modules and not enable_lora:
        return None
    return LoraServing(model, max_adapters=max_adapters, max_rank=max_rank)


def build_training_backend(
    resolved: ModelFolder,
    names: Sequence[str],
    dtype: str,
    device: str | None,
    max_context: int,
    quantization: str | None = None,
    batch_invariant: bool = False,
) -> LoraTrainingBackend:
    """LoRA training on the model's own weights, under the served names. A quantized model
    (the default GGUF) trains on the engine's weights and kernels (:func:`training_model`)."""
    device = device or default_device()
    method = choose_quantization(quantization, resolved, device)
    entry = BaseModelEntry(
        names[0],
        resolved.path,
        aliases=tuple(names[1:]),
        dtype=DTYPES[dtype],
        max_context=max_context,
        random_weights=resolved.random_weights,
        device=device,
        loader=None
        if method is None or resolved.random_weights
        else partial(training_model, resolved, dtype, device, method, batch_invariant),
    )
    return LoraTrainingBackend([entry])


def training_model(
    resolved: ModelFolder, dtype: str, device: str, method: str, batch_invariant: bool
) -> Transformer:
    """The trainer's frozen model, built as the engine's is (:func:`build_model`: its
    quantized linears, this CPU's kernels) and trainable through them
    (``reference_grad.py``): a training forward then rounds as the engine scores a prompt,
    whose steps run every row through the dequantized tiles (``quant.prompt_rows``), or
    with ``batch_invariant`` as the engine's invariant steps, every row on the integer path."""
    model = load_model(
        resolved.path, dtype=DTYPES[dtype], device=device, prepack=False, quantization=method
    )
    install_trainable_kernels(model)
    weight_dtype = DTYPES[dtype]
    for module in model.modules():
        if isinstance(module, QuantLinear):
            # A training forward is prompt rows: the tiles' product, which (bf16 or float32
            # from 8 rows) is F.linear on the dequantized weight, kept for every call and for
            # the gradient (the memory the trainer's dense copy took before).
            module.dense_from_rows = 1
            if module.dense is None and not batch_invariant:
                module.dense = module.dequantized(weight_dtype)
    if batch_invariant:
        make_batch_invariant(model)
    return model


def build_engine_sampler(
    engine: EngineClient,
    lora: LoraServing | None,
    training: Callable[[], LoraTrainingBackend],
    names: Sequence[str],
    max_in_engine: int,
) -> EngineSampler | None:
    """Tinker's samples as engine requests, on multi-LoRA serving that reads the training
    run's live weights; None without LoRA serving (the fake runner: no Tinker API)."""
    if lora is None:
        return None
    lora.serve_live_weights(training().peft_state)
    return EngineSampler(engine, lora, names, max_in_engine=max_in_engine)


def build_embeddings(
    resolved: ModelFolder | None, device: str | None, limits: EmbeddingLimits
) -> EmbeddingService | None:
    """``/v1/embeddings`` over our BERT (float32) on the chat model's device; None: no
    embedding model."""
    if resolved is None:
        return None
    embedder = TorchEmbedder.from_folder(resolved.path, device or default_device())
    return EmbeddingService(embedder, resolved.name, limits)
