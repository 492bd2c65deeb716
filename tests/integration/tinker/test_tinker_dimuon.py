"""The Dimuon optimizer through the stock tinker SDK (0.38) against our server over real
HTTP, on both backends (the numpy ToyBackend and LoRA on a tiny torch Llama): a run picks
it at creation and keeps it (get_info, weights_info, resumes, restarts), optim_step takes
DimuonParams on it and nothing else; bad parameters and configs are 400s naming the field."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tinker
from tinker import types

from application.tinker.service import TinkerService
from tests.support.tinker_client import SEQ, Api, list_datum, model_body
from tests.support.tinker_server import (
    API_KEY,
    BASE_MODEL,
    backend_app,
    serve,
    toy_service,
)

DIMUON = types.DimuonOptimizerConfig()
# Each LoRA matrix moves by learning_rate * sqrt(rank) per step: the LoRA backend's B·A
# counts alpha / rank = 8 times, the toy's once.
LEARNING_RATE = {"toy": 0.4, "lora": 0.05}


DATA = [list_datum(SEQ)]


def step(tc: tinker.TrainingClient, params: Any) -> float:
    fb = tc.forward_backward(DATA, "cross_entropy")
    tc.optim_step(params).result()
    loss: float = fb.result().metrics["loss:sum"]
    return loss


def optimizer(config: Any) -> dict[str, Any]:
    """An ``OptimizerConfig`` as the SDK parsed it (a DimuonOptimizerConfig arrives as an
    OptimizerConfigBase with its version), as a dict."""
    dumped: dict[str, Any] = config.model_dump()
    return dumped


DIMUON_JSON = {"type": "dimuon", "version": 1}


def forward_loss(tc: tinker.TrainingClient) -> float:
    loss: float = tc.forward(DATA, "cross_entropy").result().metrics["loss:sum"]
    return loss


@pytest.fixture(params=["toy", "lora"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
def url(backend_kind: str, tmp_path: Path, tiny_model: Path) -> Iterator[str]:
    with serve(backend_app(backend_kind, tmp_path / "ckpt", tiny_model)[0]) as base_url:
        yield base_url


@pytest.fixture
def sdk(url: str) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    yield sc
    sc.close("success").result()


def test_a_dimuon_run_trains_keeps_its_momentum_and_takes_no_adam_params(
    sdk: tinker.ServiceClient, url: str, backend_kind: str
) -> None:
    dimuon = types.DimuonParams(learning_rate=LEARNING_RATE[backend_kind], beta1=0.8)
    tc = sdk.create_lora_training_client(
        base_model=BASE_MODEL, rank=4, seed=1, optimizer=DIMUON
    ).result()
    assert optimizer(tc.get_info().optimizer_config) == DIMUON_JSON
    losses = [step(tc, dimuon) for _ in range(4)]
    assert forward_loss(tc) < 0.8 * losses[0], losses

    path = tc.save_state("s4").result().path
    rest = tinker.RestClient(base_url=url, api_key=API_KEY)
    weights = rest.get_weights_info_by_tinker_path(path).result()
    assert optimizer(weights.optimizer_config) == DIMUON_JSON
    step(tc, dimuon)
    expected = forward_loss(tc)

    # The checkpoint's momentum: the same step, in a new run and back in this one.
    resumed = sdk.create_training_client_from_state_with_optimizer(path).result()
    assert optimizer(resumed.get_info().optimizer_config) == DIMUON_JSON
    step(resumed, dimuon)
    assert forward_loss(resumed) == pytest.approx(expected, rel=1e-5)
    with pytest.warns(FutureWarning, match="load_state"):  # deprecated, still served
        tc.load_state_with_optimizer(path).result()
    step(tc, dimuon)
    assert forward_loss(tc) == pytest.approx(expected, rel=1e-5)
    # Weights only: Dimuon again (asked for), its momentum from zero: elsewhere.
    fresh = sdk.create_training_client_from_state(path, optimizer=DIMUON).result()
    assert optimizer(fresh.get_info().optimizer_config) == DIMUON_JSON
    step(fresh, dimuon)
    assert forward_loss(fresh) != pytest.approx(expected, rel=1e-4)

    # One family per run: AdamParams on a Dimuon run, DimuonParams on an AdamW run.
    with pytest.raises(tinker.BadRequestError, match="optim_step takes DimuonParams"):
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    adam = sdk.create_training_client_from_state(path).result()  # the default: AdamW
    assert optimizer(adam.get_info().optimizer_config) == {"type": "adamw"}
    with pytest.raises(tinker.BadRequestError, match="optim_step takes AdamParams"):
        adam.optim_step(dimuon).result()
    with pytest.raises(tinker.BadRequestError, match="cannot override the optimizer state"):
        sdk._create_training_client_via_load_weights_submit(
            path,
            optimizer=True,
            optimizer_config=types.AdamOptimizerConfig(),
            base_model=None,
            user_metadata=None,
            weights_access_token=None,
        ).result()


def test_the_runs_optimizer_survives_a_restart(tmp_path: Path, tiny_model: Path) -> None:
    root = tmp_path / "ckpt"
    dimuon = types.DimuonParams(learning_rate=LEARNING_RATE["toy"])
    with serve(backend_app("toy", root, tiny_model)[0]) as url:
        sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, optimizer=DIMUON)
        tc = tc.result()
        step(tc, dimuon)
        path = tc.save_state("before").result().path
        run_id = tc.model_id
        sc.close("success").result()

    app, service = backend_app("toy", root, tiny_model)
    assert service.checkpoints.runs[run_id].optimizer == "dimuon"
    with serve(app) as url:
        sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        resumed = sc.create_training_client_from_state_with_optimizer(path).result()
        assert optimizer(resumed.get_info().optimizer_config) == DIMUON_JSON
        step(resumed, dimuon)
        with pytest.raises(tinker.BadRequestError, match="DimuonParams"):
            resumed.optim_step(types.AdamParams()).result()
        sc.close("success").result()


# --- bad input over raw HTTP (the SDK validates its own types first) ----------------------


@pytest.fixture
def service(tmp_path: Path) -> TinkerService:
    return toy_service(tmp_path / "ckpt")


def test_create_model_refuses_optimizers_it_does_not_have(api: Api) -> None:
    session = api.session()
    for config, field in [
        ({"type": "sgd"}, "optimizer_config.type 'sgd'"),
        ({"type": "dimuon", "version": 2}, "optimizer_config.version 2"),
    ]:
        answer = api.post("create_model", model_body(session, 0, optimizer_config=config), 400)
        assert field in answer["detail"] and answer["category"] == "user"
    model_id = api.model(session, 1, optimizer_config={"type": "dimuon", "version": 1})
    info = api.post("get_info", {"model_id": model_id})
    assert info["optimizer_config"] == {"type": "dimuon", "version": 1}


def test_optim_step_refuses_bad_dimuon_params_naming_the_field(api: Api) -> None:
    session = api.session()
    dimuon_run = api.model(session, 0, optimizer_config={"type": "dimuon"})
    adam_run = api.model(session, 1)
    ok = {"type": "dimuon", "learning_rate": 0.1, "grad_clip_norm": 0.0, "beta1": 0.9}
    for given, field in [
        ({**ok, "learning_rate": -1.0}, "optimizer_params.learning_rate"),
        ({**ok, "learning_rate": 2.0}, "optimizer_params.learning_rate"),
        ({**ok, "beta1": 1.0}, "optimizer_params.beta1"),
        ({**ok, "beta1": "high"}, "optimizer_params"),
        ({"type": "dimuon", "beta1": 0.5}, "optimizer_params.learning_rate"),
        ({**ok, "damping": 0.1}, "optimizer_params.damping"),
        ({**ok, "type": "lion"}, "optimizer_params.type 'lion'"),
    ]:
        answer = api.post("optim_step", {"model_id": dimuon_run, "optimizer_params": given}, 400)
        assert field in answer["detail"], (given, answer)
    # Out of float range in JSON (1e999): a 400, never a 500.
    body = json.dumps({"model_id": dimuon_run, "optimizer_params": ok})
    body = body.replace('"grad_clip_norm": 0.0', '"grad_clip_norm": 1e999')
    response = api.http.post("/api/v1/optim_step", content=body, headers=api.headers)
    assert response.status_code == 400, response.text
    assert "optimizer_params" in response.json()["detail"]
    # The other family's parameters, either way round.
    answer = api.post("optim_step", {"model_id": dimuon_run, "adam_params": {}}, 400)
    assert "optim_step takes DimuonParams, got AdamParams" in answer["detail"]
    answer = api.post("optim_step", {"model_id": adam_run, "optimizer_params": ok}, 400)
    assert "optim_step takes AdamParams, got DimuonParams" in answer["detail"]
    # And the good ones step (sent as the SDK sends them, or as optim_params).
    for key in ("optimizer_params", "optim_params"):
        result = api.run("optim_step", {"model_id": dimuon_run, key: ok})
        assert result["metrics"]["learning_rate:mean"] == 0.1
