"""The parts of the server that change with what runs the model: two kinds of
sub-container, each chosen once by ``create_container`` (:mod:`entrypoints.container`) and
handed in by tests instead (``create_container(config, backend=FakeBackend(runner=...))``,
as cosmicpython's bootstrap takes its fakes). Kinds of one sort have the same providers.

A **backend** (``config.model.runner``): :class:`TorchBackend` (``torch``) loads the
model; :class:`FakeBackend` (``fake``) loads nothing (both :class:`OneProcess`: the engine
runs here); ``--replicas`` chooses a fleet ingress's :class:`RemoteBackend`
(:mod:`entrypoints.fleet_backend`): the model's tokenizer and names, no weights, what a
replica measured in their place, the engine on the replicas.

==================  ====================================================================
provider            what it gives (None where the backend has none)
==================  ====================================================================
``config``          the :class:`ServerConfig` (``create_container`` gives it)
``resolved_model``  the model's folder
``dtype``           the weights' dtype name (``--dtype auto`` resolved once)
``model``           the loaded :class:`Transformer`
``model_name``      the model's own name (``/v1/models``' root)
``served_names``    the served name, then Tinker's aliases
``engine_config``   the :class:`EngineConfig`: the engine's flags, the KV pool sized on
                    the model (by ``--kv-cache-memory`` when given)
``kv_cache_bytes``  the KV pool's bytes (0: unknown)
``tokenizer``       the ``Tokenizer`` port
``vocab_size``      the model's vocabulary (None: the tokenizer's)
``grammar``         the ``GrammarCompiler`` (None: structured outputs are refused)
``lora_serving``    multi-LoRA serving (for Tinker and ``--lora-modules``)
``runner``          the ``ModelRunner`` port
``draft_runner``    the draft model's ``ModelRunner`` (``--speculative-config`` naming a
                    ``model``; else None)
``step_costs``      what the runner's steps cost by shape (``StepCosts``; None: unknown)
``embeddings``      ``/v1/embeddings``' service (without ``--embedding-model``: None)
``engine_kind``     ``"local"`` (an ``AsyncEngine`` here) or ``"fleet"`` (the backend's
                    ``remote_engine``)
``fleet``           a fleet's registry as the ingress reads it (``FleetView``)
``tinker_enabled``  whether the Tinker service runs here (not on a fleet's ingress)
``shared_checkpoints``  a fleet ingress's view of the replicas' Tinker checkpoints
``faults``          a fleet's fault hook (tests: ``INFER_FAULT_INJECTION=1``; else None)
==================  ====================================================================

A **training** (``config.tinker.training_backend``, built only when Tinker is on):
:class:`LoraTraining` (``lora``) or :class:`ToyTraining` (``toy``). It is given
``config``, ``model`` (the backend) and ``engine`` (the ``AsyncEngine``), and provides
``backend`` (the ``TrainingBackend`` port) and ``sampler`` (the ``SamplingBackend``
port; None: nothing samples here, as LoRA on the fake runner).
"""

from typing import Any

import structlog
from dependency_injector import containers, providers

from adapters.fake.factory import build_fake_embeddings, build_toy_backend
from adapters.fake.runner import FakeModelRunner
from adapters.fake.tokenizer import ByteTokenizer
from adapters.grammar import LLGuidanceCompiler, RequestMatchers
from adapters.grammar.factory import byte_grammar, tokenizer_json_grammar
from adapters.hf_tokenizer.tokenizer import HFTokenizer
from adapters.torch.factory import (
    build_embeddings,
    build_engine_config,
    build_engine_sampler,
    build_lora_serving,
    build_model,
    build_training_backend,
    choose_dtype,
    kv_pool_bytes,
)
from adapters.torch.lora.custom_loss import custom_loss_gradient
from adapters.torch.runtime.runner import TorchModelRunner
from adapters.torch.runtime.sampler import TokenSampler
from adapters.torch.runtime.step_costs import step_costs
from adapters.weights import ResolvedModel
from adapters.weights.factory import model_names, resolve, resolve_embedding
from application.engine.async_engine import AsyncEngine
from domain.config import EngineConfig
from domain.errors import InvalidParameterError, ModelLoadError
from domain.ports import Tokenizer
from domain.speculation import StepCosts
from entrypoints.config import ServerConfig
from entrypoints.config.engine import EngineSettings

log = structlog.get_logger("entrypoints.container")
FAKE_MODEL_NAME = "fake"
# Texts a draft model's tokenizer must encode as the target's does (with the same EOS ids).
TOKENIZER_PROBES = (
    "Hello, world! The quick brown fox.",
    "def add(x, y):\n    return x + y  # sum\n",
    '{"name": "caf\u00e9", "tags": [1, 2.5, null]}',
    "na\u00efve \u2014 \u6771\u4eac \U0001f642",
)


def model_tokenizer(resolved: ResolvedModel) -> Tokenizer:
    # Dummy-weight models have no tokenizer: bytes work with any real vocabulary size.
    return HFTokenizer.from_folder(resolved.path) if resolved.has_tokenizer else ByteTokenizer()


def model_grammar(
    resolved: ResolvedModel, vocab_size: int, tokenizer: Tokenizer
) -> LLGuidanceCompiler:
    """Structured outputs over the model's tokenizer (bytes for dummy-weight models)."""
    if resolved.has_tokenizer:
        return tokenizer_json_grammar(resolved.path, vocab_size, tokenizer.eos_token_ids)
    return byte_grammar(ByteTokenizer(), vocab_size)


def check_draft_tokenizer(name: str, target: Tokenizer, draft: Tokenizer) -> None:
    """Drafts are token ids: the draft model must share the target's tokenizer."""
    same = target.eos_token_ids == draft.eos_token_ids and all(
        target.encode(t, add_special_tokens=False) == draft.encode(t, add_special_tokens=False)
        for t in TOKENIZER_PROBES
    )
    if not same:
        raise InvalidParameterError(
            "speculative_config",
            f"model {name!r}: its tokenizer is not the target model's (a draft model must "
            "share the target's tokenizer)",
        )


def draft_runner(
    config: ServerConfig, engine_config: EngineConfig, target: Tokenizer
) -> TorchModelRunner | None:
    """The draft model (``--speculative-config``'s ``model``) loaded as the target is —
    its own ``--dtype auto`` choice, the ``quantization`` given or the target's — with a
    runner over a KV pool of the target's blocks; None without one."""
    spec = engine_config.speculative_config
    if spec is None or spec.model is None:
        return None
    settings = config.model
    try:
        resolved = resolve(spec.model, settings.cache_dir, settings.progress)
    except ModelLoadError as e:
        raise InvalidParameterError("speculative_config", f"model {spec.model!r}: {e}") from None
    check_draft_tokenizer(spec.model, target, model_tokenizer(resolved))
    dtype = choose_dtype(settings.dtype, resolved, settings.device)
    quantization = spec.quantization or settings.quantization
    model = build_model(
        resolved, dtype, settings.device, quantization, settings.dense_weights_memory
    )
    log.info("draft model", model=resolved.name, dtype=dtype, quantization=quantization)
    return TorchModelRunner(model, engine_config)


def measured_step_costs(
    runner: TorchModelRunner,
    engine_config: EngineConfig,
    resolved: ResolvedModel,
    quantization: str | None,
) -> StepCosts | None:
    """The runner's step costs (measured at the first start on this machine, cached)."""
    return step_costs(runner, engine_config, f"{resolved.path}|{resolved.name}|{quantization}")


def fake_draft_runner(engine_config: EngineConfig) -> FakeModelRunner | None:
    """A draft model on the fake backend: another fake runner (it drafts what the
    target's default script writes)."""
    spec = engine_config.speculative_config
    return FakeModelRunner() if spec is not None and spec.model is not None else None


# Providers more than one backend declares the same way (each backend's own ``config``).
def resolved_model_provider(config: providers.Provider[ServerConfig]) -> providers.Singleton[Any]:
    """The model's folder, resolved from the model flags (downloaded or converted once)."""
    model = config.provided.model
    return providers.Singleton(resolve, model.model, model.cache_dir, model.progress)


def served_names_provider(
    model_name: providers.Provider[Any], config: providers.Provider[ServerConfig]
) -> providers.Singleton[Any]:
    """The served name (``--served-model-name`` or the model's own), then Tinker's aliases."""
    return providers.Singleton(
        model_names,
        model_name,
        config.provided.model.served_model_name,
        config.provided.tinker.tinker_aliases,
    )


def embeddings_provider(config: providers.Provider[ServerConfig]) -> providers.Singleton[Any]:
    """The embedding model (float32) on the chat model's device (``/v1/embeddings``)."""
    return providers.Singleton(
        build_embeddings,
        providers.Singleton(resolve_embedding, config.provided.embeddings.embedding_model),
        config.provided.model.device,
        config.provided.embeddings.limits,
    )


class OneProcess(containers.DeclarativeContainer):
    """What a backend whose engine runs in this process gives about the fleet: none."""

    config = providers.Dependency(instance_of=ServerConfig)
    engine_kind = providers.Object("local")
    fleet: providers.Object[None] = providers.Object(None)
    tinker_enabled = config.provided.tinker.enabled
    shared_checkpoints: providers.Object[None] = providers.Object(None)
    faults: providers.Object[None] = providers.Object(None)


class TorchBackend(OneProcess):
    """The model's weights resolved and loaded, our runner over them."""

    config = OneProcess.config
    resolved_model = resolved_model_provider(config)
    # --dtype auto resolved once (measured on a CPU): the model and training use it.
    dtype = providers.Singleton(
        choose_dtype, config.provided.model.dtype, resolved_model, config.provided.model.device
    )
    model = providers.Singleton(
        build_model,
        resolved_model,
        dtype,
        config.provided.model.device,
        config.provided.model.quantization,
        config.provided.model.dense_weights_memory,
    )
    model_name = resolved_model.provided.name
    served_names = served_names_provider(model_name, config)
    # The engine's flags, the KV pool sized on the model: the scheduler and runner share it.
    engine_config = providers.Singleton(
        build_engine_config,
        providers.Singleton(EngineSettings.engine_config, config.provided.engine),
        model,
        config.provided.model.kv_cache_memory,
    )
    kv_cache_bytes = providers.Singleton(kv_pool_bytes, engine_config, model)
    tokenizer = providers.Singleton(model_tokenizer, resolved_model)
    vocab_size = model.provided.config.vocab_size
    # Structured outputs: the compiler checks requests, the matchers run in the runner.
    grammar = providers.Singleton(model_grammar, resolved_model, vocab_size, tokenizer)
    lora_serving = providers.Singleton(
        build_lora_serving,
        model,
        config.provided.tinker.enabled,
        config.provided.model.lora_modules,
        config.provided.model.max_loras,
        config.provided.model.enable_lora,
        config.provided.model.max_lora_rank,
    )
    runner = providers.Singleton(
        TorchModelRunner,
        model,
        engine_config,
        providers.Singleton(TokenSampler),
        lora_serving,
        providers.Singleton(RequestMatchers, grammar),
    )
    draft_runner = providers.Singleton(draft_runner, config, engine_config, tokenizer)
    # What the runner's steps cost by shape (speculation decides per step from them).
    step_costs = providers.Singleton(
        measured_step_costs,
        runner,
        engine_config,
        resolved_model,
        config.provided.model.quantization,
    )
    embeddings = embeddings_provider(config)


class FakeBackend(OneProcess):
    """No model: the scripted :class:`FakeModelRunner` and the :class:`ByteTokenizer`
    (the tests'; a test gives its runner as ``FakeBackend(runner=providers.Object(...))``)."""

    config = OneProcess.config
    resolved_model: providers.Object[None] = providers.Object(None)
    dtype: providers.Object[None] = providers.Object(None)
    model: providers.Object[None] = providers.Object(None)
    model_name = providers.Object(FAKE_MODEL_NAME)
    served_names = served_names_provider(model_name, config)
    engine_config = providers.Singleton(EngineSettings.engine_config, config.provided.engine)
    kv_cache_bytes = providers.Object(0)
    tokenizer = providers.Singleton(ByteTokenizer)
    vocab_size: providers.Object[None] = providers.Object(None)
    grammar: providers.Object[None] = providers.Object(None)
    lora_serving: providers.Object[None] = providers.Object(None)
    runner = providers.Singleton(FakeModelRunner)
    draft_runner = providers.Singleton(fake_draft_runner, engine_config)
    step_costs: providers.Object[None] = providers.Object(None)
    # A FakeEmbedder served under the --embedding-model's name.
    embeddings = providers.Singleton(
        build_fake_embeddings,
        config.provided.embeddings.embedding_model,
        config.provided.embeddings.limits,
    )


class LoraTraining(containers.DeclarativeContainer):
    """Tinker on LoRA over the backend's model; samples go through the engine, on the
    backend's multi-LoRA serving with the training runs' live weights."""

    config = providers.Dependency(instance_of=ServerConfig)
    model = providers.DependenciesContainer()
    engine = providers.Dependency(instance_of=AsyncEngine)
    backend = providers.Singleton(
        build_training_backend,
        model.resolved_model,
        model.served_names,
        model.dtype,
        config.provided.model.device,
        model.engine_config.provided.max_model_len,
        config.provided.model.quantization,
        config.provided.engine.batch_invariant,
    )
    sampler = providers.Singleton(
        build_engine_sampler,
        engine,
        model.lora_serving,
        backend.provider,
        model.served_names,
        config.provided.tinker.limits.max_sample_requests,
    )


class ToyTraining(containers.DeclarativeContainer):
    """Tinker on the numpy :class:`ToyBackend`, which samples itself (no model: tests)."""

    config = providers.Dependency(instance_of=ServerConfig)
    model = providers.DependenciesContainer()
    engine = providers.Dependency(instance_of=AsyncEngine)
    backend = providers.Singleton(
        build_toy_backend,
        model.served_names,
        model.engine_config.provided.max_model_len,
        providers.Object(custom_loss_gradient),
    )
    sampler = backend


BACKENDS: dict[str, type[containers.DeclarativeContainer]] = {
    "torch": TorchBackend,
    "fake": FakeBackend,
}
TRAININGS: dict[str, type[containers.DeclarativeContainer]] = {
    "lora": LoraTraining,
    "toy": ToyTraining,
}
