"""Raw HTTP against the Tinker API (a TestClient or an httpx.Client): the test key's headers,
a session, a model, futures polled to their result, and request bodies (JSON and protobuf)."""

import time
from typing import Any

import numpy as np
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.support.tinker_server import BASE_MODEL

KEY = "tml-test"
HEADERS = {"X-API-Key": KEY}
PROTOBUF = "application/x-protobuf"
SEQ = [5, 17, 42, 7, 99, 3, 250, 8]


class Api:
    """Raw calls against a TestClient or an httpx.Client (same interface)."""

    def __init__(self, http: Any, headers: dict[str, str] | None = None) -> None:
        self.http = http
        self.headers = HEADERS if headers is None else headers

    def post(self, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
        response = self.http.post(f"/api/v1/{path}", json=body, headers=self.headers)
        assert response.status_code == status, response.text
        result: dict[str, Any] = response.json()
        return result

    def get(self, path: str, status: int = 200) -> Any:
        response = self.http.get(f"/api/v1/{path}", headers=self.headers)
        assert response.status_code == status, response.text
        return response.json()

    def put(self, path: str, body: dict[str, Any], status: int = 200) -> Any:
        response = self.http.put(f"/api/v1/{path}", json=body, headers=self.headers)
        assert response.status_code == status, response.text
        return response.json()

    def poll(self, request_id: str, **extra: Any) -> dict[str, Any]:
        return self.post("retrieve_future", {"request_id": request_id, **extra})

    def result(self, request_id: str, **extra: Any) -> dict[str, Any]:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            answer = self.poll(request_id, **extra)
            if answer.get("type") != "try_again":
                return answer
        raise AssertionError(f"future {request_id} never finished")

    def run(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Submit a future and return its (successful) result."""
        answer = self.result(self.post(path, body)["request_id"])
        assert "error" not in answer, answer
        return answer

    def session(self, **extra: Any) -> str:
        session_id: str = self.post("create_session", {"tags": [], **extra})["session_id"]
        return session_id

    def model(self, session_id: str, seq: int = 0, **extra: Any) -> str:
        body = {**model_body(session_id, seq, lora_config={"rank": 4, "seed": 0}), **extra}
        model_id: str = self.run("create_model", body)["model_id"]
        return model_id

    def sampler(self, session_id: str, **source: Any) -> str:
        """A sampling session (seq id 0) of ``source``: ``base_model=`` or ``model_path=``."""
        body = {"session_id": session_id, "sampling_session_seq_id": 0, **source}
        sampling_session_id: str = self.post("create_sampling_session", body)["sampling_session_id"]
        return sampling_session_id

    def forward_backward(self, model_id: str, seq_id: int, *, forward_only: bool = False) -> str:
        msg = forward_backward_proto(model_id, seq_id, forward_only=forward_only)
        response = post_proto(self.http, msg, self.headers)
        assert response.status_code == 200, response.text
        request_id: str = response.json()["request_id"]
        return request_id


def model_body(session_id: str, seq: int = 0, **extra: Any) -> dict[str, Any]:
    """A create_model body: a rank-4 LoRA of the base model (``extra``: fields to add or
    replace)."""
    return {
        "session_id": session_id,
        "model_seq_id": seq,
        "base_model": BASE_MODEL,
        "lora_config": {"rank": 4},
        **extra,
    }


def forward_backward_proto(model_id: str, seq_id: int, *, forward_only: bool = False) -> Any:
    """A forward_backward request (cross entropy on ``SEQ``) as the SDK's protobuf message."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum(SEQ)], loss_fn="cross_entropy"
        ),
        model_id=model_id,
        seq_id=seq_id,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg


def post_proto(http: Any, msg: Any, headers: dict[str, str] = HEADERS) -> Any:
    """POST the protobuf ``msg`` to forward_backward; the response."""
    return http.post(
        "/api/v1/forward_backward",
        content=msg.SerializeToString(),
        headers={**headers, "Content-Type": PROTOBUF},
    )


def datum(tokens: list[int]) -> types.Datum:
    inputs = {
        "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64)),
        "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, dtype=np.float32)),
    }
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def list_datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    """The datum with its inputs as plain lists (the SDK sends them as such)."""
    inputs: dict[str, Any] = {
        "target_tokens": tokens[1:],
        "weights": weights or [1.0] * (len(tokens) - 1),
    }
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def json_datum(tokens: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1], **extra}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": tokens[1:], "dtype": "int64", **extra},
            "weights": {"data": [1.0] * (len(tokens) - 1), "dtype": "float32"},
        },
        **extra,
    }


def sample_body(tokens: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "sampling_params": {"max_tokens": 3, "seed": 1},
        "base_model": BASE_MODEL,
        **extra,
    }
