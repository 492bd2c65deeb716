"""Who the caller is, what it did and used: ``auth/apikey/me``, ``audit``, ``billing/usage``
(hourly usage; checkpoint storage now), the SDK's ``client/dynamic_config``, and the
session trace a ``trace_export`` link names.

Principals are URNs made from the tenant id, never from the key. This server has no
prices: every cost and rate is null. ``DELETE auth/apikey/me`` (revoke the key) is not
served: keys are the operator's (``--api-keys`` / the keys file), not the API's.
"""

import hashlib
from datetime import UTC, date, datetime
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath

from adapters.http.auth import Tenant
from adapters.http.tinker.deps import Service
from adapters.http.tinker.replies import iso, ok
from application.tinker.activity_log import org_urn, user_urn
from application.tinker.billing import HOUR_S
from domain.tinker.errors import InvalidTrainingRequest

# Flags the SDK re-reads while it runs: abandoned samples are cancelled on the server.
DYNAMIC_CONFIG = {"sample_cancel_enabled": True}
GIGABYTE = 1_000_000_000  # storage's billing unit, in bytes


def key_id(tenant: str) -> int:
    """A stable number for the caller's key, from its tenant id."""
    return int(hashlib.sha256(tenant.encode()).hexdigest()[:12], 16)


def parse_time(name: str, value: str | None) -> float:
    """An RFC 3339 query parameter as unix seconds (no zone: UTC)."""
    if not value:
        raise InvalidTrainingRequest(f"{name} is required (an RFC 3339 time)")
    try:
        when = datetime.fromisoformat(value)
    except ValueError as e:
        raise InvalidTrainingRequest(f"{name} is not an RFC 3339 time: {value!r}") from e
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


class AdminRoutes(Controller):
    @get("/auth/apikey/me")
    async def api_key(self, tenant: Tenant) -> Response[bytes]:
        """The caller's key: ``tinker auth login``'s check (``SelfApiKeyResponse``) and
        the principal's URNs (``WhoamiResponse``)."""
        return ok(
            {
                "key_id": key_id(tenant),
                "name": tenant,
                "note": "",
                "details": {"org_details": {"name": tenant}, "user_details": {"email": ""}},
                "user_urn": user_urn(tenant),
                "org_urn": org_urn(tenant),
                "email": None,
            }
        )

    @post("/client/dynamic_config", status_code=200)
    async def dynamic_config(self) -> Response[bytes]:
        return ok(DYNAMIC_CONFIG)

    @get("/audit")
    async def audit(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        params = request.query_params
        day: date | None = None
        if params.get("day"):
            try:
                day = date.fromisoformat(params["day"])
            except ValueError as e:
                message = f"day must be YYYY-MM-DD, not {params['day']!r}"
                raise InvalidTrainingRequest(message) from e
        entries = service.audit.entries(tenant, event_type=params.get("event_type", "all"), day=day)
        return ok(
            {
                "entries": [
                    {
                        "timestamp": iso(e.timestamp),
                        "event": e.event,
                        "event_details": dict(e.details),
                        "model_id": e.model_id,
                        "tinker_path": e.tinker_path,
                    }
                    for e in entries
                ]
            }
        )

    @get("/billing/usage/events")
    async def usage_events(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        params = request.query_params
        start = parse_time("starting_on", params.get("starting_on"))
        end = parse_time("ending_before", params.get("ending_before"))
        report = service.admin.usage_report(tenant, start, end)
        data = []
        for event in report.events:
            key = event.key
            info: dict[str, Any] = {"type": key.kind}
            if key.kind == "checkpoint":
                info["count"] = event.quantity
            else:
                info["token_count"] = event.quantity
            if key.kind == "sampling_prefill":
                info["cached"] = False  # the prefix cache's savings are not known here
            data.append(
                {
                    "bucket_start": iso(key.hour),
                    "bucket_end": iso(key.hour + HOUR_S),
                    "base_model": key.base_model,
                    "user_id": report.owner,
                    "user_name": None,
                    "session_id": key.session_id,
                    "project_id": report.projects.get(key.session_id or ""),
                    "estimated_cost_usd": None,
                    "effective_rate_usd_per_million_tokens": None,
                    "effective_rate_usd_per_gigabyte_month": None,
                    "event_info": info,
                }
            )
        sessions = {sid: {"user_metadata": meta} for sid, meta in report.metadata.items()}
        return ok({"data": data, "sessions": sessions, "cost_data_through": None})

    @get("/billing/usage/checkpoints/current")
    async def storage_now(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        rows = service.admin.storage(tenant, request.query_params.get("project_id") or None)
        data = [
            {
                "project_id": row.project_id,
                "org_user_urn": row.owner,
                "user_email": None,
                "user_name": None,
                "checkpoint_count": row.checkpoints,
                "size_bytes": row.size_bytes,
                "size_gigabytes": row.size_bytes / GIGABYTE,
                "estimated_monthly_cost_usd": None,
            }
            for row in rows
        ]
        return ok({"effective_rate_usd_per_gigabyte_month": None, "data": data})

    @get("/session_traces/{session_id:str}")
    async def session_trace(
        self, request: Request[Any, Any, Any], session_id: FromPath[str], service: Service
    ) -> Response[bytes]:
        """A ``trace_export`` link: needs no API key (the signature is the permission)."""
        try:
            expires = int(request.query_params.get("expires", "0"))
        except ValueError:
            expires = 0
        trace = service.traces.export(session_id, expires, request.query_params.get("sig", ""))
        name = f"{session_id}.json"
        return Response(
            trace,
            media_type="application/json",
            headers={"content-disposition": f'attachment; filename="{name}"'},
        )
