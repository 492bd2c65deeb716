"""Many LoRA adapters at once in the serving engine (multi-LoRA batching).

Each linear LoRA can target (``wqkv``, ``wo``, ``w13``, ``w2``, ``lm_head``) is wrapped once
in a :class:`MultiLoraLinear`: the base linear (plain or CPU-packed) runs for every token,
then each adapter present in the step adds ``(x_g @ A^T) @ B^T`` to its own tokens ``g`` —
one gather, two thin matmuls and one scatter-add per adapter and linear. A step without
adapters costs nothing extra; a step with some keeps one forward for the whole batch.

Adapters come in PEFT's format (:mod:`adapters.torch.lora.peft`), what the LoRA training
backend writes. The fused projections get one ``A`` (the parts' A
stacked) and one block-diagonal ``B`` (scaled by alpha / r) per adapter, built at load.
While any adapter is routed, the fused C++ decode layer (which reads the base weights
directly) is set aside for that step.
"""

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from adapters.torch.lora import peft
from adapters.torch.lora.peft import ADAPTER_WEIGHTS
from adapters.torch.models.config import ModelConfig
from adapters.torch.models.transformer import Transformer
from domain.tinker.errors import InvalidTrainingRequest

Route = tuple[Tensor, Tensor, Tensor]  # token indices [n], A [R, in], B [out, R] (scaled)
# A training run's current adapter by model id: PEFT-named tensors and the alpha / r scale.
LiveState = Callable[[str], tuple[dict[str, Tensor], float]]


class MultiLoraLinear(nn.Module):
    """A linear plus per-token LoRA updates; ``routes`` is set for one step at a time."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.routes: list[Route] = []

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        if not self.routes:
            return y
        flat_x = x.reshape(-1, x.shape[-1])
        flat_y = y.reshape(-1, y.shape[-1])
        for index, a, b in self.routes:
            rows = flat_x.index_select(0, index).to(a.dtype)
            flat_y.index_add_(0, index, ((rows @ a.T) @ b.T).to(y.dtype))
        return flat_y.view(y.shape)


class _ServedAdapter:
    """One adapter's fused (A, B) per site path; B carries the alpha / r scale."""

    def __init__(self, sites: dict[str, tuple[Tensor, Tensor]]) -> None:
        self.sites = sites
        self.bytes = sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in sites.values()
        )


class LoraServing:
    """The adapters a serving model can apply, by id (least recently used evicted): the
    :class:`~domain.tinker.ports.ServingAdapters` port. ``live_state`` gives a training run's
    current weights (the LoRA training backend's ``peft_state``), for :meth:`add_live`."""

    def __init__(
        self,
        model: Transformer,
        *,
        max_adapters: int = 16,
        live_state: LiveState | None = None,
        max_rank: int | None = None,
    ) -> None:
        """``max_rank``: the highest LoRA rank a folder may load with (None: any)."""
        self.model = model
        self.max_rank = max_rank
        self.live_state = live_state
        self.config: ModelConfig = model.config
        self.max_adapters = max_adapters
        self.sites: dict[str, MultiLoraLinear] = {}
        self.parts: dict[str, tuple[str, ...]] = {}  # site path -> PEFT module names
        for path, parts in peft.site_parts(self.config.num_layers):
            self.parts[path] = parts
            site = MultiLoraLinear(model.get_submodule(path))
            model.set_submodule(path, site)
            self.sites[path] = site
        self._adapters: OrderedDict[str, _ServedAdapter] = OrderedDict()
        self._pinned: dict[str, int] = {}
        self._removing: set[str] = set()  # removed while pinned: dropped at the last unpin
        weight = model.embed_tokens.weight
        self.device = weight.device
        # LoRA math in float32 on CPU (bf16 matmuls of thin shapes gain nothing there).
        self.dtype = torch.float32 if weight.device.type == "cpu" else weight.dtype

    def serve_live_weights(self, live_state: LiveState) -> None:
        """Take training runs' current weights from ``live_state`` (the LoRA training
        backend's ``peft_state``), for :meth:`add_live`: Tinker's sampler is built after
        the runner that holds this serving."""
        self.live_state = live_state

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def loaded(self) -> list[str]:
        """The ids of the adapters loaded (not evicted), least recently used first."""
        return list(self._adapters)

    def weights_file(self, folder: Path) -> Path:
        return folder / ADAPTER_WEIGHTS

    def load_folder(self, adapter_id: str, folder: Path) -> None:
        """Load a PEFT adapter folder under ``adapter_id`` (kept until evicted)."""
        config = peft.read_config(folder)
        peft.check_rank(config, self.max_rank)
        try:
            scale = peft.scale(config)
            state = load_file(str(folder / ADAPTER_WEIGHTS))
        except (OSError, ValueError) as e:  # named without the server's path
            raise InvalidTrainingRequest("the checkpoint is not a readable LoRA adapter") from e
        self.add(adapter_id, state, scale)

    def add_live(self, adapter_id: str, model_id: str) -> None:
        """Add a copy of training run ``model_id``'s current weights."""
        if self.live_state is None:
            raise InvalidTrainingRequest("sampling live training weights is not available")
        state, scale = self.live_state(model_id)
        self.add(adapter_id, state, scale)

    def add(self, adapter_id: str, state: Mapping[str, Tensor], scale: float) -> None:
        """Add (or replace) an adapter from PEFT-named tensors
        (``base_model.model.<module>.lora_A.weight`` / ``lora_B``)."""
        pairs = peft.module_pairs(state)
        sites = {}
        for path in self.sites:
            fused = self._fuse(path, pairs, scale)
            if fused is not None:
                sites[path] = fused
        if not sites:
            raise InvalidTrainingRequest(f"adapter {adapter_id!r} targets no module of this model")
        self._adapters[adapter_id] = _ServedAdapter(sites)
        self._removing.discard(adapter_id)
        self._adapters.move_to_end(adapter_id)
        self._evict()

    def remove(self, adapter_id: str) -> None:
        """Drop ``adapter_id`` (once the requests pinning it have ended)."""
        if adapter_id in self._pinned:
            self._removing.add(adapter_id)
        else:
            self._adapters.pop(adapter_id, None)

    @contextmanager
    def pinned(self, adapter_id: str) -> Iterator[None]:
        """Keep ``adapter_id`` loaded (not evicted) while requests use it."""
        self._pinned[adapter_id] = self._pinned.get(adapter_id, 0) + 1
        try:
            yield
        finally:
            self._pinned[adapter_id] -= 1
            if not self._pinned[adapter_id]:
                del self._pinned[adapter_id]
                if adapter_id in self._removing:
                    self._removing.discard(adapter_id)
                    self._adapters.pop(adapter_id, None)

    @contextmanager
    def route(
        self, token_adapters: Sequence[str | None], logit_adapters: Sequence[str | None]
    ) -> Iterator[None]:
        """Apply each token's adapter (the model's flat token order) and each logit row's
        (the rows passed to ``lm_head``) for one forward, which the runner runs through
        the layers' modules (``PagedBatch(fused=False)``: the decode kernels know no LoRA)."""
        token_groups = _groups(token_adapters, self.device)
        logit_groups = _groups(logit_adapters, self.device)
        if not token_groups and not logit_groups:
            yield
            return
        for adapter_id in {*token_groups, *logit_groups}:
            if adapter_id not in self._adapters:
                raise RuntimeError(f"LoRA adapter {adapter_id!r} is not loaded")
            self._adapters.move_to_end(adapter_id)
        try:
            for path, site in self.sites.items():
                groups = logit_groups if path == "lm_head" else token_groups
                site.routes = [
                    (index, *self._adapters[adapter_id].sites[path])
                    for adapter_id, index in groups.items()
                    if path in self._adapters[adapter_id].sites
                ]
            yield
        finally:
            for site in self.sites.values():
                site.routes = []

    def _fuse(
        self, path: str, pairs: Mapping[str, peft.Pair], scale: float
    ) -> tuple[Tensor, Tensor] | None:
        names = self.parts[path]
        parts = list(zip(names, peft.part_rows(self.config, names), strict=True))
        found = [(name, pairs.get(name)) for name, _ in parts]
        if all(pair is None for _, pair in found):
            return None
        a_blocks, b_blocks = [], []
        for (name, rows), (_, pair) in zip(parts, found, strict=True):
            features = peft.in_features(self.config, path)
            if pair is None:  # an untargeted slice of a fused projection: no update
                a_blocks.append(torch.zeros(0, features))
                b_blocks.append(torch.zeros(rows, 0))
                continue
            a, b = pair
            peft.check_pair(
                name,
                None if a is None else a.shape,
                None if b is None else b.shape,
                features,
                rows,
            )
            assert a is not None and b is not None  # checked
            a_blocks.append(a.float())
            b_blocks.append(b.float())
        a_cat = torch.cat(a_blocks)
        b_diag = torch.block_diag(*b_blocks) * scale
        return (
            a_cat.to(self.device, self.dtype).contiguous(),
            b_diag.to(self.device, self.dtype).contiguous(),
        )

    def _evict(self) -> None:
        while len(self._adapters) > self.max_adapters:
            victim = next((k for k in self._adapters if k not in self._pinned), None)
            if victim is None:
                return
            del self._adapters[victim]


def _groups(adapters: Sequence[str | None], device: torch.device) -> dict[str, Tensor]:
    rows: dict[str, list[int]] = {}
    for i, adapter_id in enumerate(adapters):
        if adapter_id is not None:
            rows.setdefault(adapter_id, []).append(i)
    return {k: torch.tensor(v, dtype=torch.long, device=device) for k, v in rows.items()}
