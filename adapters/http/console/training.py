"""The console's training page data: the Tinker training runs, each run's metrics per step
(the loss curves, :class:`~application.tinker.curves.TrainingCurves`) and its checkpoints.

- ``GET /ui/api/training/runs``: the runs the caller may see (every run for an admin, else
  its own; see :mod:`adapters.http.console.viewer`), newest activity first: base model,
  LoRA rank, optimizer, whether it is loaded, steps and the last step's metrics.
- ``GET /ui/api/training/runs/{run_id}?since=N``: one run, its points from step ``N`` on
  (the page polls with the step of its last complete point) and its checkpoints: the
  ``tinker://`` path, kind, size, created, expiry (TTL), published, and for a sampler
  checkpoint the model name the OpenAI endpoints take for it (its path) and whether the
  caller's key may sample it there (its owner's key, or any key for a published one).
"""

from typing import Any

from litestar import Controller, Request, get
from litestar.di import NamedDependency
from litestar.params import FromPath, Parameter

from adapters.http.console.tenants import NO_STORE, TinkerDep, Viewers
from adapters.http.console.viewer import Viewer
from application.serving.served_models import ServedModels
from application.tinker.curves import CurvePoint
from application.tinker.service import TinkerService
from domain.tinker.errors import NotFoundError
from domain.tinker.values import CheckpointRecord, RunRecord

MAX_RUNS_LISTED = 500

Models = NamedDependency[ServedModels]


class TrainingRoutes(Controller):
    @get("/training/runs", response_headers=NO_STORE)
    async def runs(
        self, request: Request[Any, Any, Any], viewers: Viewers, tinker: TinkerDep
    ) -> dict[str, Any]:
        viewer, everyone = viewers.training(request)
        if tinker is None:
            return {"enabled": False, "all": everyone, "runs": []}
        store = tinker.checkpoints
        runs = list(store.runs.values()) if everyone else store.runs_of(viewer.owner or "")
        runs.sort(key=lambda r: r.last_request_at, reverse=True)
        return {
            "enabled": True,
            "all": everyone,
            "runs": [run_json(tinker, run, everyone) for run in runs[:MAX_RUNS_LISTED]],
            "total": len(runs),
        }

    @get("/training/runs/{run_id:str}", response_headers=NO_STORE)
    async def run(
        self,
        request: Request[Any, Any, Any],
        run_id: FromPath[str],
        viewers: Viewers,
        tinker: TinkerDep,
        models: Models,
        since: int = Parameter(default=0, ge=0, le=2**62),
    ) -> dict[str, Any]:
        viewer, everyone = viewers.training(request)
        if tinker is None:
            raise NotFoundError("the Tinker API is not enabled on this server")
        run = tinker.checkpoints.runs.get(run_id)
        if run is None or not (everyone or run.owner == viewer.owner):
            raise NotFoundError(f"no training run {run_id!r}")
        checkpoints = tinker.checkpoints.find(run.owner, run.run_id)
        return {
            "run": run_json(tinker, run, everyone),
            "points": [point_json(p) for p in tinker.training.curves.points(run_id, since)],
            "checkpoints": [
                checkpoint_json(c, viewer, models, viewers.keyed)
                for c in sorted(checkpoints, key=lambda c: c.created_at, reverse=True)
            ],
        }


def run_json(tinker: TinkerService, run: RunRecord, with_owner: bool) -> dict[str, Any]:
    curves = tinker.training.curves
    last = curves.last(run.run_id)
    return {
        "id": run.run_id,
        "base_model": run.base_model,
        "lora_rank": run.lora.rank,
        "train_attn": run.lora.train_attn,
        "train_mlp": run.lora.train_mlp,
        "train_unembed": run.lora.train_unembed,
        "optimizer": run.optimizer,
        "session_id": run.session_id,
        "owner": run.owner if with_owner else None,
        "created_at": run.created_at,
        "last_request_at": run.last_request_at,
        "loaded": tinker.training.is_live(run.run_id),
        "corrupted": run.corrupted,
        "steps": curves.steps(run.run_id),
        "last_metrics": dict(last.metrics) if last is not None else {},
        "user_metadata": dict(run.user_metadata),
    }


def point_json(point: CurvePoint) -> dict[str, Any]:
    return {
        "step": point.step,
        "time": point.time,
        "done": point.done,
        "metrics": dict(point.metrics),
    }


def checkpoint_json(
    c: CheckpointRecord, viewer: Viewer, models: ServedModels, keyed: bool
) -> dict[str, Any]:
    model, why_not = None, None
    if c.kind == "sampler":
        model = c.tinker_path
        why_not = _why_not_sampleable(c, viewer, models, keyed)
    return {
        "path": c.tinker_path,
        "id": c.checkpoint_id,
        "kind": c.kind,
        "name": c.name,
        "size_bytes": c.size_bytes,
        "created_at": c.created_at,
        "expires_at": c.expires_at,
        "public": c.public,
        "optimizer": c.optimizer,
        "model": model,
        "sampleable": model is not None and why_not is None,
        "not_sampleable_because": why_not,
    }


def _why_not_sampleable(
    c: CheckpointRecord, viewer: Viewer, models: ServedModels, keyed: bool
) -> str | None:
    """Why the OpenAI endpoints would not serve ``c`` to the caller's key (None: they
    would): as :meth:`ServedModels.resolve` decides, with the owner the key stands for."""
    if models.tinker is None:
        return "this server does not serve Tinker checkpoints on the OpenAI endpoints"
    if c.base_model not in models.tinker_base_names:
        return f"its base model {c.base_model!r} is not the model this server serves"
    if not viewer.chats:
        return "the console's key may not use the OpenAI endpoints"
    if viewer.owner is None:
        if keyed:
            return "the console's key may not use the Tinker API"
        return "sampling it needs the Tinker key that saved it: 'Set key' at the top"
    if c.owner != viewer.owner and not c.public:
        return "only the key that saved it may sample it (or publish it)"
    return None
