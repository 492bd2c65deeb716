"""The backend of a fleet's ingress (``infer serve --replicas N``), chosen by
``create_container`` when ``config.fleet.replicas`` is set (imported then: Ray only when
asked for). Its shape is the other backends' (:mod:`entrypoints.backends`) with what makes
the engine remote: the engine is a :class:`RemoteEngine` whose calls go to the replicas
through the engine deployment's handle (``engine_kind`` ``"fleet"``, ``dispatch``, each
replica's circuit breaker in ``breakers``), the
fleet's registry (``fleet``: ``/admin/replicas``, the replicas' ``/metrics``), no Tinker
service here (``tinker_enabled`` False: the replicas run it, the ingress forwards its calls)
but its checkpoints served by path from the shared ``--checkpoint-dir``
(``shared_checkpoints``)."""

import time
from collections.abc import Callable
from functools import partial

from dependency_injector import containers, providers

from adapters.ray.dispatch import HandleDispatch, fault_hook, loop_handle
from adapters.ray.ingress import APP_NAME, ENGINE, FleetView, describe_replicas
from adapters.storage.factory import checkpoint_storage
from adapters.torch.lora.peft import ADAPTER_WEIGHTS, check_folder
from adapters.torch.models.config import ModelConfig
from adapters.weights import ResolvedModel
from application.engine.remote_engine import ReplicaAdapters
from application.serving.served_models import SharedCheckpoints
from application.tinker.checkpoints import CheckpointStore
from domain.breaker import Breakers
from entrypoints.backends import (
    embeddings_provider,
    model_grammar,
    model_tokenizer,
    resolved_model_provider,
    served_names_provider,
)
from entrypoints.config import ServerConfig
from entrypoints.config.replica import ReplicaSettings


def replica_adapters(
    lora_modules: object,
    tinker: bool,
    enable_lora: bool = False,
    model: ResolvedModel | None = None,
    max_lora_rank: int | None = None,
) -> ReplicaAdapters | None:
    """The ingress's view of the replicas' LoRA adapters (the ``--lora-modules`` folders
    loaded at their start, a Tinker checkpoint served by path or an adapter loaded at run
    time loaded by the replica a call goes to, from the folder the call names), each
    folder checked as a replica's load would check it (``model``'s widths from its
    ``config.json``, ``max_lora_rank``: ``--max-lora-rank``) without loading it; None
    without any of them."""
    if not (lora_modules or tinker or enable_lora):
        return None
    if model is None:
        return ReplicaAdapters(ADAPTER_WEIGHTS)
    widths = ModelConfig.from_folder(model.path)
    return ReplicaAdapters(
        ADAPTER_WEIGHTS, partial(check_folder, model=widths, max_rank=max_lora_rank)
    )


def shared_checkpoints(tinker: bool, checkpoint_dir: str | None) -> SharedCheckpoints | None:
    """With Tinker on the replicas: the checkpoints they save, in the folder they share."""
    if not tinker:
        return None
    return SharedCheckpoints(CheckpointStore(checkpoint_storage(checkpoint_dir)))


def joined_order(fleet: FleetView, standby: int) -> Callable[[], list[str]] | None:
    return fleet.joined if standby else None


class RemoteBackend(containers.DeclarativeContainer):
    """A fleet's ingress: the model's names, tokenizer and grammar, and the embeddings it
    serves itself, but no weights and no runner (the replicas hold them); ``described``,
    what a replica measured on the model (its engine config with the KV pool sized there,
    the vocabulary, the pool's bytes), stands in for what loading it would give; the LoRA
    adapters live on the replicas."""

    config = providers.Dependency(instance_of=ServerConfig)
    # The engine deployment's handle, made on the server's event loop at its first call.
    handles = providers.Singleton(loop_handle, ENGINE, APP_NAME)
    described = providers.Singleton(describe_replicas, config.provided.fleet.replica_start_timeout)
    resolved_model = resolved_model_provider(config)
    dtype: providers.Object[None] = providers.Object(None)
    model: providers.Object[None] = providers.Object(None)
    model_name = resolved_model.provided.name
    served_names = served_names_provider(model_name, config)
    engine_config = described.provided["engine_config"]
    kv_cache_bytes = described.provided["kv_cache_bytes"]
    tokenizer = providers.Singleton(model_tokenizer, resolved_model)
    vocab_size = described.provided["vocab_size"]
    grammar = providers.Singleton(model_grammar, resolved_model, vocab_size, tokenizer)
    lora_serving = providers.Singleton(
        replica_adapters,
        config.provided.model.lora_modules,
        config.provided.tinker.enabled,
        config.provided.model.enable_lora,
        resolved_model,
        config.provided.model.max_lora_rank,
    )
    runner: providers.Object[None] = providers.Object(None)
    draft_runner: providers.Object[None] = providers.Object(None)
    step_costs: providers.Object[None] = providers.Object(None)
    embeddings = embeddings_provider(config)

    engine_kind = providers.Object("fleet")
    # The remote engine's transport and each replica's circuit breaker (the container
    # builds the engine: the breakers report to its audit trail and metrics).
    dispatch = providers.Singleton(HandleDispatch, handles)
    breakers = providers.Singleton(
        Breakers,
        providers.Callable(ReplicaSettings.breaker, config.provided.fleet),
        providers.Object(time.monotonic),
    )
    fleet = providers.Singleton(FleetView)
    # The replicas in the order they joined, when some are warm standbys (else None).
    joined = providers.Callable(joined_order, fleet, config.provided.fleet.standby_replicas)
    # Test hooks (INFER_FAULT_INJECTION=1): a replica made to fail every call.
    faults = providers.Singleton(fault_hook, handles)
    tinker_enabled = providers.Object(False)
    shared_checkpoints = providers.Singleton(
        shared_checkpoints,
        config.provided.tinker.enabled,
        config.provided.tinker.checkpoint_dir,
    )
