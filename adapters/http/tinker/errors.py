"""The Tinker face's errors: 4xx JSON ``{"detail", "error", "category"}``.

Never 408/409/429/5xx for a permanent error, which the SDK would retry for minutes (429
only when a run's queue of waiting requests is full: retrying is then the right thing).
Error bodies never carry exception text of unexpected errors or the server's file paths.
"""

from typing import Any

import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException

from adapters.http.errors import (
    ErrorRule,
    ErrorTable,
    HTTPError,
    rate_limit_headers,
    tinker_error_body,
)
from application.tinker.downloads import LinkRefusedError
from domain.tenancy import PermissionDeniedError, RateLimitedError
from domain.tinker.errors import NotFoundError, RetryLaterError, SessionClosedError, TrainingError

log = structlog.get_logger(__name__)


def _category(e: Exception) -> str:
    return getattr(e, "category", "user")


TINKER_ERRORS = ErrorTable(
    {
        NotFoundError: ErrorRule(404, _category),
        SessionClosedError: ErrorRule(410, _category),
        RetryLaterError: ErrorRule(429, _category, headers={"Retry-After": "1"}),
        LinkRefusedError: ErrorRule(403, _category),
        PermissionDeniedError: ErrorRule(403, "user"),
        RateLimitedError: ErrorRule(429, "user", headers=rate_limit_headers),
        # invalid, unsupported, sequence conflicts (and backend failures on input)
        TrainingError: ErrorRule(400, _category),
    }
)


def refused_key(message: str) -> HTTPError:
    """A missing or refused API key."""
    return HTTPError(401, message, "user")


def forbidden_key(message: str) -> HTTPError:
    """A key whose tenant may not use the Tinker API."""
    return HTTPError(403, message, "user")


def tinker_error_response(_: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    error = TINKER_ERRORS.error(exc)
    headers: dict[str, str] | None = None
    if isinstance(error, HTTPError):
        status, message, category, headers = error.status, error.message, error.kind, error.headers
    elif isinstance(error, HTTPException):
        status, message, category = error.status_code, str(error.detail), "user"
    else:  # a bug: the details go to the log only
        log.exception("tinker_internal_error", exc_info=exc)
        status, message, category = 500, "internal error (logged)", "server"
    return Response(
        tinker_error_body(message, category),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )
