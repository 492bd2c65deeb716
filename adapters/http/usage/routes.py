"""OpenAI's usage API over the ledger: ``GET /v1/organization/usage/completions`` and
``.../embeddings`` (time buckets of ``1m``, ``1h`` or ``1d`` from ``start_time``, grouped
by ``project_id`` (our tenant), ``model`` and ``api_key_id`` (a key's public id), filtered
by ``project_ids`` / ``models``, paged by ``limit`` / ``page``). An admin key reads every
tenant's usage; another key with the ``openai`` face its own tenant's only; an open
server's is open. What it reads is written by :mod:`adapters.http.usage.middleware`."""

import math
import time
from typing import Any

from litestar import Controller, Request, Router, get
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency

from adapters.http import query_params
from adapters.http.auth import ApiKeyGuard
from adapters.http.errors import OPENAI_ERRORS, exception_handlers
from adapters.http.request_state import api_state, constants
from application.access.access import Access
from application.access.usage_ledger import UsageRecorder
from domain.errors import InvalidRequestError
from domain.tenancy import AuthenticationError, PermissionDeniedError, Tenant
from domain.usage import COMPLETIONS, EMBEDDINGS, UsageQuery, UsageTotals

USAGE_PATH = "/v1/organization/usage"
# bucket_width -> (seconds, default buckets a page, most buckets a page): OpenAI's.
BUCKETS = {"1m": (60, 60, 1440), "1h": (3600, 24, 168), "1d": (86400, 7, 31)}
# OpenAI's group_by values -> the ledger's columns.
GROUPS = {"project_id": "tenant_id", "model": "model", "api_key_id": "key_id"}
NOT_RECORDED = ("user_id", "batch", "service_tier")
ADMIN = "admin"


Recorder = NamedDependency[UsageRecorder]
AccessDep = NamedDependency[Access | None]


class UsageRoutes(Controller):
    path = USAGE_PATH

    @get("/completions")
    async def completions(
        self, request: Request[Any, Any, Any], recorder: Recorder, access: AccessDep
    ) -> dict[str, Any]:
        return await _page(request, recorder, access, COMPLETIONS)

    @get("/embeddings")
    async def embeddings(
        self, request: Request[Any, Any, Any], recorder: Recorder, access: AccessDep
    ) -> dict[str, Any]:
        return await _page(request, recorder, access, EMBEDDINGS)


def _caller(connection: ASGIConnection[Any, Any, Any, Any], access: Access | None) -> Tenant | None:
    """The caller's tenant (None: an open server, where anyone reads everything)."""
    if access is None or access.open:
        return None
    guard = ApiKeyGuard(
        AuthenticationError,
        access=access,
        face="openai",
        forbid=PermissionDeniedError,
        missing_message="missing API key: send it as Authorization: Bearer <key>",
    )
    key = guard.key(connection)
    tenant = access.tenant(key) if key else None
    if tenant is not None and tenant.allows_face(ADMIN):
        return tenant
    return guard.resolve(connection)  # 401 / 403 unless it may use the OpenAI endpoints


async def _page(
    request: Request[Any, Any, Any], recorder: UsageRecorder, access: Access | None, kind: str
) -> dict[str, Any]:
    caller = _caller(request, access)
    record = getattr(api_state(request), "record", None)  # None without the owning middleware
    if record is not None and caller is not None:
        record.tenant_id = caller.id
    params = request.query_params
    width = query_params.one(params, "bucket_width") or "1d"
    if width not in BUCKETS:
        raise InvalidRequestError(
            "bucket_width", f"bucket_width must be one of {', '.join(BUCKETS)}, got {width!r}"
        )
    bucket_s, default_limit, max_limit = BUCKETS[width]
    start = query_params.integer(params, "start_time")
    if start is None:
        raise InvalidRequestError("start_time", "start_time (unix seconds) is required")
    end = query_params.integer(params, "end_time")
    end = int(time.time()) + 1 if end is None else end  # this second's records included
    if end <= start:
        raise InvalidRequestError("end_time", "end_time must be after start_time")
    limit = query_params.integer(params, "limit")
    limit = default_limit if limit is None else limit
    if not 1 <= limit <= max_limit:
        raise InvalidRequestError(
            "limit", f"limit must be 1 to {max_limit} buckets with bucket_width {width}"
        )
    page = query_params.integer(params, "page") or 0
    if page < 0:
        raise InvalidRequestError("page", "page is a cursor this API returned as next_page")
    group_by = _group_by(params.getall("group_by", []) + params.getall("group_by[]", []))
    projects = query_params.values(params, "project_ids")
    if caller is not None and not caller.allows_face(ADMIN):  # its own tenant's only
        projects = frozenset({caller.id}) if projects is None else projects & {caller.id}
    buckets = math.ceil((end - start) / bucket_s)
    first, last = page, min(buckets, page + limit)
    totals: list[UsageTotals] = []
    if first < last:
        query = UsageQuery(
            start_s=start + first * bucket_s,
            end_s=min(end, start + last * bucket_s),
            bucket_s=bucket_s,
            group_by=tuple(GROUPS[g] for g in group_by),
            tenants=projects,
            models=query_params.values(params, "models"),
            kind=kind,
        )
        totals = await recorder.totals(query)
    by_bucket: dict[int, list[dict[str, Any]]] = {}
    for row in totals:
        if row.succeeded or row.prompt_tokens or row.completion_tokens:  # not refusals alone
            by_bucket.setdefault(first + row.bucket, []).append(_result(kind, group_by, row))
    data = [
        {
            "object": "bucket",
            "start_time": start + i * bucket_s,
            "end_time": min(end, start + (i + 1) * bucket_s),
            "results": by_bucket.get(i, []),
        }
        for i in range(first, last)
    ]
    more = last < buckets
    return {
        "object": "page",
        "data": data,
        "has_more": more,
        "next_page": str(last) if more else None,
    }


def _result(kind: str, group_by: list[str], row: UsageTotals) -> dict[str, Any]:
    grouped = dict(zip(group_by, row.group, strict=True))
    common = {
        "num_model_requests": row.succeeded,
        "project_id": grouped.get("project_id"),
        "user_id": None,
        "api_key_id": grouped.get("api_key_id"),
        "model": grouped.get("model"),
    }
    if kind == EMBEDDINGS:
        return {
            "object": "organization.usage.embeddings.result",
            "input_tokens": row.prompt_tokens,
            **common,
        }
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": row.prompt_tokens,
        "output_tokens": row.completion_tokens,
        "input_cached_tokens": row.cached_tokens,
        "input_audio_tokens": 0,
        "output_audio_tokens": 0,
        **common,
        "batch": None,
    }


def _group_by(values: list[str]) -> list[str]:
    names: list[str] = []
    for value in (v for raw in values for v in raw.split(",") if v):
        if value in NOT_RECORDED:
            raise InvalidRequestError(
                "group_by",
                f"infer does not record {value} per request: "
                "group by project_id, model or api_key_id",
            )
        if value not in GROUPS:
            raise InvalidRequestError(
                "group_by", f"group_by takes project_id, model and api_key_id, got {value[:40]!r}"
            )
        if value not in names:
            names.append(value)
    return names


def usage_router(recorder: UsageRecorder, access: Access | None) -> Router:
    return Router(
        path="/",
        route_handlers=[UsageRoutes],
        dependencies=constants({"recorder": recorder, "access": access}),
        exception_handlers=exception_handlers(OPENAI_ERRORS),
    )
