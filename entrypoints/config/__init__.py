"""One configuration for a server: :class:`ServerConfig`, a tree of frozen settings groups.

``infer serve`` builds it from its flags (:meth:`ServerConfig.from_args`, each
module of this package building its group), tests, benchmarks and :class:`LLM` from keywords
(:meth:`ServerConfig.for_model`), and ``create_container(config)`` wires the server from it
alone. It holds plain values only (no keyring, no hooks: the container builds those), so
a replica in another process is built from it: it pickles, and :func:`to_json` /
:func:`from_json` carry it through JSON, checked again on the way in.

The groups are frozen dataclasses, not ``msgspec.Struct``s: the engine's
:class:`EngineConfig` lives in the domain, which imports the standard library only, and the
groups it sits beside were dataclasses already (their checks in ``__post_init__``);
msgspec encodes and decodes dataclasses as they are (running ``__post_init__``), so one
kind of class serves both.

=================  ===================================================================
group              holds (module)
=================  ===================================================================
``model``          :class:`ModelSettings`: which model, dtype, device, quantization,
                   threads, runner, served names, LoRA modules, tool-call format, KV
                   budget (``model.py``)
``engine``         :class:`EngineSettings`: batching, ``max_num_seqs``,
                   ``max_model_len``, the KV pool, request limits (``engine.py``,
                   ``request.py``)
``http``           :class:`TransportSettings`: address, CORS, TLS, SSE heartbeat, request
                   deadline, drain (``transport.py``)
``connections``    :class:`ConnectionLimits`: per-connection limits (``connection.py``)
``tinker``         :class:`TinkerSettings`: the Tinker API, its keys and per-key limits
                   (``tinker.py``)
``access``         :class:`AccessSettings`: API keys, Redis, idempotency
                   (``access.py``)
``embeddings``     :class:`EmbeddingSettings`: ``/v1/embeddings``' model and limits
                   (``embedding.py``)
``observability``  :class:`ObservabilitySettings`: logs, metrics, traces
                   (``observability.py``)
``fleet``          :class:`ReplicaSettings`: engine replicas on Ray Serve, routing
                   (``replica.py``)
``generation``     :class:`GenerationSettings`: default sampling parameters, the output
                   cap (``generation.py``)
=================  ===================================================================

A field is named as its flag's destination (``--max-num-seqs``: ``engine.max_num_seqs``,
``--max-model-len``: ``engine.max_model_len``), except: a repeatable flag's field is plural
(``--tinker-api-key``: ``tinker.tinker_api_keys``, ``--tinker-alias``:
``tinker.tinker_aliases``), a negative flag's is positive (``--no-tinker``:
``tinker.enabled``, ``--disable-metrics``: ``observability.metrics``,
``--disable-uvicorn-access-log``: ``observability.uvicorn_access_log``), ``--api-key`` is
kept hashed (``access.api_key_hashes``), the first ``--served-model-name`` is
``model.served_model_name`` and the others ``model.aliases``, the ``--tinker-max-*`` and
``--max-embedding-*`` limits keep their classes' names (``tinker.limits``,
``embeddings.limits``). The engine's own :class:`EngineConfig` has the same names.
"""

import argparse
from dataclasses import dataclass, field, fields, replace
from pathlib import Path, PurePath
from typing import Any

import msgspec

from adapters.http.uvicorn_server import ConnectionLimits
from adapters.observability.settings import ObservabilitySettings
from domain.config import EngineConfig
from domain.memory import AUTO
from entrypoints.config import observability as observability_flags
from entrypoints.config.access import AccessSettings
from entrypoints.config.connection import connection_limits
from entrypoints.config.embedding import EmbeddingSettings
from entrypoints.config.engine import EngineSettings
from entrypoints.config.generation import GenerationSettings
from entrypoints.config.model import ModelSettings
from entrypoints.config.replica import ReplicaSettings
from entrypoints.config.tinker import TinkerSettings
from entrypoints.config.transport import TransportSettings

__all__ = ["ServerConfig", "from_json", "to_json"]


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server is built from, by group (see the module's table). The defaults
    are the library's (no Tinker, no embeddings, the engine's :class:`EngineConfig`
    defaults); ``infer serve``'s are :meth:`from_args`' of no flags."""

    model: ModelSettings = field(default_factory=ModelSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    http: TransportSettings = field(default_factory=TransportSettings)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    tinker: TinkerSettings = field(default_factory=TinkerSettings)
    access: AccessSettings = field(default_factory=AccessSettings)
    embeddings: EmbeddingSettings = field(default_factory=EmbeddingSettings)
    observability: ObservabilitySettings = field(default_factory=ObservabilitySettings)
    fleet: ReplicaSettings = field(default_factory=ReplicaSettings)
    generation: GenerationSettings = field(default_factory=GenerationSettings)

    def __post_init__(self) -> None:
        if self.model.kv_cache_memory is not None and self.engine.num_kv_blocks is not None:
            raise ValueError("give kv_cache_memory or the engine's num_kv_blocks, not both")
        events = self.engine.kv_events_config
        if events is not None and self.fleet.replicas:  # each replica publishes its own
            events.check_fleet(self.fleet.replicas + self.fleet.standby_replicas)

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, device: str) -> "ServerConfig":
        """``infer serve``'s configuration from its parsed flags, every group checked (a
        bad flag: ``InvalidParameterError`` naming it) before anything loads. ``device``:
        the one whose defaults apply where ``--device`` is not given (the CLI's: CUDA where
        torch sees a GPU; the config tree itself imports no torch)."""
        http = TransportSettings.from_args(args)
        connections = connection_limits(args)
        observability = observability_flags.from_args(args)
        access = AccessSettings.from_args(args)
        model = ModelSettings.from_args(args)
        engine = EngineSettings.from_args(args, model.device or device)
        if model.kv_cache_memory is None and engine.num_kv_blocks is None:
            model = replace(model, kv_cache_memory=AUTO)
        return cls(
            model=model,
            engine=engine,
            http=http,
            connections=connections,
            tinker=TinkerSettings.from_args(args, engine.max_num_seqs),
            access=access,
            embeddings=EmbeddingSettings.from_args(args, engine.max_prompt_bytes),
            observability=observability,
            fleet=ReplicaSettings.from_args(args),
            generation=GenerationSettings.from_args(args),
        )

    @classmethod
    def for_model(
        cls, model: str | ModelSettings | None = None, **overrides: Any
    ) -> "ServerConfig":
        """The library's defaults with ``model`` (a spec, None: the embedded one; or the
        whole group) and ``overrides``: a group by its name
        (``tinker=TinkerSettings(enabled=True)``; the ``engine`` also as an
        :class:`EngineConfig`), or a field by its name where one group has it
        (``runner="fake"``, ``cache_dir=...``, ``max_model_len=128``), applied over the
        group. For tests, benchmarks and :class:`LLM`."""
        base = cls()
        groups: dict[str, Any] = {f.name: getattr(base, f.name) for f in fields(base)}
        owners: dict[str, list[str]] = {}  # a field's name -> the groups that have it
        for name, group in groups.items():
            for f in fields(group):
                owners.setdefault(f.name, []).append(name)
        changes: dict[str, dict[str, Any]] = {}
        if isinstance(model, ModelSettings):
            groups["model"] = model
        else:
            changes["model"] = {"model": model}
        for name, value in overrides.items():
            if name == "engine" and isinstance(value, EngineConfig):
                value = EngineSettings.of(value)
            if name in groups:
                if not isinstance(value, type(groups[name])):
                    kind = type(groups[name]).__name__
                    raise TypeError(f"{name} must be a {kind}, got {value!r}")
                groups[name] = value
            elif len(owners.get(name, ())) == 1:
                changes.setdefault(owners[name][0], {})[name] = value
            else:
                where = " and ".join(owners.get(name, ())) or "no group"
                raise TypeError(f"{name!r}: a field of {where}; give its group instead")
        for group, values in changes.items():
            groups[group] = replace(groups[group], **values)
        return cls(**groups)


def to_json(config: ServerConfig) -> bytes:
    """``config`` as JSON (msgspec), for a replica in another process."""
    return msgspec.json.encode(config, enc_hook=_encode)


def from_json(data: bytes | str) -> ServerConfig:
    """The configuration :func:`to_json` wrote, checked again as it is built (a bad value:
    ``msgspec.ValidationError`` saying what and where)."""
    return msgspec.json.decode(data, type=ServerConfig, dec_hook=_decode)


def _encode(value: Any) -> Any:
    if isinstance(value, PurePath):  # a LoRA module's folder
        return str(value)
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


def _decode(kind: type, value: Any) -> Any:
    if kind is Path:
        return Path(value)
    raise NotImplementedError(f"cannot decode {kind.__name__}")
