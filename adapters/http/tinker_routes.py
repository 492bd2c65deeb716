"""The Tinker API (``/api/v1/...``) for the stock ``tinker`` SDK, over a TinkerService.

Thin: parse, check the key, call the application, encode. Keys arrive in ``X-API-Key``;
every session, run, sampler and checkpoint belongs to the key that made it (another key
gets 404). Errors are 4xx JSON ``{"detail": ..., "error": ..., "category": ...}`` — never
408/409/429/5xx for a permanent error, which the SDK would retry for minutes (429 only
when a run's queue of waiting requests is full: retrying is then the right thing). A failed
future answers ``{"error", "category"}`` with 200, as the SDK expects. Error bodies never
carry exception text or the server's file paths.

Checkpoint download links are signed with a key kept with the checkpoints (so they outlive
a restart) over the checkpoint's version (so a link never serves another save under the
same name).
"""

import hashlib
import hmac
import io
import tarfile
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import msgspec
import structlog
from litestar import Request, Response, Router, delete, get, post, put
from litestar.exceptions import HTTPException
from litestar.params import FromPath

from adapters.http import tinker_codec as codec
from application.tinker.service import TinkerService
from application.tinker.training import ModelReady, OptimStepped, SavedCheckpoint
from domain.training import (
    CheckpointRecord,
    CheckpointRef,
    ForwardBackwardResult,
    InvalidTrainingRequest,
    NotFoundError,
    RetryLaterError,
    RunRecord,
    SessionClosedError,
    TinkerSampleResult,
    TrainingError,
    UnsupportedFeatureError,
    WeightsSource,
    check_checkpoint_name,
    checkpoint_id,
)

log = structlog.get_logger(__name__)
PROTOBUF = "application/x-protobuf"
_URL_TTL_S = 3600
_json = msgspec.json.Encoder()


class TinkerHTTPError(Exception):
    def __init__(self, status: int, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.status, self.message, self.category = status, message, category


def _status(e: TrainingError) -> int:
    if isinstance(e, NotFoundError):
        return 404
    if isinstance(e, SessionClosedError):
        return 410
    if isinstance(e, RetryLaterError):
        return 429
    return 400  # invalid, unsupported, sequence conflicts (and backend failures on input)


def tinker_error_response(_: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    if isinstance(exc, TrainingError):
        exc = TinkerHTTPError(_status(exc), str(exc), exc.category)
    if isinstance(exc, TinkerHTTPError):
        status, message, category = exc.status, exc.message, exc.category
    elif isinstance(exc, HTTPException):
        status, message, category = exc.status_code, str(exc.detail), "user"
    else:  # a bug: the details go to the log only
        log.exception("tinker_internal_error", exc_info=exc)
        status, message, category = 500, "internal error (logged)", "server"
    body = {"detail": message, "error": message, "category": category}
    headers = {"retry-after": "1"} if status == 429 else None
    return Response(
        _json.encode(body), status_code=status, media_type="application/json", headers=headers
    )


def _ok(value: object) -> Response[bytes]:
    return Response(_json.encode(value), media_type="application/json")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


def tinker_router(
    service: TinkerService,
    *,
    api_keys: frozenset[str] | None = None,
    client_config: Mapping[str, object] | None = None,
) -> Router:
    """``api_keys``: the keys allowed; None accepts any ``tml-`` key (each its own owner).
    ``client_config``: what ``/client/config`` tells the SDK (besides the chunk size that
    keeps its forward/backward requests within the server's token limit)."""
    # The SDK estimates 4 bytes per token and more for the loss inputs: chunks of at most
    # this many estimated bytes never hold more tokens than one request may.
    config = {
        "fwdbwd_max_chunk_bytes_count": 4 * service.limits.max_tokens_per_request,
        **(client_config or {}),
    }

    def owner(request: Request[Any, Any, Any]) -> str:
        key = request.headers.get("x-api-key") or ""
        if not key and (auth := request.headers.get("authorization", "")).startswith("Bearer "):
            key = auth[len("Bearer ") :]
        if not key:
            raise TinkerHTTPError(401, "missing API key: send it in the X-API-Key header")
        if api_keys is not None and key not in api_keys:
            raise TinkerHTTPError(401, "invalid API key")
        if api_keys is None and not key.startswith("tml-"):
            raise TinkerHTTPError(401, "API keys start with 'tml-'")
        return hashlib.sha256(key.encode()).hexdigest()[:24]

    # --- service and sessions ----------------------------------------------------------

    @get("/healthz")
    async def healthz() -> Response[bytes]:
        return _ok({"status": "ok"})

    @post("/client/config", status_code=200)
    async def get_client_config() -> Response[bytes]:
        return _ok(config)

    @get("/get_server_capabilities")
    async def capabilities() -> Response[bytes]:
        models = []
        for info in service.training.backend.base_models:
            for name in (info.name, *info.aliases):
                models.append(
                    {
                        "model_name": name,
                        "max_context_length": info.max_context_length,
                        "trainable": True,
                        "sampleable": True,
                    }
                )
        return _ok({"supported_models": models})

    @post("/create_session", status_code=200)
    async def create_session(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        body = codec.decode(await request.body(), codec.CreateSessionIn)
        session = service.sessions.create(
            who,
            tags=body.tags,
            user_metadata={k: str(v) for k, v in (body.user_metadata or {}).items()},
            display_name=body.display_name,
            sdk_version=body.sdk_version,
        )
        return _ok({"type": "create_session", "session_id": session.id})

    @post("/session_heartbeat", status_code=200)
    async def heartbeat(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        body = codec.decode(await request.body(), codec.SessionIdIn)
        service.sessions.heartbeat(who, body.session_id)
        return _ok({"type": "session_heartbeat"})

    @post("/sessions/{session_id:str}/finish", status_code=200)
    async def finish_session(
        request: Request[Any, Any, Any], session_id: FromPath[str]
    ) -> Response[bytes]:
        service.finish_session(owner(request), session_id)
        return _ok({})

    @get("/sessions")
    async def list_sessions(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        offset, limit = _page(request)
        ids = [s.id for s in service.sessions.owned_by(who)]
        return _ok({"sessions": ids[offset : offset + limit]})

    @get("/sessions/{session_id:str}")
    async def get_session(
        request: Request[Any, Any, Any], session_id: FromPath[str]
    ) -> Response[bytes]:
        session = service.sessions.get(owner(request), session_id)
        runs = [r.run_id for r in service.checkpoints.runs.values() if r.session_id == session_id]
        return _ok(
            {
                "training_run_ids": runs,
                "sampler_ids": service.sampling.of_session(session_id),
                "user_metadata": session.user_metadata or None,
                "display_name": session.display_name,
            }
        )

    @post("/telemetry", status_code=200)
    async def telemetry() -> Response[bytes]:
        return _ok({"status": "accepted"})

    # --- models ------------------------------------------------------------------------

    @post("/create_model", status_code=200)
    async def create_model(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        body = codec.decode(await request.body(), codec.CreateModelIn)
        codec.check_optimizer(body.optimizer_config)
        service.live_session(who, body.session_id)
        future = service.training.create(
            who,
            body.session_id,
            body.model_seq_id,
            body.base_model,
            codec.lora_spec(body.lora_config),
            body.user_metadata,
        )
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        return _ok({"request_id": future.id, "model_id": model_id})

    @post("/get_info", status_code=200)
    async def get_info(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        body = codec.decode(await request.body(), codec.ModelIdIn)
        run = service.checkpoints.run(who, body.model_id)
        info = service.training.base_model(run.base_model)
        return _ok(
            {
                "type": "get_info",
                "model_id": run.run_id,
                "model_data": {
                    "arch": info.arch,
                    "model_name": run.base_model,
                    "tokenizer_id": info.tokenizer_id or None,
                },
                "is_lora": True,
                "lora_rank": run.lora.rank,
                "model_name": run.base_model,
            }
        )

    @post("/unload_model", status_code=200)
    async def unload_model(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        body = codec.decode(await request.body(), codec.ModelIdIn)
        service.training.unload(who, body.model_id)
        future = service.futures.create(who, "UnloadModel")
        service.futures.resolve(future, ModelReady(body.model_id))
        return _ok({"request_id": future.id, "model_id": body.model_id})

    # --- training ----------------------------------------------------------------------

    @post("/forward_backward", status_code=200)
    async def forward_backward(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        raw = await request.body()
        if request.headers.get("content-encoding", "").lower() == "zstd":
            raise UnsupportedFeatureError("zstd bodies are not enabled (client config off)")
        if PROTOBUF in request.headers.get("content-type", ""):
            model_id, seq_id, data, loss_fn, config, forward_only = codec.forward_backward_proto(
                raw
            )
        else:
            body = codec.decode(raw, codec.ForwardBackwardIn)
            model_id, seq_id = body.model_id, body.seq_id
            data = codec.forward_backward_json(body)
            loss_fn = body.forward_backward_input.loss_fn
            config = dict(body.forward_backward_input.loss_fn_config or {})
            forward_only = False
        future = service.training.forward_backward(
            who, model_id, seq_id, data, loss_fn, config, forward_only=forward_only
        )
        return _ok({"request_id": future.id, "model_id": model_id})

    @post("/forward", status_code=200)
    async def forward(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        body = codec.decode(await request.body(), codec.ForwardBackwardIn)
        fbi = body.forward_backward_input
        future = service.training.forward_backward(
            who,
            body.model_id,
            body.seq_id,
            codec.forward_backward_json(body),
            fbi.loss_fn,
            dict(fbi.loss_fn_config or {}),
            forward_only=True,
        )
        return _ok({"request_id": future.id, "model_id": body.model_id})

    @post("/optim_step", status_code=200)
    async def optim_step(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        body = codec.decode(await request.body(), codec.OptimStepIn)
        future = service.training.optim_step(
            who, body.model_id, body.seq_id, codec.adam_params(body)
        )
        return _ok({"request_id": future.id, "model_id": body.model_id})

    # --- weights -----------------------------------------------------------------------

    @post("/save_weights", status_code=200)
    async def save_weights(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        body = codec.decode(await request.body(), codec.SaveWeightsIn)
        future = service.training.save(
            who,
            body.model_id,
            body.seq_id,
            "training",
            body.path,
            ttl_seconds=body.ttl_seconds,
            user_metadata=body.user_metadata,
            overwrite=body.overwrite,
        )
        return _ok({"request_id": future.id, "model_id": body.model_id})

    @post("/save_weights_for_sampler", status_code=200)
    async def save_weights_for_sampler(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        body = codec.decode(await request.body(), codec.SaveForSamplerIn)
        if body.path is not None:
            future = service.training.save(
                who,
                body.model_id,
                body.seq_id,
                "sampler",
                body.path,
                ttl_seconds=body.ttl_seconds,
                user_metadata=body.user_metadata,
            )
            return _ok({"request_id": future.id, "model_id": body.model_id})
        # Unnamed: a sampler on a snapshot of the weights now, or on the live weights.
        run = service.training.live_run(who, body.model_id)
        if body.sampling_session_seq_id is None:
            raise InvalidTrainingRequest("an unnamed save needs sampling_session_seq_id")
        if body.kind not in ("snapshot", "inflight"):
            raise InvalidTrainingRequest(
                f"kind must be 'snapshot' or 'inflight', not {body.kind!r}"
            )
        seq = body.sampling_session_seq_id
        if body.kind == "inflight":
            source = WeightsSource(run.base_model, model_id=run.run_id)
            sampler = service.sampling.create(who, run.session_id, seq, source)
            future = service.futures.create(who, "SaveWeightsForSampler")
            service.futures.resolve(future, _SamplerReady(sampler.id))
            return _ok({"request_id": future.id, "model_id": body.model_id})
        folder = service.scratch_folder()

        def make_sampler() -> object:
            source = WeightsSource(run.base_model, path=folder)
            return _SamplerReady(
                service.sampling.create(who, run.session_id, seq, source, scratch=folder).id
            )

        try:
            future = service.training.snapshot(
                who, body.model_id, body.seq_id, folder, make_sampler
            )
        except BaseException:
            service.storage.discard(folder)
            raise
        return _ok({"request_id": future.id, "model_id": body.model_id})

    @post("/save_weights_external", status_code=200)
    async def save_weights_external(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        body = codec.decode(await request.body(), codec.SaveExternalIn)
        if body.age_encryption_recipients:
            raise UnsupportedFeatureError("age_encryption_recipients is not supported")
        future = service.training.save(
            who, body.model_id, body.seq_id, "external", body.path, ttl_seconds=body.ttl_seconds
        )
        return _ok({"request_id": future.id, "model_id": body.model_id})

    @post("/load_weights", status_code=200)
    async def load_weights(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        body = codec.decode(await request.body(), codec.LoadWeightsIn)
        codec.check_optimizer(body.optimizer_config)
        if body.model_id is not None:
            future = service.training.load(
                who, body.model_id, body.seq_id, body.path, optimizer=body.optimizer
            )
            return _ok({"request_id": future.id, "model_id": body.model_id})
        if body.session_id is None or body.model_seq_id is None:
            raise InvalidTrainingRequest(
                "load_weights needs model_id, or session_id + model_seq_id"
            )
        service.live_session(who, body.session_id)
        future = service.training.create_from_checkpoint(
            who,
            body.session_id,
            body.model_seq_id,
            body.path,
            optimizer=body.optimizer,
            user_metadata=body.user_metadata,
        )
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        return _ok({"request_id": future.id, "model_id": model_id})

    @post("/copy_weights", status_code=200)
    async def copy_weights(request: Request[Any, Any, Any]) -> Response[bytes]:
        owner(request)
        raise UnsupportedFeatureError(
            "copy_weights (between projects) is not supported: this server has one project"
        )

    # --- sampling ----------------------------------------------------------------------

    @post("/create_sampling_session", status_code=200)
    async def create_sampling_session(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        body = codec.decode(await request.body(), codec.CreateSamplingSessionIn)
        service.live_session(who, body.session_id)
        source = service.sampling.source_for(
            who, base_model=body.base_model, model_path=body.model_path
        )
        sampler = service.sampling.create(
            who, body.session_id, body.sampling_session_seq_id, source, model_path=body.model_path
        )
        return _ok({"type": "create_sampling_session", "sampling_session_id": sampler.id})

    @get("/samplers/{sampler_id:str}")
    async def get_sampler(
        request: Request[Any, Any, Any], sampler_id: FromPath[str]
    ) -> Response[bytes]:
        sampler = service.sampling.get(owner(request), sampler_id)
        return _ok(
            {
                "sampler_id": sampler.id,
                "base_model": sampler.source.base_model,
                "model_path": sampler.model_path,
            }
        )

    @post("/asample", status_code=200)
    async def asample(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        body = codec.decode(await request.body(), codec.SampleIn)
        codec.check_sample_features(body)
        if body.sampling_session_id is not None:
            source = service.sampling.source_of(service.sampling.get(who, body.sampling_session_id))
        else:
            source = service.sampling.source_for(
                who, base_model=body.base_model, model_path=body.model_path
            )
        prompt = codec.prompt_tokens(body.prompt)
        context = service.training.base_model(source.base_model).max_context_length
        params = codec.sample_params(body.sampling_params, max(1, context - len(prompt)))
        last_n = body.prompt_logprobs_last_n
        if last_n is not None and not 1 <= last_n < max(2, len(prompt)):
            raise InvalidTrainingRequest("prompt_logprobs_last_n must be in 1..len(prompt)-1")
        future = service.sampling.sample(
            who,
            source,
            prompt,
            params,
            body.num_samples,
            prompt_logprobs=bool(body.prompt_logprobs),
            prompt_logprobs_last_n=last_n,
            topk_prompt=body.topk_prompt_logprobs,
            topk_sample=body.topk_sample_logprobs,
        )
        return _ok(
            {
                "request_id": future.id,
                "sample_sequence_ids": [f"{future.id}:{i}" for i in range(body.num_samples)],
            }
        )

    # --- futures -----------------------------------------------------------------------

    @post("/retrieve_future", status_code=200)
    async def retrieve_future(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        body = codec.decode(await request.body(), codec.RetrieveFutureIn)
        future = await service.futures.wait(who, body.request_id, service.long_poll_s)
        if not future.finished:
            return _ok({"type": "try_again", "request_id": future.id, "queue_state": "active"})
        if future.error is not None:
            return _ok({"error": str(future.error), "category": future.error.category})
        proto = PROTOBUF in request.headers.get("accept", "")
        result = future.result
        if isinstance(result, ForwardBackwardResult):
            if proto:
                return Response(codec.forward_backward_output_proto(result), media_type=PROTOBUF)
            return _ok(codec.forward_backward_output_json(result))
        if isinstance(result, TinkerSampleResult):
            if proto:
                return Response(codec.sample_response_proto(result), media_type=PROTOBUF)
            return _ok(codec.sample_response_json(result))
        return _ok(_result_json(future.kind, result))

    # --- REST: runs and checkpoints ----------------------------------------------------

    @get("/training_runs")
    async def list_runs(request: Request[Any, Any, Any]) -> Response[bytes]:
        runs = service.checkpoints.runs_of(owner(request))
        return _paged(request, "training_runs", [_run_json(r) for r in runs])

    @get("/training_runs/{run_id:str}")
    async def get_run(request: Request[Any, Any, Any], run_id: FromPath[str]) -> Response[bytes]:
        return _ok(_run_json(service.checkpoints.run(owner(request), run_id)))

    @get("/training_runs/{run_id:str}/checkpoints")
    async def list_run_checkpoints(
        request: Request[Any, Any, Any], run_id: FromPath[str]
    ) -> Response[bytes]:
        who = owner(request)
        service.checkpoints.run(who, run_id)
        return _ok({"checkpoints": [_ckpt_json(c) for c in service.checkpoints.find(who, run_id)]})

    @get("/checkpoints")
    async def list_checkpoints(request: Request[Any, Any, Any]) -> Response[bytes]:
        found = service.checkpoints.find(owner(request))
        return _paged(request, "checkpoints", [_ckpt_json(c) for c in found])

    # A checkpoint id is two segments (``weights/<name>``); what follows names the action.
    @get("/training_runs/{run_id:str}/checkpoints/{rest:path}")
    async def checkpoint_get(
        request: Request[Any, Any, Any], run_id: FromPath[str], rest: FromPath[str]
    ) -> Response[bytes]:
        ref, action = _checkpoint_and_action(run_id, rest)
        if len(action) == 2 and action[0] == "files":  # a signed download link: no API key
            return _download(ref, action[1], request)
        who = owner(request)
        record = service.checkpoints.get(who, ref)
        if action == ["external_weights_urls"]:
            return _ok(_urls(record, request))
        if action == ["archive"]:
            return _archive(record)
        if not action:
            return _ok(_ckpt_json(record))
        raise NotFoundError(f"no such endpoint: checkpoints/{rest}")

    @delete("/training_runs/{run_id:str}/checkpoints/{rest:path}", status_code=200)
    async def checkpoint_delete(
        request: Request[Any, Any, Any], run_id: FromPath[str], rest: FromPath[str]
    ) -> Response[bytes]:
        who = owner(request)
        ref, action = _checkpoint_and_action(run_id, rest)
        if action == ["publish"]:
            service.checkpoints.set_public(who, ref, False)
        elif not action:
            service.checkpoints.delete(who, ref)
        else:
            raise NotFoundError(f"no such endpoint: checkpoints/{rest}")
        return _ok({})

    @post("/training_runs/{run_id:str}/checkpoints/{rest:path}", status_code=200)
    async def checkpoint_post(
        request: Request[Any, Any, Any], run_id: FromPath[str], rest: FromPath[str]
    ) -> Response[bytes]:
        who = owner(request)
        ref, action = _checkpoint_and_action(run_id, rest)
        if action != ["publish"]:
            raise NotFoundError(f"no such endpoint: checkpoints/{rest}")
        service.checkpoints.set_public(who, ref, True)
        return _ok({})

    @put("/training_runs/{run_id:str}/checkpoints/{rest:path}", status_code=200)
    async def checkpoint_put(
        request: Request[Any, Any, Any], run_id: FromPath[str], rest: FromPath[str]
    ) -> Response[bytes]:
        who = owner(request)
        ref, action = _checkpoint_and_action(run_id, rest)
        if action != ["ttl"]:
            raise NotFoundError(f"no such endpoint: checkpoints/{rest}")
        body = codec.decode(await request.body(), codec.TtlIn)
        if body.ttl_seconds is not None and body.ttl_seconds <= 0:
            raise InvalidTrainingRequest("ttl_seconds must be positive (or null for none)")
        service.checkpoints.set_ttl(who, ref, body.ttl_seconds)
        return _ok({})

    @post("/weights_info", status_code=200)
    async def weights_info(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = owner(request)
        body = codec.decode(await request.body(), codec.WeightsInfoIn)
        record, _ = service.checkpoints.resolve(who, body.tinker_path)
        return _ok(
            {
                "base_model": record.base_model,
                "is_lora": True,
                "lora_rank": record.lora.rank,
                "train_unembed": record.lora.train_unembed,
                "train_mlp": record.lora.train_mlp,
                "train_attn": record.lora.train_attn,
            }
        )

    # --- helpers over the service ------------------------------------------------------

    def _run_json(run: RunRecord) -> dict[str, Any]:
        last = service.checkpoints.latest(run.run_id, "training")
        last_sampler = service.checkpoints.latest(run.run_id, "sampler")
        return {
            "training_run_id": run.run_id,
            "base_model": run.base_model,
            "model_owner": run.owner,
            "is_lora": True,
            "corrupted": run.corrupted,
            "lora_rank": run.lora.rank,
            "last_request_time": _iso(run.last_request_at),
            "last_checkpoint": _ckpt_json(last) if last else None,
            "last_sampler_checkpoint": _ckpt_json(last_sampler) if last_sampler else None,
            "user_metadata": run.user_metadata or None,
        }

    def _sign(record: CheckpointRecord, file: str, expires: int) -> str:
        ident = (record.run_id, record.checkpoint_id, record.version, file, str(expires))
        msg = "\n".join(ident).encode()
        return hmac.new(service.storage.secret(), msg, hashlib.sha256).hexdigest()

    def _urls(record: CheckpointRecord, request: Request[Any, Any, Any]) -> dict[str, Any]:
        folder = service.checkpoints.folder(record)
        expires = int(time.time()) + _URL_TTL_S
        base = str(request.base_url).rstrip("/")
        urls = {}
        for f in sorted(folder.iterdir()):
            if f.is_file() and f.name not in ("metadata.json", "optimizer.safetensors"):
                sig = _sign(record, f.name, expires)
                urls[f.name] = (
                    f"{base}/api/v1/training_runs/{record.run_id}/checkpoints/"
                    f"{record.checkpoint_id}/files/{f.name}?expires={expires}&sig={sig}"
                )
        return {"urls": urls, "expires": _iso(expires)}

    def _download(
        ref: CheckpointRef, file: str, request: Request[Any, Any, Any]
    ) -> Response[bytes]:
        try:
            expires = int(request.query_params.get("expires", "0"))
        except ValueError:
            expires = 0
        sig = request.query_params.get("sig", "")
        cid = checkpoint_id(ref.kind, ref.name)
        # Signed over the checkpoint's version: after a delete and a save under the same
        # name (or an overwrite), links made for the old one are refused.
        record = service.checkpoints.lookup(ref)
        if record is None:
            raise NotFoundError(f"no checkpoint {cid} (deleted?)")
        if not hmac.compare_digest(sig, _sign(record, file, expires)) or expires < time.time():
            raise TinkerHTTPError(403, "download link invalid or expired: ask for new urls")
        check_checkpoint_name(file)
        path = service.storage.folder(ref.run_id, ref.kind, ref.name) / file
        if not path.is_file():
            raise NotFoundError(f"no file {file!r} in checkpoint {cid}")
        return Response(path.read_bytes(), media_type="application/octet-stream")

    def _archive(record: CheckpointRecord) -> Response[bytes]:
        folder = service.checkpoints.folder(record)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for f in sorted(folder.iterdir()):
                if f.is_file() and f.name != "metadata.json":
                    tar.add(f, arcname=f.name)
        name = f"{record.run_id}-{record.name}.tar".replace(":", "_")
        return Response(
            buffer.getvalue(),
            media_type="application/x-tar",
            headers={"content-disposition": f'attachment; filename="{name}"'},
        )

    return Router(
        path="/api/v1",
        route_handlers=[
            healthz,
            get_client_config,
            capabilities,
            create_session,
            heartbeat,
            finish_session,
            list_sessions,
            get_session,
            telemetry,
            create_model,
            get_info,
            unload_model,
            forward_backward,
            forward,
            optim_step,
            save_weights,
            save_weights_for_sampler,
            save_weights_external,
            load_weights,
            copy_weights,
            create_sampling_session,
            get_sampler,
            asample,
            retrieve_future,
            list_runs,
            get_run,
            list_run_checkpoints,
            list_checkpoints,
            checkpoint_get,
            checkpoint_delete,
            checkpoint_post,
            checkpoint_put,
            weights_info,
        ],
        # Every error under /api/v1 in this API's form (the app's OpenAI-form handlers
        # would otherwise win for HTTPException, a more specific type than Exception).
        exception_handlers={
            Exception: tinker_error_response,
            HTTPException: tinker_error_response,
            TrainingError: tinker_error_response,
            TinkerHTTPError: tinker_error_response,
        },
    )


class _SamplerReady:
    __slots__ = ("sampler_id",)

    def __init__(self, sampler_id: str) -> None:
        self.sampler_id = sampler_id


def _result_json(kind: str, result: object) -> dict[str, Any]:
    if isinstance(result, ModelReady):
        if kind == "CreateModel":
            return {"type": "create_model", "model_id": result.model_id}
        if kind == "UnloadModel":
            return {"type": "unload_model", "model_id": result.model_id}
        return {"type": "load_weights", "path": result.path, "model_id": result.model_id}
    if isinstance(result, OptimStepped):
        return {"metrics": codec.metrics(result.metrics)}
    if isinstance(result, SavedCheckpoint):
        kinds = {"training": "save_weights", "sampler": "save_weights_for_sampler"}
        return {
            "type": kinds.get(result.record.kind, "save_weights_external"),
            "path": result.record.tinker_path,
        }
    if isinstance(result, _SamplerReady):
        return {"type": "save_weights_for_sampler", "sampling_session_id": result.sampler_id}
    raise TypeError(f"no JSON form for {type(result).__name__}")


def _checkpoint_and_action(run_id: str, rest: str) -> tuple[CheckpointRef, list[str]]:
    parts = rest.strip("/").split("/")
    return CheckpointRef.from_id(run_id, "/".join(parts[:2])), parts[2:]


def _ckpt_json(c: CheckpointRecord) -> dict[str, Any]:
    return {
        "checkpoint_id": c.checkpoint_id,
        "checkpoint_type": c.kind,
        "time": _iso(c.created_at),
        "tinker_path": c.tinker_path,
        "size_bytes": c.size_bytes,
        "public": c.public,
        "user_metadata": c.user_metadata or None,
        "expires_at": _iso(c.expires_at) if c.expires_at is not None else None,
    }


def _paged(request: Request[Any, Any, Any], key: str, items: list[Any]) -> Response[bytes]:
    """One page (``offset``, ``limit``) of ``items`` with the SDK's cursor."""
    offset, limit = _page(request)
    cursor = {"offset": offset, "limit": limit, "total_count": len(items)}
    return _ok({key: items[offset : offset + limit], "cursor": cursor})


def _page(request: Request[Any, Any, Any]) -> tuple[int, int]:
    try:
        offset = max(0, int(request.query_params.get("offset", 0)))
        limit = min(1000, max(1, int(request.query_params.get("limit", 100))))
    except ValueError as e:
        raise InvalidTrainingRequest("offset and limit must be integers") from e
    return offset, limit
