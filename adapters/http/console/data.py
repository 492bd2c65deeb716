"""The console's data pages' router (``/ui/api/tenants``, ``/ui/api/training/...``) and
what ``create_app`` wires for them.

Behind the console's guard and with its security headers (``security.py``); errors answer
in OpenAI's schema (401 ``invalid_api_key``, 403 ``permission_error``, 404).
"""

from litestar import Router

from adapters.http.console.security import console_guard, console_headers
from adapters.http.console.tenants import TenantRoutes
from adapters.http.console.training import TrainingRoutes
from adapters.http.console.viewer import ConsoleViewers
from adapters.http.errors import ACCESS_RULES, ErrorRule, ErrorTable, exception_handlers
from adapters.http.request_state import constants
from application.access.access import Access
from application.access.usage_ledger import UsageRecorder
from application.serving.served_models import ServedModels
from application.tinker.service import TinkerService
from domain.tinker.errors import NotFoundError

CONSOLE_ERRORS = ErrorTable(
    {NotFoundError: ErrorRule(404, "invalid_request_error"), **ACCESS_RULES}
)


def console_data_router(
    usage: UsageRecorder,
    models: ServedModels,
    *,
    access: Access | None = None,
    tinker: TinkerService | None = None,
    tinker_api_keys: frozenset[str] | None = None,
) -> Router:
    """The tenants' and the training runs' data under ``/ui/api``; ``usage``: the usage
    ledger's recorder (each tenant's usage today)."""
    viewers = ConsoleViewers(access, tinker_api_keys)
    return Router(
        path="/ui/api",
        route_handlers=[TenantRoutes, TrainingRoutes],
        guards=console_guard(access),
        middleware=[console_headers()],
        dependencies=constants(
            {
                "viewers": viewers,
                "usage": usage,
                "access": access,
                "tinker": tinker,
                "models": models,
            }
        ),
        exception_handlers=exception_handlers(CONSOLE_ERRORS),
    )


__all__ = ["console_data_router"]
