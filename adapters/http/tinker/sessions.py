"""Sessions: create, heartbeat, finish, list, get, search, move into a project, export a
trace of."""

from typing import Any

from litestar import Controller, Request, Response, get, post, put
from litestar.params import FromPath

from adapters.http.auth import Tenant
from adapters.http.tinker.codec import json as json_codec
from adapters.http.tinker.deps import Service
from adapters.http.tinker.replies import ok, page
from adapters.http.tinker.session_wire import (
    CreateSessionIn,
    FinishIn,
    ProjectIn,
    SessionSearchIn,
    page_json,
    search_query,
)
from application.tinker.admin import FINISH_REASONS
from domain.tinker.errors import InvalidTrainingRequest


class SessionRoutes(Controller):
    @post("/create_session", status_code=200)
    async def create_session(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), CreateSessionIn)
        session = service.sessions.create(
            tenant,
            tags=body.tags,
            user_metadata={k: str(v) for k, v in (body.user_metadata or {}).items()},
            display_name=body.display_name,
            sdk_version=body.sdk_version,
            project_id=body.project_id,
        )
        return ok({"type": "create_session", "session_id": session.id})

    @post("/session_heartbeat", status_code=200)
    async def heartbeat(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), json_codec.SessionIdIn)
        service.sessions.heartbeat(tenant, body.session_id)
        return ok({"type": "session_heartbeat"})

    @post("/sessions/{session_id:str}/finish", status_code=200)
    async def finish_session(
        self,
        request: Request[Any, Any, Any],
        session_id: FromPath[str],
        tenant: Tenant,
        service: Service,
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), FinishIn)
        reason = body.reason.type if body.reason is not None else None
        if reason is not None and reason not in FINISH_REASONS:
            raise InvalidTrainingRequest(
                f"reason.type must be one of {', '.join(sorted(FINISH_REASONS))}, not {reason!r}"
            )
        service.finish_session(tenant, session_id, reason=reason, detail=body.detail)
        return ok({})

    @get("/sessions")
    async def list_sessions(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        offset, limit = page(request)
        ids = [s.id for s in service.sessions.owned_by(tenant)]
        return ok({"sessions": ids[offset : offset + limit]})

    @get("/sessions/{session_id:str}")
    async def get_session(
        self, session_id: FromPath[str], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        info = service.session_info(tenant, session_id)
        return ok(
            {
                "training_run_ids": info.training_run_ids,
                "sampler_ids": info.sampler_ids,
                "user_metadata": info.session.user_metadata or None,
                "display_name": info.session.display_name,
            }
        )

    @post("/sessions/search", status_code=200)
    async def search_sessions(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), SessionSearchIn)
        return ok(page_json(service.admin.search(tenant, search_query(body))))

    @put("/sessions/{session_id:str}/project", status_code=200)
    async def set_project(
        self,
        request: Request[Any, Any, Any],
        session_id: FromPath[str],
        tenant: Tenant,
        service: Service,
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), ProjectIn)
        service.sessions.set_project(tenant, session_id, body.project_id)
        return ok({})

    @get("/sessions/{session_id:str}/trace_export")
    async def trace_export(
        self,
        request: Request[Any, Any, Any],
        session_id: FromPath[str],
        tenant: Tenant,
        service: Service,
    ) -> Response[bytes]:
        """Ready at once: a signed link to the session's trace (Chrome trace-event JSON,
        which Perfetto opens), valid for an hour."""
        service.sessions.get(tenant, session_id)
        link = service.traces.link(session_id)
        base = str(request.base_url).rstrip("/")
        query = f"expires={link.expires}&sig={link.signature}"
        url = f"{base}/api/v1/session_traces/{session_id}?{query}"
        return ok({"status": "ready", "url": url, "error": None})
