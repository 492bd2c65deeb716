"""LoRA adapters as models on the OpenAI face (a tiny random Llama, the composition root,
the official openai SDK): a ``--lora-modules`` PEFT folder, and a Tinker sampler
checkpoint saved through the Tinker API (the stock tinker SDK), each addressable as
``model``, listed with ``parent`` = the base, and changing the output against the base."""

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import tinker
import torch
from litestar.testing import TestClient
from tinker import types

from adapters.fake import ByteTokenizer
from application.serving.served_models import LoraModule
from domain.config import EngineConfig
from domain.errors import InvalidParameterError
from domain.rollout import parse_rollout
from entrypoints.config import ServerConfig
from entrypoints.config.tinker import TinkerSettings
from entrypoints.container import Container, create_container
from tests.support.peft_adapters import train_until_learned, trained_adapter
from tests.support.tinker_server import serve
from tests.support.tiny_models import save_tiny_model

os.environ.setdefault("TINKER_TELEMETRY", "0")

BASE = "tiny"
TEXT = "hello!!!!!!!"  # what the adapters learn: after "hello", "!" and more "!"
PROMPT, CONTINUATION = TEXT[:5], TEXT[5:]
# AdamW on the tiny model: it learns TEXT in about 20 steps at this rate, the gradient clipped
# (at 0.05 the loss jumped about and never settled: a knife edge, not a recipe).
LEARNING_RATE, GRAD_CLIP_NORM, MAX_STEPS = 5e-3, 1.0, 60


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", folder)
    return folder


@pytest.fixture(scope="module")
def peft_folder(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT adapter folder (the LoRA training backend's format) that learned ``TEXT``."""
    out = tmp_path_factory.mktemp("peft-hello")
    tokens = ByteTokenizer().encode(TEXT)
    return trained_adapter(
        tiny_model,
        tokens,
        out,
        rank=8,
        learning_rate=LEARNING_RATE,
        grad_clip_norm=GRAD_CLIP_NORM,
        max_steps=MAX_STEPS,
        dtype=torch.float32,
    ).path


def container(tiny_model: Path, tmp_path: Path, **kwargs: object) -> Container:
    config = ServerConfig.for_model(
        str(tiny_model),
        dtype="float32",
        device="cpu",
        cache_dir=str(tmp_path / "cache"),
        progress=False,
        engine=EngineConfig(max_model_len=128, max_num_seqs=4),
        served_model_name=BASE,
        **kwargs,
    )
    return create_container(config)


def greedy(client: openai.OpenAI, model: str) -> str:
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=len(CONTINUATION), temperature=0
    )
    assert reply.model == model
    return reply.choices[0].text


def test_a_lora_module_is_a_model_of_its_own(
    tiny_model: Path, peft_folder: Path, tmp_path: Path
) -> None:
    modules = (LoraModule("hello", peft_folder),)
    app = container(tiny_model, tmp_path, lora_modules=modules).http_app()
    with TestClient(app=app) as http:  # type: ignore[arg-type]
        client = openai.OpenAI(
            base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0
        )
        assert greedy(client, "hello") == CONTINUATION
        assert greedy(client, BASE) != CONTINUATION
        cards = {m.id: m.model_dump() for m in client.models.list().data}
        assert list(cards) == [BASE, "hello"]
        assert (cards["hello"]["parent"], cards["hello"]["root"]) == (BASE, str(peft_folder))
        assert cards[BASE]["parent"] is None


def test_a_rollout_sends_each_user_to_one_build_and_its_output(
    tiny_model: Path, peft_folder: Path, tmp_path: Path
) -> None:
    """A canary between the base model and the adapter: each request runs on the build its
    reply names (the build's own greedy output), the same user on the same build."""
    modules = (LoraModule("hello", peft_folder),)
    rollout = parse_rollout(f"canary={BASE}:1,hello:1")
    app = container(tiny_model, tmp_path, lora_modules=modules, rollouts=(rollout,)).http_app()
    with TestClient(app=app) as http:  # type: ignore[arg-type]
        client = openai.OpenAI(
            base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0
        )
        expected = {name: greedy(client, name) for name in (BASE, "hello")}
        assert expected[BASE] != expected["hello"]
        seen = set()
        for user in [f"user-{i}" for i in range(12)] * 2:
            reply = client.completions.create(
                model="canary",
                prompt=PROMPT,
                max_tokens=len(CONTINUATION),
                temperature=0,
                user=user,
            )
            seen.add((user, reply.model))
            assert reply.choices[0].text == expected[reply.model]
        assert len(seen) == 12  # each user on one build
        assert {build for _, build in seen} == {BASE, "hello"}


def test_a_lora_module_that_is_no_adapter_fails_the_start(tiny_model: Path, tmp_path: Path) -> None:
    modules = (LoraModule("sql", tmp_path),)
    with pytest.raises(InvalidParameterError, match=f"sql={tmp_path}: no adapter_model"):
        container(tiny_model, tmp_path, lora_modules=modules).http_app()


def train_and_save(url: str, key: str) -> str:
    """A sampler checkpoint that learned ``TEXT``, saved through the Tinker API."""
    service = tinker.ServiceClient(base_url=url, api_key=key)
    try:
        training = service.create_lora_training_client(base_model=BASE, rank=8, seed=1).result()
        tokens = ByteTokenizer().encode(TEXT)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        params = types.AdamParams(learning_rate=LEARNING_RATE, grad_clip_norm=GRAD_CLIP_NORM)
        train_until_learned(
            lambda: (
                training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
            ),
            lambda: training.optim_step(params).result(),
            targets=len(tokens) - 1,
            max_steps=MAX_STEPS,
        )
        return training.save_weights_for_sampler("hello").result().path
    finally:
        service.close("success").result()


@pytest.fixture
def tinker_url(tiny_model: Path, tmp_path: Path) -> Iterator[str]:
    api = TinkerSettings(enabled=True, checkpoint_dir=str(tmp_path / "ckpt"))
    app = container(tiny_model, tmp_path, tinker=api).http_app()
    with serve(app) as url:  # type: ignore[arg-type]
        yield url


def test_a_tinker_sampler_checkpoint_is_a_model_of_its_owner(tinker_url: str) -> None:
    path = train_and_save(tinker_url, "tml-alice")
    alice = openai.OpenAI(base_url=f"{tinker_url}/v1", api_key="tml-alice", max_retries=0)
    assert greedy(alice, path) == CONTINUATION
    assert greedy(alice, BASE) != CONTINUATION
    cards = {m.id: m.model_dump() for m in alice.models.list().data}
    assert list(cards) == [BASE, path]
    assert (cards[path]["parent"], cards[path]["root"]) == (BASE, path)
    assert alice.models.retrieve(path).id == path

    bob = openai.OpenAI(base_url=f"{tinker_url}/v1", api_key="tml-bob", max_retries=0)
    with pytest.raises(openai.NotFoundError) as error:
        greedy(bob, path)
    assert error.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert [m.id for m in bob.models.list().data] == [BASE]


def load(http: TestClient, **body: object) -> Any:
    return http.post("/v1/load_lora_adapter", json=body)


def test_an_adapter_loaded_at_run_time_is_served_kept_and_unloaded(
    tiny_model: Path, peft_folder: Path, tmp_path: Path
) -> None:
    """vLLM's runtime LoRA: loaded, listed and served at once, a rollout target, kept in
    the records database across a restart, unloaded (then a 404 as any unknown model)."""
    db = f"sqlite:///{tmp_path / 'records.db'}"
    app = container(tiny_model, tmp_path, enable_lora=True, usage_db=db).http_app()
    with TestClient(app=app) as http:  # type: ignore[arg-type]
        client = openai.OpenAI(
            base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0
        )
        reply = load(http, lora_name="hello", lora_path=str(peft_folder))
        assert reply.status_code == 200, reply.text
        assert reply.text == "Success: LoRA adapter 'hello' added successfully."
        assert greedy(client, "hello") == CONTINUATION
        assert [m.id for m in client.models.list().data] == [BASE, "hello"]
        canary = {"targets": [{"model": BASE, "weight": 1}, {"model": "hello", "weight": 1}]}
        assert http.put("/admin/rollouts/canary", json=canary).status_code == 200
        refused = http.post("/v1/unload_lora_adapter", json={"lora_name": "hello"})
        assert refused.status_code == 400 and "canary" in refused.json()["error"]["message"]
        assert http.delete("/admin/rollouts/canary").status_code == 200
        audit = [e["event"] for e in http.get("/admin/audit").json()["data"]]
        assert "lora adapter loaded" in audit
    restarted = container(tiny_model, tmp_path, enable_lora=True, usage_db=db).http_app()
    with TestClient(app=restarted) as http:  # type: ignore[arg-type]
        client = openai.OpenAI(
            base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0
        )
        assert greedy(client, "hello") == CONTINUATION  # the store's adapters load at start
        reply = http.post("/v1/unload_lora_adapter", json={"lora_name": "hello"})
        assert reply.status_code == 200, reply.text
        with pytest.raises(openai.NotFoundError):
            greedy(client, "hello")
        again = http.post("/v1/unload_lora_adapter", json={"lora_name": "hello"})
        assert again.status_code == 404
        assert [m.id for m in client.models.list().data] == [BASE]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"lora_name": "x", "lora_path": "/nonexistent"}, "lora_path", "no such folder"),
        ({"lora_name": BASE, "lora_path": "PEFT"}, "lora_name", "is served"),
        ({"lora_name": "x", "lora_path": "EMPTY"}, "lora_path", "not a PEFT LoRA"),
        ({"lora_name": "x", "lora_path": "PEFT"}, "lora_path", "rank 8 is over"),
    ],
)
def test_a_bad_load_is_a_400_naming_the_problem(
    tiny_model: Path, peft_folder: Path, tmp_path: Path, body: dict[str, Any], param: str, says: str
) -> None:
    body = {k: str(peft_folder) if v == "PEFT" else v for k, v in body.items()}
    body = {k: str(tmp_path) if v == "EMPTY" else v for k, v in body.items()}
    app = container(tiny_model, tmp_path, enable_lora=True, max_lora_rank=4).http_app()
    with TestClient(app=app) as http:  # type: ignore[arg-type]
        reply = load(http, **body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param)
        assert says in error["message"], error
