"""LoRA fine-tuning on our torch models: the :class:`~domain.tinker.ports.TrainingBackend` port.

A base model is loaded once (lazily, unpacked: plain frozen linears) and shared by every
adapter on it. Its target linears are swapped for :class:`LoraLinear` modules, which add the
low-rank update of whichever adapter is active during a call: ``y = W x + s * B (A x)``
with ``s = LORA_ALPHA / rank`` (PEFT's scaling). Fused projections carry one ``(A, B)`` per
HF projection they hold (``wqkv``: q, k, v; ``w13``: gate, up), so adapters map one to one
onto PEFT's ``q_proj`` / ``gate_proj`` / ... and checkpoints load in PEFT unchanged.

A and B are float32 whatever the base dtype; A starts like PEFT's (kaiming-uniform, a=√5,
i.e. ``U(-1/√in, 1/√in)``, from ``lora.seed``), B at zero, so a fresh adapter is the base
model. Training forwards run the whole sequence causally from position 0 with no cache;
data are right-padded into micro-batches (padding sits after every real token, so causal
attention never sees it) and only real positions enter the loss (see ``lora_losses``).
Data sharing a long token prefix (an RL group: one prompt, several samples) are packed
instead: the prefix's rows run once, each datum's own rows attend to them and to its own
(:func:`~adapters.torch.lora.forward.shared_prefix_packs`,
``Transformer.packed_hidden_states``); the same logprobs and
gradients, fewer rows through the model and the LM head.
"""

import ctypes
import ctypes.util
import gc
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from adapters.torch.loading.loader import load_model
from adapters.torch.lora import peft
from adapters.torch.lora.custom_loss import custom_loss_sum
from adapters.torch.lora.dimuon import Dimuon
from adapters.torch.lora.forward import (
    micro_batches,
    prepare,
    target_logprobs,
    tensor_value,
)
from adapters.torch.lora.losses import loss_sum
from adapters.torch.lora.peft import ADAPTER_WEIGHTS, LORA_ALPHA, read_lora_spec
from adapters.torch.models.config import ModelConfig
from adapters.torch.models.transformer import Transformer
from adapters.torch.quant import QuantLinear
from domain.tinker.batch import ForwardBackwardInput, ForwardBackwardResult
from domain.tinker.checks import loss_config
from domain.tinker.custom_loss import reduce_metrics
from domain.tinker.errors import InvalidTrainingRequest, NotFoundError
from domain.tinker.ports import Steps, TrainingBackend
from domain.tinker.values import (
    LOSS_INPUTS,
    AdamParams,
    BaseModelInfo,
    DimuonParams,
    LoraSpec,
    OptimizerFamily,
    optimizer_of,
)

OPTIMIZER_STATE = "optimizer.safetensors"


@dataclass(frozen=True)
class BaseModelEntry:
    """A served base model: its HF folder (config.json + safetensors), the name clients
    use, other accepted names, its tokenizer folder (default: ``folder``) and the dtype its
    frozen weights are held in (bf16: fast on CPU; float32 for exact parity)."""

    name: str
    folder: Path
    aliases: tuple[str, ...] = ()
    tokenizer_folder: Path | None = None
    dtype: torch.dtype = torch.bfloat16
    # The context clients may use (e.g. the serving engine's max_model_len); None: the model's.
    max_context: int | None = None
    random_weights: bool = False  # a config-only folder (``dummy:`` models, benchmarks)
    device: str = "cpu"  # where the base model and the adapters train ("cuda", ...)
    # The frozen model as the serving engine builds its own (its quantized linears and
    # CPU kernels, trainable through them: a forward's logprobs then round as a sample's
    # prompt logprobs); None: loaded here from ``folder`` in ``dtype``, its linears plain.
    loader: Callable[[], Transformer] | None = field(default=None, compare=False)


class LoraLinear(nn.Module):
    """A frozen linear plus the active adapter's update on each of its output slices.

    ``parts`` are the PEFT module names of the slices, in row order; ``lora`` is set per
    call: one ``(A [r, in], B [rows, r])`` per part, or None for the base linear alone.
    """

    def __init__(self, base: nn.Linear | QuantLinear, parts: tuple[str, ...]) -> None:
        super().__init__()
        self.base, self.parts = base, parts
        self.lora: list[tuple[Tensor, Tensor]] | None = None
        self.scale = 0.0

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        if self.lora is None:
            return y
        a = torch.cat([a for a, _ in self.lora])  # [parts * r, in]
        if y.dtype == torch.float32:  # the exact float32 update
            b = torch.block_diag(*[b for _, b in self.lora])  # [out, parts * r]
            return y + F.linear(F.linear(x.float(), a) * self.scale, b)
        # bf16 activations: the rank-r activations in float32 (the adapter's precision), then
        # each part's B in bf16 — the wide products write half the bytes and use the fast
        # kernels (one step of SmolLM2 training ~12 % faster than all in float32).
        z = (F.linear(x.float(), a) * self.scale).to(y.dtype)
        r = self.lora[0][0].shape[0]
        deltas = [
            F.linear(z[..., i * r : (i + 1) * r], b.to(y.dtype))
            for i, (_, b) in enumerate(self.lora)
        ]
        return y + (deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1))


class _Base:
    """A loaded base model and its LoRA sites, by PEFT module name."""

    def __init__(self, entry: BaseModelEntry, model: Transformer) -> None:
        self.entry, self.model, self.config = entry, model, model.config
        self.sites = _install_sites(model)
        self.shapes: dict[str, tuple[int, int]] = {}  # PEFT name -> (in, out)
        for site in self.sites:
            rows = peft.part_rows(model.config, site.parts)
            for name, out in zip(site.parts, rows, strict=True):
                self.shapes[name] = (site.base.in_features, out)

    @contextmanager
    def active(self, adapter: "_TrainedAdapter") -> Iterator[None]:
        for site in self.sites:
            weights = [adapter.weights[name] for name in site.parts if name in adapter.weights]
            site.lora = weights or None
            site.scale = adapter.scale
        try:
            yield
        finally:
            for site in self.sites:
                site.lora = None


class _TrainedAdapter:
    """One model id's trainable weights (PEFT name -> (A, B)) and its optimizer (AdamW or
    Dimuon) state."""

    def __init__(self, base: _Base, spec: LoraSpec) -> None:
        self.base, self.spec = base, spec
        self.scale = LORA_ALPHA / spec.rank
        self.targets = peft.targets(spec)
        generator = torch.Generator()
        if spec.seed is None:
            generator.seed()
        else:
            generator.manual_seed(spec.seed)
        self.weights: dict[str, tuple[Tensor, Tensor]] = {}
        device = base.model.embed_tokens.weight.device
        for name in sorted(base.shapes):
            if name.rsplit(".", 1)[-1] in self.targets:
                fan_in, out = base.shapes[name]
                bound = fan_in**-0.5  # kaiming_uniform_(a=sqrt(5)), as PEFT initialises A
                # Drawn on the CPU: the same adapter for a seed whatever the device.
                a = ((torch.rand(spec.rank, fan_in, generator=generator) * 2 - 1) * bound).to(
                    device
                )
                b = torch.zeros(out, spec.rank, device=device)
                self.weights[name] = (a.requires_grad_(), b.requires_grad_())
        self.optimizer = self.new_optimizer()

    @property
    def params(self) -> list[Tensor]:
        return [t for pair in self.weights.values() for t in pair]

    def new_optimizer(self, family: OptimizerFamily = "adamw") -> torch.optim.Optimizer:
        return Dimuon(self.params) if family == "dimuon" else torch.optim.AdamW(self.params)

    @property
    def family(self) -> OptimizerFamily:
        return "dimuon" if isinstance(self.optimizer, Dimuon) else "adamw"

    def optimizer_for(self, params: AdamParams | DimuonParams) -> torch.optim.Optimizer:
        """The optimizer of ``params``' family with their hyperparameters: a new one where
        the current one is of the other family and has no state yet."""
        family = optimizer_of(params)
        if family != self.family:
            if self.optimizer.state:
                raise InvalidTrainingRequest(
                    f"this model steps with {self.family} (its optimizer state is of it); "
                    f"{family} parameters were given"
                )
            self.optimizer = self.new_optimizer(family)
        for group in self.optimizer.param_groups:
            if isinstance(params, DimuonParams):
                group.update(lr=params.learning_rate, beta1=params.beta1)
            else:
                group.update(
                    lr=params.learning_rate,
                    betas=(params.beta1, params.beta2),
                    eps=params.eps,
                    weight_decay=params.weight_decay,
                )
        return self.optimizer

    def state_dict(self) -> dict[str, Tensor]:
        """PEFT's ``adapter_model.safetensors`` content."""
        state = {}
        for name, (a, b) in self.weights.items():
            state[peft.tensor_key(name, "A")] = a.detach().cpu().clone()
            state[peft.tensor_key(name, "B")] = b.detach().cpu().clone()
        return state


class LoraTrainingBackend(TrainingBackend):
    """LoRA adapters on our torch models for the Tinker face; see the module docstring.

    Calls are serialized by one lock (a step of one model at a time); a base model is
    loaded on the first ``create`` on it and kept.
    """

    def __init__(self, models: Sequence[BaseModelEntry]) -> None:
        self._entries = {name: e for e in models for name in (e.name, *e.aliases)}
        self._models = list(models)
        self._bases: dict[str, _Base] = {}
        self._adapters: dict[str, _TrainedAdapter] = {}
        self._lock = threading.Lock()

    @cached_property
    def base_models(self) -> Sequence[BaseModelInfo]:
        infos = []
        for entry in self._models:
            config = ModelConfig.from_folder(entry.folder)
            infos.append(
                BaseModelInfo(
                    name=entry.name,
                    max_context_length=min(
                        config.max_position_embeddings,
                        entry.max_context or config.max_position_embeddings,
                    ),
                    arch=config.arch,
                    tokenizer_id=str(entry.tokenizer_folder or entry.folder),
                    aliases=entry.aliases,
                )
            )
        return infos

    def create(self, model_id: str, base_model: str, lora: LoraSpec) -> None:
        if lora.rank < 1:
            raise InvalidTrainingRequest(f"rank: must be at least 1, got {lora.rank}")
        if not peft.targets(lora):
            raise InvalidTrainingRequest(
                "lora: train_mlp, train_attn and train_unembed are all off: nothing to train"
            )
        with self._lock:
            if model_id in self._adapters:
                raise InvalidTrainingRequest(f"model {model_id!r} already exists")
            self._adapters[model_id] = _TrainedAdapter(self._base(base_model), lora)

    def forward_backward_steps(
        self, model_id: str, batch: ForwardBackwardInput, *, backward: bool
    ) -> Steps[ForwardBackwardResult]:
        """One micro-batch per piece. Between pieces nothing of this call is held (the
        lock, the active adapter, autograd's state): other models run in between."""
        data, loss_fn = batch.data, batch.loss_fn
        config = loss_config(loss_fn, batch.loss_fn_config)
        with self._lock:
            adapter = self._adapter(model_id)
            if not data:
                raise InvalidTrainingRequest("data: empty (at least one datum is needed)")
            prepared = [prepare(adapter.base.config, i, d, loss_fn) for i, d in enumerate(data)]
        logprobs: list[Tensor] = [torch.empty(0)] * len(data)
        total = 0.0
        metric_sums: dict[str, float] = {}  # a custom loss's metrics, summed over data
        for n, (group, packs) in enumerate(micro_batches(prepared)):
            if n:
                yield  # another model's turn may come here
            with self._lock:
                adapter = self._adapter(model_id)  # NotFoundError if released meanwhile
                with adapter.base.active(adapter), torch.set_grad_enabled(backward):
                    logp = target_logprobs(adapter.base.model, [prepared[i] for i in group], packs)
                    device = logp.device
                    inputs = {
                        key: torch.cat([prepared[i].inputs[key] for i in group]).to(device)
                        for key in LOSS_INPUTS[loss_fn]
                    }
                    if loss_fn == "gspo":  # each position's datum: one ratio per datum
                        inputs["segment"] = torch.cat(
                            [torch.full((len(prepared[i].tokens),), j) for j, i in enumerate(group)]
                        ).to(device)
                    if batch.custom_loss is not None:  # a stored loss, datum by datum
                        loss, sums = custom_loss_sum(batch.custom_loss, logp, data, group)
                        for key, value in sums.items():
                            metric_sums[key] = metric_sums.get(key, 0.0) + value
                    else:
                        loss = loss_sum(loss_fn, logp, inputs, config)
                    if backward and loss.requires_grad:  # a custom loss may ignore logp
                        loss.backward()
                    total += loss.item()
                    pieces = logp.detach().cpu().split([len(prepared[i].tokens) for i in group])
                    for i, piece in zip(group, pieces, strict=True):
                        logprobs[i] = piece
                del logp, inputs, loss
        outputs = [{"logprobs": tensor_value(lp)} for lp in logprobs]
        metrics = {"loss:sum": total, **reduce_metrics(metric_sums, len(data))}
        return ForwardBackwardResult(outputs=outputs, metrics=metrics)

    def optim_step(self, model_id: str, params: AdamParams | DimuonParams) -> dict[str, float]:
        with self._lock:
            adapter = self._adapter(model_id)
            optimizer = adapter.optimizer_for(params)
            for p in adapter.params:
                if p.grad is None:  # no forward_backward since the last step: a zero gradient
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in adapter.params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
            if params.grad_clip_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(adapter.params, params.grad_clip_norm, norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": float(norm), "learning_rate:mean": params.learning_rate}

    def save(self, model_id: str, folder: Path, *, optimizer: bool) -> None:
        with self._lock:
            adapter = self._adapter(model_id)
            _write_peft(adapter, folder)
            if optimizer:
                save_file(_optimizer_state(adapter), str(folder / OPTIMIZER_STATE))

    def load(self, model_id: str, folder: Path, *, optimizer: bool) -> None:
        spec = read_lora_spec(folder)
        with self._lock:
            adapter = self._adapter(model_id)
            if (spec.rank, peft.targets(spec)) != (adapter.spec.rank, adapter.targets):
                raise InvalidTrainingRequest(
                    f"the checkpoint is rank {spec.rank} on {sorted(peft.targets(spec))}, "
                    f"model {model_id!r} is rank {adapter.spec.rank} on {sorted(adapter.targets)}"
                )
            tensors = _read_tensors(folder / ADAPTER_WEIGHTS)
            state = _checked_state(tensors, adapter.state_dict(), folder / ADAPTER_WEIGHTS)
            with torch.no_grad():
                for name, (a, b) in adapter.weights.items():
                    a.copy_(state[peft.tensor_key(name, "A")])
                    b.copy_(state[peft.tensor_key(name, "B")])
            adapter.optimizer = adapter.new_optimizer()
            if optimizer:
                _load_optimizer(adapter, _read_tensors(folder / OPTIMIZER_STATE), folder)

    def release(self, model_id: str) -> None:
        with self._lock:
            adapter = self._adapters.pop(model_id, None)
            if adapter is None:
                return
            device = adapter.base.model.embed_tokens.weight.device
            # Drop every tensor now (weights, gradients, AdamW moments), not when the last
            # stray reference goes, then hand the freed memory back to the system.
            adapter.optimizer.state.clear()
            adapter.weights.clear()
            del adapter
        release_memory(device)

    def peft_state(self, model_id: str) -> tuple[dict[str, Tensor], float]:
        """A copy of the adapter's current weights (PEFT names) and its alpha / r scale:
        what a sampler on the live weights loads."""
        with self._lock:
            adapter = self._adapter(model_id)
            return adapter.state_dict(), adapter.scale

    def _adapter(self, model_id: str) -> _TrainedAdapter:
        adapter = self._adapters.get(model_id)
        if adapter is None:
            raise NotFoundError(f"no training model {model_id!r}")
        return adapter

    def _base(self, name: str) -> _Base:
        entry = self._entries.get(name)
        if entry is None:
            served = ", ".join(e.name for e in self._models)
            raise NotFoundError(f"base_model: unknown model {name!r} (served: {served})")
        if entry.name not in self._bases:
            model = (
                entry.loader()
                if entry.loader is not None
                else load_model(
                    entry.folder,
                    dtype=entry.dtype,
                    prepack=False,
                    random_weights=entry.random_weights,
                    device=entry.device,
                )
            )
            self._bases[entry.name] = _Base(entry, model)
        return self._bases[entry.name]


def release_memory(device: torch.device | None = None) -> None:
    """Collect garbage and return freed memory to the system: the CUDA cache, and glibc's
    free heap pages (freed tensors otherwise stay in the process's RSS)."""
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return cast(Callable[[int], int], libc.malloc_trim)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None


# --- model surgery ----------------------------------------------------------------------


def _install_sites(model: Transformer) -> list[LoraLinear]:
    """Swap every linear LoRA may target for a :class:`LoraLinear` (inert until active)."""
    sites = []
    for path, parts in peft.site_parts(model.config.num_layers):
        base = model.get_submodule(path)
        assert isinstance(base, nn.Linear | QuantLinear), path
        site = LoraLinear(base, parts)
        model.set_submodule(path, site)
        sites.append(site)
    return sites


# --- optimizer --------------------------------------------------------------------------


# The optimizer state file's tensors per LoRA tensor, by family (and the torch state keys).
_STATE_KEYS: dict[OptimizerFamily, tuple[str, ...]] = {
    "adamw": ("exp_avg", "exp_avg_sq"),
    "dimuon": ("momentum_buffer",),
}


def _optimizer_state(adapter: _TrainedAdapter) -> dict[str, Tensor]:
    """The optimizer's state per LoRA tensor, keyed like the adapter's PEFT weights: AdamW's
    moments or Dimuon's momentum, and the step count."""
    state: dict[str, Tensor] = {}
    for key, p in zip(adapter.state_dict(), adapter.params, strict=True):
        s = adapter.optimizer.state.get(p, {})
        if adapter.family == "dimuon":
            for name in _STATE_KEYS["dimuon"]:
                state[f"{key}.{name}"] = s.get(name, torch.zeros_like(p)).detach().cpu().clone()
            state[f"{key}.step"] = torch.tensor([float(s.get("step", 0.0))], dtype=torch.float32)
            continue
        state[f"{key}.exp_avg"] = s.get("exp_avg", torch.zeros_like(p)).detach().cpu().clone()
        state[f"{key}.exp_avg_sq"] = s.get("exp_avg_sq", torch.zeros_like(p)).detach().cpu().clone()
        state[f"{key}.step"] = torch.tensor([float(s.get("step", 0.0))], dtype=torch.float32)
    return state


def _load_optimizer(adapter: _TrainedAdapter, tensors: dict[str, Tensor], folder: Path) -> None:
    """The saved state into a new optimizer of its family (Dimuon's file has momenta)."""
    dimuon = any(k.endswith(".momentum_buffer") for k in tensors)
    family: OptimizerFamily = "dimuon" if dimuon else "adamw"
    names = _STATE_KEYS[family]
    expected: dict[str, Tensor] = {}
    for key, p in zip(adapter.state_dict(), adapter.params, strict=True):
        expected |= {f"{key}.{name}": p for name in names} | {f"{key}.step": torch.zeros(1)}
    state = _checked_state(tensors, expected, folder / OPTIMIZER_STATE)
    adapter.optimizer = adapter.new_optimizer(family)
    saved = adapter.optimizer.state_dict()
    saved["state"] = {
        i: {"step": state[f"{key}.step"][0].clone()}
        | {name: state[f"{key}.{name}"] for name in names}
        for i, key in enumerate(adapter.state_dict())
    }
    adapter.optimizer.load_state_dict(saved)


# --- checkpoint files -------------------------------------------------------------------


def _write_peft(adapter: _TrainedAdapter, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(adapter.state_dict(), str(folder / ADAPTER_WEIGHTS))
    peft.write_config(
        folder,
        base_model=adapter.base.entry.name,
        rank=adapter.spec.rank,
        modules=adapter.targets,
    )


def _read_tensors(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise InvalidTrainingRequest(f"{path.name}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise InvalidTrainingRequest(f"{path.name}: unreadable") from e


def _checked_state(
    tensors: Mapping[str, Tensor], expected: Mapping[str, Tensor], path: Path
) -> dict[str, Tensor]:
    """``tensors`` as float32 if they have exactly ``expected``'s keys and shapes."""
    missing, unexpected = set(expected) - set(tensors), set(tensors) - set(expected)
    if missing or unexpected:
        raise InvalidTrainingRequest(
            f"{path.name}: tensors do not match the model (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )
    for key, want in expected.items():
        if tensors[key].shape != want.shape:
            raise InvalidTrainingRequest(
                f"{path.name}: {key} has shape {list(tensors[key].shape)}, "
                f"expected {list(want.shape)}"
            )
    return {key: t.float() for key, t in tensors.items()}
