"""Server-side custom losses end to end: the stock SDK's ``create_custom_loss`` uploads the
traced loss and ``forward_backward_custom`` runs it here by its loss id; the same loss
run client-side (a server that leaves ``custom_loss_server_side`` off) gives the same
metrics and the same training step, on both backends. Hostile uploads over raw HTTP are
answered 400 naming the problem, and nothing of them runs."""

import builtins
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
import torch
import torch.nn.functional as F
from litestar.testing import TestClient
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from application.tinker.service import TinkerService
from domain.tinker.custom_loss import MAX_BODY_BYTES, MAX_NODES
from tests.support.tinker_client import Api, post_proto
from tests.support.tinker_server import (
    API_KEY,
    BASE_MODEL,
    backend_app,
    serve,
    tinker_app,
    toy_service,
)

SEQS = [[5, 17, 42, 7, 99, 3, 250, 8], [11, 3, 64, 64, 2, 9], [200, 100, 50, 25, 12]]


def dpo_pair(logprobs, chosen_mask, rejected_mask, ref_chosen, ref_rejected):
    """The cookbook's DPO loss for a datum holding a chosen and a rejected completion."""
    chosen = torch.dot(logprobs, chosen_mask) - ref_chosen
    rejected = torch.dot(logprobs, rejected_mask) - ref_rejected
    loss = -F.logsigmoid(0.5 * (chosen - rejected))
    return loss, {
        "custom/dpo:mean": loss,
        "custom/accuracy:mean": (chosen > rejected).float(),
        "custom/chosen:sum": chosen,
    }


def weighted_nll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss}


def floats(values: list[float]) -> types.TensorData:
    return types.TensorData(data=values, dtype="float32", shape=[len(values)])


def dpo_data() -> list[types.Datum]:
    data = []
    for i, seq in enumerate(SEQS):
        n = len(seq) - 1
        half = n // 2
        inputs = {
            "target_tokens": seq[1:],
            "chosen_mask": floats([1.0] * half + [0.0] * (n - half)),
            "rejected_mask": floats([0.0] * half + [1.0] * (n - half)),
            "ref_chosen": types.TensorData(data=[-20.0 - i], dtype="float32", shape=[]),
            "ref_rejected": types.TensorData(data=[-25.0 + i], dtype="float32", shape=[]),
        }
        data.append(
            types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs)
        )
    return data


DPO_RANKS: dict[str, types.CustomLossInputRank] = {
    "logprobs": 1,
    "chosen_mask": 1,
    "rejected_mask": 1,
    "ref_chosen": 0,
    "ref_rejected": 0,
}


Make = Callable[[Path, bool], Any]


@pytest.fixture(params=["toy", "lora"])
def make_server(request: pytest.FixtureRequest, tiny_model: Path) -> Make:
    """``make_server(root, server_side)``: a context manager serving a fresh server."""

    def make(root: Path, server_side: bool) -> Any:
        config = {} if server_side else {"custom_loss_server_side": False}
        return serve(backend_app(request.param, root, tiny_model, client_config=config)[0])

    return make


def train_once(url: str, server_side: bool) -> tuple[dict[str, float], list[float], bool]:
    """One DPO step through the SDK: (forward_backward_custom's metrics, the logprobs of
    the data after the step, whether the loss was uploaded)."""
    sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    try:
        handle = sc.create_custom_loss(dpo_pair, DPO_RANKS).result()
        assert (handle.loss_id is not None) == server_side
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
        data = dpo_data()
        # A first step so the adapter's B is not zero (every weight then moves).
        tc.forward_backward(data, "cross_entropy", None).result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        out = tc.forward_backward_custom(data, handle).result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        after = tc.forward(data, "cross_entropy").result()
        logprobs = [v for o in after.loss_fn_outputs for v in o["logprobs"].tolist()]
        return out.metrics, logprobs, handle.loss_id is not None
    finally:
        sc.close("success").result()


def test_a_server_side_loss_trains_as_the_client_side_one(make_server: Make, tmp_path: Path):
    with make_server(tmp_path / "a", True) as url:
        server, server_logprobs, uploaded = train_once(url, True)
    with make_server(tmp_path / "b", False) as url:
        client, client_logprobs, _ = train_once(url, False)
    assert uploaded
    assert "surrogate_loss:sum" in client and "surrogate_loss:sum" not in server
    for key in ("loss:sum", "custom/dpo:mean", "custom/accuracy:mean", "custom/chosen:sum"):
        assert server[key] == pytest.approx(client[key], rel=1e-4, abs=1e-6), key
    # The same step: the weights after it score the data alike.
    assert server_logprobs == pytest.approx(client_logprobs, rel=1e-4, abs=1e-5)
    assert server_logprobs != pytest.approx(client_logprobs[::-1])  # (the data differ)


def test_the_sdk_uploads_and_the_server_refuses_what_the_data_lack(tmp_path: Path) -> None:
    with serve(tinker_app(toy_service(tmp_path))) as url:
        sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        assert sc.holder.get_client_config().custom_loss_server_side
        handle = sc.create_custom_loss(weighted_nll, {"logprobs": 1, "weights": 1}).result()
        assert handle.loss_id == f"{sc.holder.get_session_id()}:loss:0"
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
        seq = SEQS[0]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": seq[1:], "weights": [0.5] * (len(seq) - 1)},
        )
        custom = tc.forward_backward_custom([datum], handle).result()
        builtin = tc.forward([datum], "cross_entropy").result()
        assert custom.metrics["loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-5)
        assert custom.metrics["custom/nll:sum"] == pytest.approx(custom.metrics["loss:sum"])
        # A loss id the server does not hold (another session's, or none) is refused.
        other = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        foreign = other.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        with pytest.raises(tinker.BadRequestError, match="belongs to session"):
            foreign.forward_backward([datum], "custom", {"loss_id": handle.loss_id}).result()
        with pytest.raises(tinker.NotFoundError, match="no custom loss"):
            tc.forward_backward([datum], "custom", {"loss_id": "nope"}).result()
        with pytest.raises(tinker.BadRequestError, match="only for loss_fn 'custom'"):
            tc.forward_backward([datum], "cross_entropy", {"loss_id": "x"}).result()
        other.close("success").result()
        sc.close("success").result()


# --- raw HTTP -----------------------------------------------------------------------------


def body(session_id: str, nodes: list[dict[str, Any]], seq: int = 0, **extra: Any) -> dict:
    inputs = [{"name": "logprobs", "rank": 1}, {"name": "weights", "rank": 1}]
    return {
        "session_id": session_id,
        "custom_loss_seq_id": seq,
        "name": "loss",
        "inputs": inputs,
        "graph": {"format": 1, "nodes": nodes},
        "type": "create_custom_loss",
        **extra,
    }


def nll_nodes(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    def n(op: str, name: str, target: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}

    out = {"tuple": [{"ref": "neg"}, {"dict": {"custom/nll:sum": {"ref": "neg"}}}]}
    return [
        n("placeholder", "logprobs", "logprobs"),
        n("placeholder", "weights", "weights"),
        n("call_function", "mul", "operator.mul", {"ref": "logprobs"}, {"ref": "weights"}),
        n("call_method", "sum_1", "sum", {"ref": "mul"}),
        n("call_function", "neg", "operator.neg", {"ref": "sum_1"}),
        *extra,
        n("output", "output", "output", out),
    ]


def call(target: str, *args: Any, op: str = "call_function", name: str = "bad") -> dict:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": {}}


MARK = "PWNED"  # in every payload string: a call carrying it ran the upload
HOSTILE = {
    "eval": (call("builtins.eval", f"__import__('os').system('{MARK}')"), "'builtins.eval'"),
    "exec": (call("builtins.exec", f"import os; os.system('{MARK}')"), "'builtins.exec'"),
    "os.system": (call("os.system", f"touch /tmp/{MARK}"), "'os.system'"),
    "import": (call("builtins.__import__", MARK), "'builtins.__import__'"),
    "torch.load": (call("torch.load", f"/tmp/{MARK}"), "'torch.load'"),
    "getattr chain": (call("getattr", {"ref": "logprobs"}, "__class__"), "'__class__'"),
    "dunder method": (call("__reduce_ex__", {"ref": "logprobs"}, 2, op="call_method"), "method"),
    "unknown op": (call("torch.frobnicate", {"ref": "logprobs"}), "'torch.frobnicate'"),
    "module": (call("fc", {"ref": "logprobs"}, op="call_module"), "module 'fc'"),
    "forward ref": (call("operator.neg", {"ref": "later"}), "refers to 'later'"),
    "NaN": (call("operator.mul", {"ref": "logprobs"}, {"float": "nan"}), "NaN"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_graph_is_a_400_naming_it_and_nothing_runs(
    client: TestClient[Any], service: TinkerService, monkeypatch, case: str
) -> None:
    ran: list[object] = []

    def spy(module: Any, name: str) -> None:
        original = getattr(module, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if any(MARK in str(a) for a in args):
                ran.append((name, args))
                return None
            return original(*args, **kwargs)  # the server's own use

        monkeypatch.setattr(module, name, call)

    for module, name in [
        (builtins, "eval"),
        (builtins, "exec"),
        (builtins, "__import__"),
        (os, "system"),
        (subprocess, "Popen"),
        (torch, "load"),
    ]:
        spy(module, name)
    api = Api(client)
    session = api.session()
    node, shown = HOSTILE[case]
    answer = api.post("create_custom_loss", body(session, nll_nodes(node)), status=400)
    assert shown in answer["detail"] and answer["category"] == "user", answer
    assert "node 'bad'" in answer["detail"] or case == "NaN", answer
    assert ran == [] and len(service.custom_losses) == 0


def test_size_and_shape_limits_are_400s(client: TestClient[Any]) -> None:
    api = Api(client)
    session = api.session()
    many = [call("operator.neg", {"ref": "logprobs"}, name=f"n{i}") for i in range(MAX_NODES)]
    answer = api.post("create_custom_loss", body(session, nll_nodes(*many)), status=400)
    assert f"the most allowed is {MAX_NODES}" in answer["detail"]
    huge = body(session, nll_nodes(), padding="x" * MAX_BODY_BYTES)
    answer = api.post("create_custom_loss", huge, status=400)
    assert f"exceeds {MAX_BODY_BYTES} bytes" in answer["detail"]
    nested = json.dumps(body(session, nll_nodes(call("torch.tensor", "DEEP"))))
    deep = "[" * 5000 + "1.0" + "]" * 5000  # past any parser's recursion: refused, not a 500
    response = client.post(
        "/api/v1/create_custom_loss",
        content=nested.replace('"DEEP"', deep).encode(),
        headers={**api.headers, "content-type": "application/json"},
    )
    assert response.status_code == 400 and "depth" in response.json()["detail"], response.text
    wrong = body(session, nll_nodes(), inputs=[{"name": "logprobs", "rank": 1}])
    answer = api.post("create_custom_loss", wrong, status=400)
    assert "placeholder after the inputs" in answer["detail"]
    rank3 = body(
        session,
        nll_nodes(),
        inputs=[{"name": "logprobs", "rank": 1}, {"name": "weights", "rank": 3}],
    )
    assert "rank 3" in api.post("create_custom_loss", rank3, status=400)["detail"]


def test_a_stored_loss_runs_by_id_over_raw_http(
    client: TestClient[Any], service: TinkerService
) -> None:
    api = Api(client)
    session = api.session()
    created = api.run("create_custom_loss", body(session, nll_nodes()))
    reply = types.CreateCustomLossResponse.model_validate(created)  # the SDK's type
    assert reply.loss_id == f"{session}:loss:0"
    # A retry of the same request gets the same id; another graph under it is a conflict.
    assert api.run("create_custom_loss", body(session, nll_nodes()))["loss_id"] == reply.loss_id
    other = nll_nodes(call("operator.neg", {"ref": "neg"}, name="x"))
    assert (
        "another loss" in api.post("create_custom_loss", body(session, other), status=400)["detail"]
    )
    assert api.post("create_custom_loss", body("session-nope", nll_nodes()), status=404)
    # forward_backward by loss id, protobuf as the SDK sends it (loss_fn_config_v2 text).
    model_id = api.model(session)
    seq = SEQS[0]
    weights = np.full(len(seq) - 1, 2.0, np.float32)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": weights.tolist()},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="custom", loss_fn_config={"loss_id": reply.loss_id}
        ),
        model_id=model_id,
        seq_id=1,
    )
    response = post_proto(client, forward_backward_request_to_proto(request))
    assert response.status_code == 200, response.text
    result = api.result(response.json()["request_id"])
    assert result["metrics"]["custom/nll:sum"] == pytest.approx(result["metrics"]["loss:sum"])
    # The same through JSON: the loss id is a text value of loss_fn_config.
    fb = {
        "model_id": model_id,
        "seq_id": 2,
        "forward_backward_input": {
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": seq[:-1]}]},
                    "loss_fn_inputs": {
                        "target_tokens": {"data": seq[1:], "dtype": "int64"},
                        "weights": {"data": weights.tolist(), "dtype": "float32"},
                    },
                }
            ],
            "loss_fn": "custom",
            "loss_fn_config": {"loss_id": reply.loss_id},
        },
    }
    again = api.result(api.post("forward_backward", fb)["request_id"])
    assert again["metrics"]["loss:sum"] == pytest.approx(result["metrics"]["loss:sum"], rel=1e-5)
    # The session's end takes its losses with it.
    api.post(f"sessions/{session}/finish", {})
    assert len(service.custom_losses) == 0
