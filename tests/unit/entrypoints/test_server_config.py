"""``ServerConfig``: ``infer serve``'s flags build it (field names are the flags' names,
defaults today's), it round-trips through pickle and JSON (replicas are built from it in
another process), and ``for_model`` builds the tests' and benchmarks' configs."""

import argparse
import pickle
from dataclasses import fields
from datetime import date
from pathlib import Path

import msgspec
import pytest

from adapters.http.uvicorn_server import ConnectionLimits
from adapters.observability.settings import ObservabilitySettings
from adapters.observability.tracing import TracingSettings
from adapters.storage.usage_sql import DEFAULT_USAGE_DB
from adapters.weights.factory import model_names
from adapters.weights.packaged import SMOLLM2_NAME
from application.access.idempotency import DEFAULT_TTL_S
from application.access.keys import hash_key
from application.serving.embeddings import EmbeddingLimits
from application.serving.served_models import LoraModule
from domain.config import EngineConfig
from domain.errors import InvalidParameterError
from domain.kv_events import KVEventsConfig, binds
from domain.memory import KVCacheMemory
from domain.speculation import SpeculativeConfig
from domain.tinker.values import TinkerLimits
from entrypoints.cli import _parser
from entrypoints.config import ServerConfig, from_json, to_json
from entrypoints.config.access import AccessSettings
from entrypoints.config.embedding import EmbeddingSettings
from entrypoints.config.engine import EngineSettings, speculative_config
from entrypoints.config.model import ModelSettings
from entrypoints.config.replica import ReplicaSettings
from entrypoints.config.tinker import TinkerSettings
from entrypoints.config.transport import TransportSettings


@pytest.fixture(autouse=True)
def no_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFER_API_KEY", raising=False)
    monkeypatch.delenv("INFER_TINKER_API_KEYS", raising=False)


def serve(*argv: str) -> ServerConfig:
    return ServerConfig.from_args(_parser().parse_args(["serve", *argv]), device="cpu")


def round_trip(config: ServerConfig) -> None:
    assert pickle.loads(pickle.dumps(config)) == config
    assert from_json(to_json(config)) == config


def test_no_flags_give_todays_serve_defaults() -> None:
    """What ``infer serve`` passed ``create_container`` before the config tree (CPU)."""
    config = serve("--device", "cpu")
    assert config.model == ModelSettings(device="cpu", quantization="auto", kv_cache_memory="auto")
    assert config.engine.engine_config() == EngineConfig(
        max_model_len=2048, max_num_seqs=64, speculative_config=SpeculativeConfig()
    )
    assert config.http == TransportSettings()
    assert config.connections == ConnectionLimits()
    assert config.tinker == TinkerSettings(
        enabled=True, limits=TinkerLimits(max_sample_requests=64)
    )
    # The server records usage in a file by default; in-process apps (tests) in memory.
    assert config.access == AccessSettings(usage_db=DEFAULT_USAGE_DB)
    assert config.access.idempotency_ttl == DEFAULT_TTL_S
    assert config.embeddings == EmbeddingSettings("all-MiniLM-L6-v2", EmbeddingLimits())
    assert config.observability == ObservabilitySettings()
    assert serve("--device", "cuda").engine.max_num_seqs == 256


def test_representative_flags_land_in_fields_of_their_names(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[tenants]]\nid = "acme"\nkeys = ["{hash_key("sk-a")}"]\n')
    config = serve(
        "dummy:SmolLM2-135M",
        "--dtype", "half",
        "--device", "cpu",
        "--threads", "3",
        "--max-num-seqs", "5",
        "--max-model-len", "512",
        "--max-num-batched-tokens", "64",
        "--no-prefix-caching",
        "--num-kv-blocks", "256",
        "--batch-wait-timeout", "0.5",
        "--max-n", "4",
        "--served-model-name", "smol", "gpt-4o-mini",
        "--lora-modules", "sql=/a/sql",
        "--model-deprecation", "gpt-4o-mini=2030-01-01",
        "--tool-call-parser", "llama3_json",
        "--reasoning-parser", "deepseek_r1",
        "--host", "0.0.0.0",
        "--port", "9000",
        "--allowed-origins", "https://a.example,https://b.example",
        "--request-timeout", "30",
        "--max-connections", "10",
        "--no-tinker",
        "--tinker-api-key", "tml-a",
        "--tinker-alias", "other",
        "--tinker-max-lora-rank", "16",
        "--api-keys-file", str(keys),
        "--idempotency-ttl", "0",
        "--embedding-model", "none",
        "--max-embedding-inputs", "9",
        "--disable-metrics",
        "--log-format", "json",
        "--disable-uvicorn-access-log",
    )  # fmt: skip
    model = config.model
    assert (model.model, model.dtype, model.device, model.threads) == (
        "dummy:SmolLM2-135M",
        "float16",
        "cpu",
        3,
    )
    assert (model.served_model_name, model.aliases) == ("smol", ("gpt-4o-mini",))
    assert model.lora_modules == (LoraModule("sql", Path("/a/sql")),)
    assert model.deprecations == {"gpt-4o-mini": date(2030, 1, 1)}
    assert (model.tool_call_parser, model.kv_cache_memory) == ("llama3_json", None)
    assert model.reasoning_parser == "deepseek_r1"
    engine = config.engine
    assert (engine.max_num_seqs, engine.max_model_len, engine.max_num_batched_tokens) == (
        5,
        512,
        64,
    )
    assert (engine.prefix_caching, engine.num_kv_blocks, engine.max_n) == (False, 256, 4)
    assert engine.batch_wait_timeout == 0.5
    assert (config.http.host, config.http.port, config.http.request_timeout) == (
        "0.0.0.0",
        9000,
        30.0,
    )
    assert config.http.allowed_origins == ("https://a.example", "https://b.example")
    assert config.connections.max_connections == 10
    tinker = config.tinker
    assert (tinker.enabled, tinker.tinker_api_keys) == (False, frozenset({"tml-a"}))
    assert (tinker.tinker_aliases, tinker.limits.max_lora_rank) == (("other",), 16)
    assert tinker.limits.max_sample_requests == 5  # --max-num-seqs
    assert (config.access.api_keys_file, config.access.idempotency_ttl) == (str(keys), 0.0)
    assert config.embeddings.embedding_model is None
    assert config.embeddings.limits.max_embedding_inputs == 9
    observability = config.observability
    assert (observability.metrics, observability.log_format) == (False, "json")
    assert not observability.uvicorn_access_log
    round_trip(config)


def test_the_engine_flags_are_the_engine_configs_fields() -> None:
    """Every EngineConfig field is a flag-named field here (the same names), the defaults
    agree, and the mapping goes both ways."""
    names = {f.name for f in fields(EngineSettings)}
    assert names == {f.name for f in fields(EngineConfig)}
    assert EngineSettings().engine_config() == EngineConfig()
    config = EngineConfig(max_model_len=100, max_num_seqs=3, prefix_caching=False)
    settings = EngineSettings.of(config)
    assert (settings.max_model_len, settings.max_num_seqs, settings.prefix_caching) == (
        100,
        3,
        False,
    )
    assert settings.engine_config() == config
    with pytest.raises(InvalidParameterError) as error:  # named as EngineConfig names it
        EngineSettings(max_model_len=0)
    assert error.value.param == "max_model_len"


def test_api_keys_are_kept_hashed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFER_API_KEY", "sk-env")
    config = serve("--api-key", "sk-flag")
    assert config.access.api_key_hashes == (hash_key("sk-flag"), hash_key("sk-env"))
    assert b"sk-flag" not in to_json(config) and b"sk-flag" not in pickle.dumps(config)
    keyring = config.access.keyring()
    assert keyring is not None and keyring.tenant("sk-env") is not None
    assert config.access.keys_source == "--api-key"


def test_every_group_round_trips_through_pickle_and_json() -> None:
    config = ServerConfig(
        model=ModelSettings(
            model="dummy:Qwen3-0.6B",
            dtype="float32",
            quantization="int8",
            lora_modules=(LoraModule("a", Path("/x/a")),),
            deprecations={"a": date(2031, 2, 3)},
            kv_cache_memory=KVCacheMemory(fraction=0.5),
        ),
        engine=EngineSettings(max_num_seqs=2, max_model_len=64, batching_mode="static"),
        http=TransportSettings(allowed_origins=("https://a",), sse_heartbeat_interval=0.0),
        tinker=TinkerSettings(
            enabled=True,
            tinker_api_keys=frozenset({"tml-1", "tml-2"}),
            tinker_aliases=(),
            training_backend="toy",
            limits=TinkerLimits(max_seq_ahead=3),
        ),
        access=AccessSettings(api_key_hashes=(hash_key("k"),), redis_url="redis://h:6379/0"),
        embeddings=EmbeddingSettings("e", EmbeddingLimits(max_input_bytes=7)),
        observability=ObservabilitySettings(
            tracing=TracingSettings(endpoint="grpc://h:4317", console=True), log_level="debug"
        ),
        fleet=ReplicaSettings(replicas=3, ray_address="ray://h:10001", routing="pow2"),
    )
    round_trip(config)
    round_trip(ServerConfig())
    round_trip(ServerConfig.for_model(kv_cache_memory=KVCacheMemory(nbytes=1 << 30)))


def test_json_is_checked_on_the_way_in() -> None:
    text = to_json(ServerConfig()).replace(b'"max_model_len":4096', b'"max_model_len":0')
    with pytest.raises(
        msgspec.ValidationError, match=r"max_model_len: must be >= 1 - at `\$.engine`"
    ):
        from_json(text)


def test_for_model_takes_groups_and_fields_by_name() -> None:
    config = ServerConfig.for_model(
        "m",
        runner="fake",
        cache_dir="/c",
        engine=EngineConfig(max_model_len=128, max_num_seqs=4),
        max_waiting_requests=3,
        tinker=TinkerSettings(enabled=True),
        checkpoint_dir="/ckpt",
    )
    assert (config.model.model, config.model.runner, config.model.cache_dir) == ("m", "fake", "/c")
    assert (config.engine.max_model_len, config.engine.max_num_seqs) == (128, 4)
    assert config.engine.max_waiting_requests == 3  # a field over the group given
    assert (config.tinker.enabled, config.tinker.checkpoint_dir) == (True, "/ckpt")
    assert ServerConfig.for_model() == ServerConfig()
    with pytest.raises(TypeError, match="limits"):  # two groups have one: give the group
        ServerConfig.for_model(limits=TinkerLimits())
    with pytest.raises(TypeError, match="tinker must be a TinkerSettings"):
        ServerConfig.for_model(tinker=True)
    with pytest.raises(TypeError, match="no group"):  # the engine's old name
        ServerConfig.for_model(max_batch_size=4)


def test_a_kv_budget_and_a_block_count_are_exclusive() -> None:
    with pytest.raises(ValueError, match="not both"):
        ServerConfig.for_model(kv_cache_memory="auto", num_kv_blocks=1024)


def test_each_flag_module_builds_its_group(tmp_path: Path) -> None:
    """The groups' ``from_args`` check their flags before anything loads."""
    bad = tmp_path / "keys.json"
    bad.write_text("{")
    for argv, param in [
        (["--api-keys-file", str(bad)], "api_keys_file"),
        (["--idempotency-max-keys", "0"], "idempotency_max_keys"),
        (["--max-tenant-labels", "0"], "max_tenant_labels"),
        (["--request-timeout", "-1"], "request_timeout"),
        (["--max-connections", "0"], "max_connections"),
        (["--tinker-max-runs-per-key", "0"], "tinker_max_runs_per_key"),
        (["--max-embedding-queue", "0"], "max_embedding_queue"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--max-loras", "0"], "max_loras"),
        (["--replicas", "-1"], "replicas"),
        (["--replica-cpus", "0"], "replica_cpus"),
        (["--replica-start-timeout", "0"], "replica_start_timeout"),
        (["--usage-db", "redis://localhost/0"], "usage_db"),
        (["--usage-retention-days", "-1"], "usage_retention_days"),
        (["--model-rollout", "support"], "model_rollout"),
        (["--model-rollout", "support=v1:x"], "model_rollout"),
    ]:
        with pytest.raises(InvalidParameterError) as error:
            serve(*argv)
        assert error.value.param == param, argv


def test_the_parsed_flags_cover_every_field() -> None:
    """Each serve flag's destination is read by some group's ``from_args``: a parsed
    namespace missing any one of them fails to build."""
    args = _parser().parse_args(["serve"])
    skip = {"func"}
    for name in sorted(set(vars(args)) - skip):
        partial = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != name})
        with pytest.raises(AttributeError, match=name):
            ServerConfig.from_args(partial, device="cpu")


def test_from_flags_takes_each_field_from_its_flag_and_names_a_missing_one() -> None:
    import argparse
    from dataclasses import dataclass

    from entrypoints.config.flag_fields import from_flags

    @dataclass(frozen=True)
    class Settings:
        port: int
        hosts: tuple[str, ...]

    args = argparse.Namespace(port=8000, hosts="a,b", unrelated=1)
    assert from_flags(Settings, args, hosts=("a", "b")) == Settings(8000, ("a", "b"))
    with pytest.raises(AttributeError, match=r"Settings\.hosts: no flag of that name"):
        from_flags(Settings, argparse.Namespace(port=1))


def test_the_replica_flags_and_a_single_process_without_ray() -> None:
    """``--replicas`` and its companions land in ``fleet``; without them nothing changes,
    and the command line does not import Ray (only ``--replicas`` does)."""
    import subprocess
    import sys

    fleet = serve("--replicas", "2", "--routing", "round-robin", "--ray-address", "h:6379").fleet
    assert (fleet.replicas, fleet.routing, fleet.ray_address) == (2, "round-robin", "h:6379")
    assert serve().fleet == ReplicaSettings()
    assert ServerConfig.for_model(replicas=2).fleet.replicas == 2
    with pytest.raises(SystemExit):
        serve("--routing", "random")
    code = "import sys, entrypoints.cli; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_no_borrowed_model_name_is_advertised_unless_asked() -> None:
    assert TinkerSettings().tinker_aliases == ()
    assert model_names(SMOLLM2_NAME, None, ()) == [SMOLLM2_NAME]  # the embedded model too
    assert model_names("m", "served", ("other", "served")) == ["served", "other"]


def test_speculative_config_takes_vllms_json_and_names_a_bad_field() -> None:
    config = serve("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    spec = config.engine.engine_config().speculative_config
    assert spec is not None and (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    round_trip(config)  # a replica in another process gets it too
    # on by default on a CPU (measured there), off with "none", on a GPU and when static
    assert serve().engine.engine_config().speculative_config == SpeculativeConfig()
    for off in ("none", "OFF", "null"):
        assert serve("--speculative-config", off).engine.engine_config().speculative_config is None
    static = serve("--batching-mode", "static").engine.engine_config()
    assert static.speculative_config is None
    args = _parser().parse_args(["serve"])
    assert EngineSettings.from_args(args, "cuda:0").engine_config().speculative_config is None
    assert EngineSettings.from_args(args, "cpu").engine_config().speculative_config is not None
    draft = serve("--speculative-config", '{"model": "dummy:Llama-3.2-1B"}').engine
    spec = draft.engine_config().speculative_config  # vLLM's reading: a model means draft_model
    assert spec is not None and (spec.method, spec.model) == ("draft_model", "dummy:Llama-3.2-1B")
    for bad, named in (
        ('{"method": "eagle", "model": "x"}', "needs heads trained for the target"),
        ('{"method": "draft_model"}', "speculative_config.model"),
        ('{"method": "ngram", "model": "x"}', "speculative_config.model"),
        ('{"method": "suffix", "quantization": "gguf"}', "speculative_config.quantization"),
        ('{"method": "ngram", "num_speculative_tokenz": 3}', "num_speculative_tokenz"),
        ('{"method": "ngrams"}', "method"),
        ("[1]", "JSON object"),
    ):
        with pytest.raises(SystemExit):
            serve("--speculative-config", bad)
        with pytest.raises(argparse.ArgumentTypeError, match=named):
            speculative_config(bad)


def test_dense_weights_memory_is_a_size_auto_or_none() -> None:
    assert serve("--device", "cpu").model.dense_weights_memory is None  # auto
    assert serve("--dense-weights-memory", "512MiB").model.dense_weights_memory == 512 << 20
    assert serve("--dense-weights-memory", "auto").model.dense_weights_memory is None
    assert serve("--dense-weights-memory", "0").model.dense_weights_memory == 0
    for bad in ("0.5", "lots", "-1"):
        with pytest.raises(SystemExit):
            serve("--dense-weights-memory", bad)
    with pytest.raises(InvalidParameterError, match="dense_weights_memory"):
        ModelSettings(dense_weights_memory=-1)


def test_kv_events_config_takes_vllms_json_and_a_fleet() -> None:
    flag = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}'
    )
    events = serve("--kv-events-config", flag).engine.engine_config().kv_events_config
    assert events is not None and events.recording and events.publisher == "zmq"
    assert (events.replay_endpoint, events.buffer_steps, events.hwm) == (None, 10_000, 100_000)
    assert serve().engine.engine_config().kv_events_config is None  # off by default
    with pytest.raises(SystemExit):
        serve("--kv-events-config", '{"frobnicate": 1}')
    with pytest.raises(SystemExit):
        serve("--kv-events-config", '{"max_queue_size": 0}')
    # A fleet: each replica publishes; a connected endpoint as given, a bound one (and the
    # replay socket, always bound) on the port + the replica's rank (vLLM's rule).
    fleet = serve("--kv-events-config", flag, "--replicas", "2")
    assert fleet.engine.kv_events_config == events
    assert events.for_replica(1) == events and events.for_replica(None) == events
    bound = KVEventsConfig(True, "zmq", "tcp://*:5557", replay_endpoint="tcp://*:6000", topic="kv")
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/kv")
    assert not binds("tcp://indexer:5557") and not binds("tcp://127.0.0.1:5557")
    second = bound.for_replica(2)
    assert (second.endpoint, second.replay_endpoint) == ("tcp://*:5559", "tcp://*:6002")
    assert KVEventsConfig(True, "zmq", "ipc:///tmp/kv").for_replica(1).endpoint == (
        "ipc:///tmp/kv_dp1"
    )
    bound.check_fleet(3)
    near = KVEventsConfig(True, "zmq", "tcp://*:5557", replay_endpoint="tcp://*:5558")
    near.check_fleet(1)
    for bad, says in (
        (near, "5557-5558 and the replay_endpoint 5558-5559"),
        (KVEventsConfig(True, "zmq", "inproc://kv"), "inproc"),
        (KVEventsConfig(True, "zmq", "tcp://*:any"), "port number"),
    ):
        with pytest.raises(InvalidParameterError, match="kv_events_config") as refused:
            bad.check_fleet(2)
        assert says in refused.value.message
    near_flag = '{"enable_kv_cache_events": true, "publisher": "zmq", ' + (
        '"replay_endpoint": "tcp://*:5558"}'
    )
    with pytest.raises(InvalidParameterError, match="kv_events_config"):
        serve("--kv-events-config", near_flag, "--replicas", "1", "--standby-replicas", "1")
