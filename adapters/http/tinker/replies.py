"""The Tinker face's reply bodies: JSON responses, listings with the SDK's cursor, and the
JSON forms of runs, checkpoints and future results."""

from datetime import UTC, datetime
from typing import Any

import msgspec
from litestar import Request, Response

from adapters.http.tinker.codec import json as json_codec
from application.tinker.custom_losses import CustomLossCreated
from application.tinker.sampling import SamplerReady
from application.tinker.service import RunSummary
from application.tinker.training import ModelReady, OptimStepped, SavedCheckpoint
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import CheckpointRecord

PROTOBUF = "application/x-protobuf"
_json = msgspec.json.Encoder()


def ok(value: object) -> Response[bytes]:
    return Response(_json.encode(value), media_type="application/json")


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


def page(request: Request[Any, Any, Any]) -> tuple[int, int]:
    """The ``offset`` and ``limit`` query parameters."""
    try:
        offset = max(0, int(request.query_params.get("offset", 0)))
        limit = min(1000, max(1, int(request.query_params.get("limit", 100))))
    except ValueError as e:
        raise InvalidTrainingRequest("offset and limit must be integers") from e
    return offset, limit


def paged(request: Request[Any, Any, Any], key: str, items: list[Any]) -> Response[bytes]:
    """One page (``offset``, ``limit``) of ``items`` with the SDK's cursor."""
    offset, limit = page(request)
    cursor = {"offset": offset, "limit": limit, "total_count": len(items)}
    return ok({key: items[offset : offset + limit], "cursor": cursor})


def checkpoint_json(c: CheckpointRecord) -> dict[str, Any]:
    return {
        "checkpoint_id": c.checkpoint_id,
        "checkpoint_type": c.kind,
        "time": iso(c.created_at),
        "tinker_path": c.tinker_path,
        "size_bytes": c.size_bytes,
        "public": c.public,
        "user_metadata": c.user_metadata or None,
        "expires_at": iso(c.expires_at) if c.expires_at is not None else None,
    }


def run_json(summary: RunSummary) -> dict[str, Any]:
    run, last, last_sampler = summary.run, summary.last_checkpoint, summary.last_sampler_checkpoint
    return {
        "training_run_id": run.run_id,
        "base_model": run.base_model,
        "model_owner": run.owner,
        "is_lora": True,
        "corrupted": run.corrupted,
        "lora_rank": run.lora.rank,
        "last_request_time": iso(run.last_request_at),
        "last_checkpoint": checkpoint_json(last) if last else None,
        "last_sampler_checkpoint": checkpoint_json(last_sampler) if last_sampler else None,
        "user_metadata": run.user_metadata or None,
    }


def result_json(kind: str, result: object) -> dict[str, Any]:
    """A finished future's result (other than samples and forward/backward outputs)."""
    if isinstance(result, ModelReady):
        if kind == "CreateModel":
            return {"type": "create_model", "model_id": result.model_id}
        if kind == "UnloadModel":
            return {"type": "unload_model", "model_id": result.model_id}
        return {"type": "load_weights", "path": result.path, "model_id": result.model_id}
    if isinstance(result, OptimStepped):
        return {"metrics": json_codec.metrics(result.metrics)}
    if isinstance(result, SavedCheckpoint):
        kinds = {"training": "save_weights", "sampler": "save_weights_for_sampler"}
        return {
            "type": kinds.get(result.record.kind, "save_weights_external"),
            "path": result.record.tinker_path,
        }
    if isinstance(result, SamplerReady):
        return {"type": "save_weights_for_sampler", "sampling_session_id": result.sampler_id}
    if isinstance(result, CustomLossCreated):
        return {"type": "create_custom_loss", "loss_id": result.loss_id}
    raise TypeError(f"no JSON form for {type(result).__name__}")


def accepted(request_id: str, model_id: str) -> Response[bytes]:
    """The answer to a training request: its future, and the run it is for."""
    return ok({"request_id": request_id, "model_id": model_id})
