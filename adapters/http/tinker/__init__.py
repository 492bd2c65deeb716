"""The Tinker API (``/api/v1/...``) for the stock ``tinker`` SDK, over a TinkerService.

One controller per resource (``server``, ``sessions``, ``models``, ``training``,
``weights``, ``sampling``, ``futures``, ``runs``, ``custom_losses``, ``session_futures``,
``admin``); handlers only translate between the wire (``codec``, ``replies``) and the
service. Keys arrive in ``X-API-Key`` (or ``Authorization: Bearer``); the
:class:`~adapters.http.auth.ApiKeyGuard` gives handlers the caller's ``tenant``, and every
session, run, sampler and checkpoint belongs to the tenant that made it (another gets
404). Errors: ``errors.TINKER_ERRORS``.
"""

from collections.abc import Mapping
from typing import Any

from litestar import Router
from litestar.exceptions import HTTPException

from adapters.http.auth import TENANT, ApiKeyGuard
from adapters.http.errors import HTTPError
from adapters.http.request_state import constants
from adapters.http.tinker.admin import AdminRoutes
from adapters.http.tinker.custom_losses import CustomLossRoutes
from adapters.http.tinker.errors import forbidden_key, refused_key, tinker_error_response
from adapters.http.tinker.futures import FutureRoutes
from adapters.http.tinker.limits import LIMITS, LIMITS_DEPENDENCY, request_limits
from adapters.http.tinker.models import ModelRoutes
from adapters.http.tinker.runs import RunRoutes
from adapters.http.tinker.sampling import SamplingRoutes
from adapters.http.tinker.server import ServerRoutes
from adapters.http.tinker.session_futures import SessionFutureRoutes
from adapters.http.tinker.sessions import SessionRoutes
from adapters.http.tinker.training import TrainingRoutes
from adapters.http.tinker.weights import WeightRoutes
from application.access.access import Access
from application.tinker.service import TinkerService
from domain.tinker.errors import TrainingError

KEY_PREFIX = "tml-"


def tinker_guard(
    api_keys: frozenset[str] | None = None, access: Access | None = None
) -> ApiKeyGuard:
    """The Tinker face's keys: the keyring's tenants allowed on ``tinker`` (``access``
    with keys), else ``api_keys``, else any ``tml-`` key (each its own tenant)."""
    return ApiKeyGuard(
        refused_key,
        keys=api_keys,
        prefix=KEY_PREFIX,
        access=access,
        face="tinker",
        forbid=forbidden_key,
    )


def tinker_router(
    service: TinkerService,
    *,
    api_keys: frozenset[str] | None = None,
    client_config: Mapping[str, object] | None = None,
    access: Access | None = None,
) -> Router:
    """``api_keys``: the keys allowed; None accepts any ``tml-`` key (each its own owner).
    ``client_config``: what ``/client/config`` tells the SDK (besides the chunk size that
    keeps its forward/backward requests within the server's token limit)."""
    # The SDK estimates 4 bytes per token and more for the loss inputs: chunks of at most
    # this many estimated bytes never hold more tokens than one request may.
    sdk_config: dict[str, Any] = {
        "fwdbwd_max_chunk_bytes_count": 4 * service.limits.max_tokens_per_request,
        # create_custom_loss uploads traced losses, which forward_backward runs here
        "custom_loss_server_side": True,
        # a sampling session's clients poll retrieve_futures, clones join for their ids
        "sample_use_retrieve_futures": True,
        "sample_join_sampling_session": True,
        **(client_config or {}),
    }
    guard = tinker_guard(api_keys, access)
    return Router(
        path="/api/v1",
        route_handlers=[
            ServerRoutes,
            SessionRoutes,
            ModelRoutes,
            TrainingRoutes,
            WeightRoutes,
            SamplingRoutes,
            FutureRoutes,
            RunRoutes,
            CustomLossRoutes,
            SessionFutureRoutes,
            AdminRoutes,
        ],
        guards=request_limits(guard, access),
        dependencies={
            **constants({"service": service, "sdk_config": sdk_config, "api_keys": guard}),
            TENANT: guard.dependency(),
            LIMITS: LIMITS_DEPENDENCY,
        },
        # Every error under /api/v1 in this API's form (the app's OpenAI-form handlers
        # would otherwise win for HTTPException, a more specific type than Exception).
        exception_handlers={
            Exception: tinker_error_response,
            HTTPException: tinker_error_response,
            TrainingError: tinker_error_response,
            HTTPError: tinker_error_response,
        },
    )


__all__ = ["tinker_guard", "tinker_router"]
