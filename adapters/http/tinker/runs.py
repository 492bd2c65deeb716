"""The REST listings: training runs, checkpoints (ttl, publish, delete), downloads.

A checkpoint id is two path segments (``weights/<name>``); what follows names the action.
A download link (``.../files/<file>?expires=...&sig=...``) needs no API key: the
signature is the permission.
"""

from typing import Any

from litestar import Controller, Request, Response, delete, get, post, put
from litestar.params import FromPath

from adapters.http.auth import Tenant
from adapters.http.tinker.codec import json as json_codec
from adapters.http.tinker.deps import Guard, Service
from adapters.http.tinker.replies import checkpoint_json, iso, ok, paged, run_json
from application.tinker.downloads import DownloadLinks
from domain.tinker.errors import NotFoundError
from domain.tinker.values import CheckpointRef


class RunRoutes(Controller):
    @get("/training_runs")
    async def list_runs(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        runs = [run_json(s) for s in service.run_summaries(tenant)]
        return paged(request, "training_runs", runs)

    @get("/training_runs/{run_id:str}")
    async def get_run(
        self, run_id: FromPath[str], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        return ok(run_json(service.run_summary(tenant, run_id)))

    @get("/training_runs/{run_id:str}/checkpoints")
    async def list_run_checkpoints(
        self, run_id: FromPath[str], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        found = service.run_checkpoints(tenant, run_id)
        return ok({"checkpoints": [checkpoint_json(c) for c in found]})

    @get("/checkpoints")
    async def list_checkpoints(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        found = service.checkpoints.find(tenant)
        return paged(request, "checkpoints", [checkpoint_json(c) for c in found])

    @get("/training_runs/{run_id:str}/checkpoints/{rest:path}")
    async def checkpoint_get(
        self,
        request: Request[Any, Any, Any],
        run_id: FromPath[str],
        rest: FromPath[str],
        service: Service,
        api_keys: Guard,
    ) -> Response[bytes]:
        ref, action = _checkpoint_and_action(run_id, rest)
        if len(action) == 2 and action[0] == "files":  # a signed download link: no API key
            expires, signature = _signature(request)
            data = service.downloads.read(ref, action[1], expires, signature)
            return Response(data, media_type="application/octet-stream")
        tenant = api_keys.tenant(request)
        if action == ["external_weights_urls"]:
            links = service.downloads.links(tenant, ref)
            return ok(_urls(links, str(request.base_url).rstrip("/")))
        if action == ["archive"]:
            name, archive = service.downloads.archive(tenant, ref)
            return Response(
                archive,
                media_type="application/x-tar",
                headers={"content-disposition": f'attachment; filename="{name}"'},
            )
        if not action:
            return ok(checkpoint_json(service.checkpoints.get(tenant, ref)))
        raise NotFoundError(f"no such endpoint: checkpoints/{rest}")

    @delete("/training_runs/{run_id:str}/checkpoints/{rest:path}", status_code=200)
    async def checkpoint_delete(
        self, run_id: FromPath[str], rest: FromPath[str], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        ref, action = _checkpoint_and_action(run_id, rest)
        if action == ["publish"]:
            service.checkpoints.set_public(tenant, ref, False)
        elif not action:
            service.checkpoints.delete(tenant, ref)
        else:
            raise NotFoundError(f"no such endpoint: checkpoints/{rest}")
        return ok({})

    @post("/training_runs/{run_id:str}/checkpoints/{rest:path}", status_code=200)
    async def checkpoint_post(
        self, run_id: FromPath[str], rest: FromPath[str], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        ref, action = _checkpoint_and_action(run_id, rest)
        if action != ["publish"]:
            raise NotFoundError(f"no such endpoint: checkpoints/{rest}")
        service.checkpoints.set_public(tenant, ref, True)
        return ok({})

    @put("/training_runs/{run_id:str}/checkpoints/{rest:path}", status_code=200)
    async def checkpoint_put(
        self,
        request: Request[Any, Any, Any],
        run_id: FromPath[str],
        rest: FromPath[str],
        tenant: Tenant,
        service: Service,
    ) -> Response[bytes]:
        ref, action = _checkpoint_and_action(run_id, rest)
        if action != ["ttl"]:
            raise NotFoundError(f"no such endpoint: checkpoints/{rest}")
        body = json_codec.decode(await request.body(), json_codec.TtlIn)
        service.checkpoints.set_ttl(tenant, ref, body.ttl_seconds)
        return ok({})


def _checkpoint_and_action(run_id: str, rest: str) -> tuple[CheckpointRef, list[str]]:
    parts = rest.strip("/").split("/")
    return CheckpointRef.from_id(run_id, "/".join(parts[:2])), parts[2:]


def _signature(request: Request[Any, Any, Any]) -> tuple[int, str]:
    try:
        expires = int(request.query_params.get("expires", "0"))
    except ValueError:
        expires = 0
    return expires, request.query_params.get("sig", "")


def _urls(links: DownloadLinks, base: str) -> dict[str, Any]:
    record = links.record
    folder = f"{base}/api/v1/training_runs/{record.run_id}/checkpoints/{record.checkpoint_id}"
    urls = {
        f.name: f"{folder}/files/{f.name}?expires={links.expires}&sig={f.signature}"
        for f in links.files
    }
    return {"urls": urls, "expires": iso(links.expires)}
