"""Sessions: create, heartbeat, finish, list, get."""

from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath

from adapters.http.auth import Tenant
from adapters.http.tinker import codec
from adapters.http.tinker.deps import Service
from adapters.http.tinker.replies import ok, page


class SessionRoutes(Controller):
    @post("/create_session", status_code=200)
    async def create_session(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = codec.decode(await request.body(), codec.CreateSessionIn)
        session = service.sessions.create(
            tenant,
            tags=body.tags,
            user_metadata={k: str(v) for k, v in (body.user_metadata or {}).items()},
            display_name=body.display_name,
            sdk_version=body.sdk_version,
        )
        return ok({"type": "create_session", "session_id": session.id})

    @post("/session_heartbeat", status_code=200)
    async def heartbeat(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = codec.decode(await request.body(), codec.SessionIdIn)
        service.sessions.heartbeat(tenant, body.session_id)
        return ok({"type": "session_heartbeat"})

    @post("/sessions/{session_id:str}/finish", status_code=200)
    async def finish_session(
        self, session_id: FromPath[str], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        service.finish_session(tenant, session_id)
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
