"""The composition root: the backend and the training chosen once from the config (or
handed in), the app built on the fake backend (no model) and the toy training backend,
served through."""

import asyncio

import pytest
from dependency_injector import providers
from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.observer import RecordingObserver
from adapters.fake.runner import FakeModelRunner, reply_script
from adapters.fake.toy_backend import ToyBackend
from adapters.observability.metrics import Metrics
from adapters.torch.lora.custom_loss import custom_loss_gradient
from adapters.weights.resolve import resolve_model
from application.access.audit import Audit
from application.access.keys import hash_key
from application.engine.remote_engine import RemoteEngine
from application.serving.served_models import SharedCheckpoints
from domain.breaker import Transition
from domain.config import EngineConfig
from entrypoints.backends import (
    FakeBackend,
    LoraTraining,
    TorchBackend,
    ToyTraining,
)
from entrypoints.config import ServerConfig
from entrypoints.config.tinker import TinkerSettings
from entrypoints.container import breaker_listener, create_container
from entrypoints.fleet_backend import RemoteBackend
from tests.fakes import fake_container
from tests.support.peft_adapters import random_adapter
from tests.support.tiny_models import save_tiny_model

REPLY = "Paris is the capital."


def test_the_fake_runner_serves_a_completion_through_the_container(tmp_path) -> None:
    runner = FakeModelRunner(script=reply_script(ByteTokenizer(), REPLY))
    container = fake_container(runner, served_model_name="test/fake", cache_dir=str(tmp_path))
    assert container.async_engine().engine.runner is runner
    assert container.engine() is container.async_engine().engine
    assert container.sink() is container.async_engine().sink
    with TestClient(app=container.http_app()) as client:
        response = client.post(
            "/v1/completions", json={"model": "test/fake", "prompt": "Hi", "max_tokens": 64}
        )
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (REPLY, "stop")
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["test/fake"]
    assert not runner.live and len(container.sink()) == 0
    assert not list(tmp_path.iterdir())  # no model resolved, converted or loaded


def test_an_overridden_observer_sees_every_step(tmp_path) -> None:
    runner = FakeModelRunner(script=reply_script(ByteTokenizer(), REPLY))
    container = fake_container(runner, cache_dir=str(tmp_path))
    observer = RecordingObserver()
    container.observer.override(providers.Object(observer))
    assert container.engine().observer is observer
    with TestClient(app=container.http_app()) as client:
        response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 64})
        assert response.status_code == 200, response.text
    [finished] = observer.finished.values()
    assert finished.finish_reason == "eos"
    assert sum(len(s.finished) for s in observer.steps) == 1


def test_the_fake_backend_loads_no_model(tmp_path) -> None:
    container = fake_container(cache_dir=str(tmp_path))
    backend = container.backend
    assert backend.resolved_model() is None and backend.model() is None
    assert isinstance(backend.runner(), FakeModelRunner)
    assert isinstance(backend.tokenizer(), ByteTokenizer)
    assert backend.served_names() == ["fake"]
    assert container.tinker() is None  # the Tinker API is off by default
    container.http_app()
    assert not list(tmp_path.iterdir())


def test_the_backends_and_the_trainings_have_one_shape_each() -> None:
    assert set(TorchBackend.providers) == set(FakeBackend.providers)
    fleet_only = {"described", "handles", "dispatch", "breakers", "joined"}
    assert set(RemoteBackend.providers) == set(TorchBackend.providers) | fleet_only
    assert set(LoraTraining.providers) == set(ToyTraining.providers)


class FakeFleetView:
    """The fleet's registry as the ingress reads it, without Ray."""

    def __init__(self) -> None:
        self.started = 0

    def start(self) -> None:
        self.started += 1

    async def replicas(self) -> list[dict[str, object]]:
        return [{"id": "r1", "state": "running"}]

    def expositions(self) -> list[tuple[str, str]]:
        return [("r1", "# TYPE infer_x counter\ninfer_x_total 3\n")]


def test_a_fleets_ingress_is_built_by_the_config_alone_and_loads_no_model(tmp_path) -> None:
    """``--replicas`` chooses the fleet's backend: what a replica measured stands in for
    the model (the names and the tokenizer are the model's own), the engine is remote, the
    Tinker service runs on the replicas (their checkpoints served from the shared folder),
    ``/metrics`` and ``/admin/replicas`` read the fleet's registry."""
    engine_config = EngineConfig(max_model_len=256, max_num_seqs=4)
    described = {"engine_config": engine_config, "vocab_size": 49152, "kv_cache_bytes": 4096}
    tinker = TinkerSettings(enabled=True, checkpoint_dir=str(tmp_path))
    config = ServerConfig.for_model(replicas=2, tinker=tinker)
    container = create_container(config)
    backend = container.backend()
    assert backend.declarative_parent is RemoteBackend
    view = FakeFleetView()
    backend.described.override(providers.Object(described))  # no Ray here: what it gives
    backend.fleet.override(providers.Object(view))
    assert backend.model() is None and backend.runner() is None and backend.dtype() is None
    assert backend.engine_config() is engine_config and backend.vocab_size() == 49152
    assert backend.kv_cache_bytes() == 4096 and backend.lora_serving() is not None
    assert backend.served_names() == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert backend.tokenizer().decode(backend.tokenizer().encode("Hello there")) == "Hello there"
    engine = container.async_engine()
    assert isinstance(engine, RemoteEngine) and engine.capacity == 2 * engine_config.capacity
    assert container.tinker() is None
    assert isinstance(container.tinker_checkpoints(), SharedCheckpoints)
    rows = asyncio.run(container.replicas()())
    assert rows == [{"id": "r1", "state": "running", "breaker": "closed", "role": "serving"}]
    assert engine.breakers is backend.breakers() and engine.breakers.settings.enabled
    services = container.http_services()
    assert services.on_startup[-1] == view.start
    render = container.metrics_exposition()
    assert render is not None
    body = render()[0].decode()
    assert 'infer_x_total{replica="r1"} 3' in body and 'replica="ingress"' in body


def test_a_fleets_ingress_checks_an_adapter_at_its_load(tmp_path) -> None:
    """``/v1/load_lora_adapter`` at a fleet's ingress checks the folder as one process does,
    without the model (its widths from its ``config.json``): a missing folder, no PEFT
    weights, another base model's adapter, a rank over ``--max-lora-rank`` are each a 400
    naming ``lora_path``; a good one is served, its folder named to the replicas' calls."""
    model = resolve_model(None, progress=False).path  # the ingress's model (its tokenizer)
    tiny = tmp_path / "tiny"
    save_tiny_model("llama", tiny)
    engine_config = EngineConfig(max_model_len=256, max_num_seqs=4)
    described = {"engine_config": engine_config, "vocab_size": 49152, "kv_cache_bytes": 4096}
    config = ServerConfig.for_model(replicas=2, enable_lora=True, max_lora_rank=4)
    container = create_container(config)
    backend = container.backend()
    backend.described.override(providers.Object(described))  # no Ray here: what it gives
    backend.fleet.override(providers.Object(FakeFleetView()))
    refused = [
        (tmp_path / "missing", "no such folder"),
        (tmp_path, "not a PEFT LoRA adapter folder"),
        (random_adapter(tmp_path / "other", tiny, rank=4), "an adapter of another base model"),
        (random_adapter(tmp_path / "wide", model, rank=8), "rank 8 is over"),
    ]
    good = random_adapter(tmp_path / "good", model, rank=4)
    with TestClient(app=container.http_app()) as http:
        for folder, says in refused:
            body = {"lora_name": "sql", "lora_path": str(folder)}
            reply = http.post("/v1/load_lora_adapter", json=body)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == "lora_path" and says in error["message"], error
        body = {"lora_name": "sql", "lora_path": str(good)}
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 200
        assert "sql" in [m["id"] for m in http.get("/v1/models").json()["data"]]
    [entry] = [e for e in container.served_models().entries() if e.id == "sql"]
    assert entry.adapter_id is not None
    assert backend.lora_serving().folder_of(entry.adapter_id) == good


def test_one_process_has_no_fleet() -> None:
    container = fake_container()
    assert container.replicas() is None and container.backend.fleet() is None
    assert container.http_services().on_startup == ()


def test_the_config_chooses_the_backend_and_a_test_may_hand_in_its_own(tmp_path) -> None:
    def chosen(config: ServerConfig) -> tuple[type, type]:
        container = create_container(config)  # nothing is built until asked for
        parts = (container.backend(), container.training())
        return parts[0].declarative_parent, parts[1].declarative_parent

    assert chosen(ServerConfig.for_model(runner="fake")) == (FakeBackend, LoraTraining)
    assert chosen(ServerConfig.for_model(training_backend="toy")) == (TorchBackend, ToyTraining)
    assert chosen(ServerConfig.for_model(replicas=2))[0] is RemoteBackend
    # The config names the torch runner; the backend handed in is used, given the config.
    config = ServerConfig.for_model(cache_dir=str(tmp_path), max_model_len=96)
    backend = FakeBackend()
    container = create_container(config, backend=backend)
    assert container.backend() is backend and backend.config() is config
    assert container.engine().config.max_model_len == 96
    assert not list(tmp_path.iterdir())


def test_the_toy_training_backend_serves_tinker_without_a_model(tmp_path) -> None:
    tinker = TinkerSettings(
        enabled=True,
        training_backend="toy",
        tinker_aliases=("test/alias",),
        checkpoint_dir=str(tmp_path / "checkpoints"),
    )
    container = fake_container(
        served_model_name="test/base", tinker=tinker, cache_dir=str(tmp_path / "cache")
    )
    backend = container.training.backend()
    assert isinstance(backend, ToyBackend)
    assert [m.name for m in backend.base_models] == ["test/base"]
    assert backend._custom_loss is custom_loss_gradient  # it runs uploaded custom losses
    assert container.tinker() is not None
    with TestClient(app=container.http_app()) as client:
        response = client.get("/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-key"})
        assert response.status_code == 200, response.text
        names = [m["model_name"] for m in response.json()["supported_models"]]
        assert "test/base" in names


@pytest.mark.parametrize(
    ("keyword", "value"),
    [("runner", "jax"), ("training_backend", "full"), ("dtype", "int3"), ("quantization", "q3")],
)
def test_an_unknown_selection_is_refused(keyword: str, value: str) -> None:
    with pytest.raises(ValueError, match=keyword):
        create_container(ServerConfig.for_model(**{keyword: value}))


def test_the_container_is_built_from_the_config_alone(tmp_path) -> None:
    """What the config says reaches the providers: the engine's flags under the engine's
    names, the transport's settings in the app's, the keys file's tenants."""
    keys = tmp_path / "keys.json"
    keys.write_text('{"tenants": [{"id": "a", "keys": ["' + hash_key("sk-a") + '"]}]}')
    config = ServerConfig.for_model(
        runner="fake",
        cache_dir=str(tmp_path / "cache"),
        max_num_seqs=3,
        max_model_len=96,
        request_timeout=7.0,
        allowed_origins=("https://app.example.com",),
        api_keys_file=str(keys),
        idempotency_ttl=60.0,
        tool_call_parser="pythonic",
        reasoning_parser="qwen3",
    )
    container = create_container(config)
    engine = container.backend.engine_config()
    assert (engine.max_num_seqs, engine.max_model_len) == (3, 96)
    settings = container.http_settings()
    assert settings.request_timeout == 7.0
    assert settings.allowed_origins == ("https://app.example.com",)
    assert (settings.idempotency_ttl, settings.tool_call_parser) == (60.0, "pythonic")
    assert settings.reasoning_parser == "think"  # vLLM's qwen3: our <think> parser
    keyring = container.keyring()
    assert keyring is not None and [t.id for t in keyring.tenants] == ["a"]
    container.http_app()


def test_a_replicas_breaker_opening_or_closing_is_an_audit_line_and_a_gauge() -> None:
    audit, metrics = Audit(), Metrics("m", max_num_seqs=4)
    told = breaker_listener(audit, metrics)
    told(Transition("r1", "open", "5 calls failed in a row"))
    body = metrics.render()[0].decode()
    assert 'infer:replica_breaker_open{model_name="m",replica_id="r1"} 1.0' in body
    assert 'infer:replica_breaker_opens_total{model_name="m",replica_id="r1"} 1.0' in body
    told(Transition("r1", "closed", "its probe answered"))
    assert (
        'replica_breaker_open{model_name="m",replica_id="r1"} 0.0' in metrics.render()[0].decode()
    )
    events = [(e.event, e.subject, e.details["reason"]) for e in audit.trail.read()]
    assert events == [
        ("replica circuit breaker closed", "replica:r1", "its probe answered"),
        ("replica circuit breaker open", "replica:r1", "5 calls failed in a row"),
    ]
