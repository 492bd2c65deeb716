"""The fine-tuning half's ports: the training and sampling backends, the engine's LoRA
serving, the checkpoint storage; and ``Steps``, work a backend does in pieces."""

from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol, TypeVar

from domain.tinker.batch import ForwardBackwardInput, ForwardBackwardResult
from domain.tinker.values import (
    AdamParams,
    BaseModelInfo,
    CheckpointKind,
    CheckpointRecord,
    DimuonParams,
    LoraSpec,
    RunRecord,
    SampleRequest,
    TinkerSampleResult,
    WeightsSource,
)

T = TypeVar("T")


# Work in pieces: each ``next()`` runs one piece; the value comes with StopIteration.
Steps = Generator[None, None, T]


def run_steps(steps: "Steps[T]") -> T:
    """Run every piece of ``steps`` now; its value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def one_step(fn: Callable[[], T]) -> "Steps[T]":
    """``fn()`` as work of a single piece."""
    yield from ()
    return fn()


class TrainingBackend(Protocol):
    """Holds trainable adapters by model id and runs their training steps.

    Calls for one model arrive one at a time in ``seq_id`` order (the TrainingController
    guarantees it), from a worker thread. Implementations: the numpy ToyBackend and the
    LoRA backend on our torch models. A forward/backward can run in pieces
    (:meth:`forward_backward_steps`) so that other models' work takes turns with a long one;
    an implementation that subclasses this protocol gets :meth:`forward_backward` (all the
    pieces at once) from it.
    """

    @property
    def base_models(self) -> Sequence[BaseModelInfo]: ...

    def create(self, model_id: str, base_model: str, lora: LoraSpec) -> None:
        """A fresh adapter (deterministic for a given ``lora.seed``)."""
        ...

    def forward_backward(
        self, model_id: str, batch: ForwardBackwardInput, *, backward: bool
    ) -> ForwardBackwardResult:
        """Loss and per-token target logprobs; with ``backward`` also adds the loss's
        gradients to the adapter's accumulated gradients."""
        return run_steps(self.forward_backward_steps(model_id, batch, backward=backward))

    def forward_backward_steps(
        self, model_id: str, batch: ForwardBackwardInput, *, backward: bool
    ) -> Steps[ForwardBackwardResult]:
        """:meth:`forward_backward` in pieces (micro-batches): between two pieces the caller
        may run other models' calls (never this model's), from any one thread at a time."""
        ...

    def optim_step(self, model_id: str, params: AdamParams | DimuonParams) -> dict[str, float]:
        """One AdamW or Dimuon step (by ``params``' type) on the accumulated gradients,
        which it then clears. ``params`` are checked (:func:`check_adam`,
        :func:`check_dimuon`) by the caller, who keeps one family per run; a model whose
        optimizer state is of the other family raises ``InvalidTrainingRequest``."""
        ...

    def save(self, model_id: str, folder: Path, *, optimizer: bool) -> None:
        """Write the adapter into ``folder`` — for the LoRA backend in PEFT's format
        (``adapter_model.safetensors`` + ``adapter_config.json``), so a checkpoint is also a
        download — and the optimizer state too when ``optimizer``."""
        ...

    def load(self, model_id: str, folder: Path, *, optimizer: bool) -> None:
        """Replace the adapter's weights (and optimizer state) with ``folder``'s."""
        ...

    def release(self, model_id: str) -> None:
        """Forget the model and give its memory back (adapter, gradients, optimizer
        state). Unknown ids are ignored."""
        ...


class SamplingBackend(Protocol):
    """Samples from a base model with optional adapter weights applied per request."""

    async def sample(
        self, source: WeightsSource, request: SampleRequest, *, tenant: str = ""
    ) -> TinkerSampleResult:
        """``request``'s sequences from ``source``'s weights. ``tenant``: who asks (an API
        key's owner id), so backends that share capacity can let tenants take turns."""
        ...


class ServingAdapters(Protocol):
    """The LoRA adapters the serving engine's runner can apply, by adapter id (what a
    request's ``adapter_id`` names). Loading and the tensors stay in the adapter; the
    Tinker sampler only names folders, training runs and ids."""

    def __contains__(self, adapter_id: object) -> bool: ...

    def weights_file(self, folder: Path) -> Path:
        """The file in a checkpoint ``folder`` whose identity (path, mtime, size) tells
        one save of the checkpoint from another."""
        ...

    def load_folder(self, adapter_id: str, folder: Path) -> None:
        """Load the checkpoint in ``folder`` under ``adapter_id`` (kept until evicted)."""
        ...

    def add_live(self, adapter_id: str, model_id: str) -> None:
        """Add a copy of training run ``model_id``'s current weights under ``adapter_id``
        (``InvalidTrainingRequest`` where live weights are not available)."""
        ...

    def remove(self, adapter_id: str) -> None: ...

    def pinned(self, adapter_id: str) -> AbstractContextManager[None]:
        """Keep ``adapter_id`` loaded (not evicted) while requests use it."""
        ...


class CheckpointStorage(Protocol):
    """Durable runs and checkpoints (a folder per checkpoint), surviving restarts.

    Checkpoints are written into a scratch folder from :meth:`scratch` and published by
    :meth:`commit` in one atomic step, so a crash never leaves half a checkpoint listed,
    and an overwrite never leaves neither the old nor the new one listed.
    """

    def load_all(self) -> tuple[list[RunRecord], list[CheckpointRecord]]: ...

    def load(self, run_id: str, kind: CheckpointKind, name: str) -> CheckpointRecord | None:
        """One checkpoint's record as stored now (None: none), e.g. one another process
        sharing the storage saved."""
        ...

    def save_run(self, run: RunRecord) -> None: ...

    def scratch(self) -> Path:
        """A new empty folder to write a checkpoint into."""
        ...

    def commit(self, scratch: Path, record: CheckpointRecord, *, overwrite: bool) -> None:
        """Publish ``scratch`` as ``record``'s folder (its size filled in by the caller)."""
        ...

    def discard(self, scratch: Path) -> None: ...

    def folder(self, run_id: str, kind: CheckpointKind, name: str) -> Path: ...

    def delete(self, record: CheckpointRecord) -> None: ...

    def update(self, record: CheckpointRecord) -> None:
        """Rewrite a checkpoint's metadata (ttl, public)."""
        ...

    def secret(self) -> bytes:
        """A random key kept with the checkpoints (created once, readable by the owner
        only), for signing download links that stay valid across restarts."""
        ...
