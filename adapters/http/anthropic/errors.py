"""The Messages face's errors, in Anthropic's format:
``{"type": "error", "error": {"type", "message"}}``.

The error type follows the status, as Anthropic's does: 400 ``invalid_request_error``,
401 ``authentication_error``, 403 ``permission_error``, 404 ``not_found_error``, 413
``request_too_large``, 429 ``rate_limit_error``, 500 ``api_error``, 529 (and 503)
``overloaded_error``, 504 ``timeout_error``. A full engine answers 529 (Anthropic's
"overloaded", which its SDKs retry). Every error under ``/v1/messages`` is answered so:
the router's exception handlers take every exception raised under its routes (the
guard's, the owning middleware's deadline and drain, unexpected ones: their text goes to
the log only); routing's own (404, 405), the idempotency middleware's and the server's
body deadline answer by path (``adapters.http.errors.is_anthropic``).
"""

from typing import Any

import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException

from adapters.http.anthropic.schemas import ErrorBody, ErrorDetail
from adapters.http.errors import (
    ACCESS_RULES,
    RETRY_AFTER,
    ErrorRule,
    ErrorTable,
    HTTPError,
    anthropic_error_body,
)
from adapters.http.errors import anthropic_type as error_type
from application.serving.chat_output import ChoiceError
from domain.errors import (
    InvalidParameterError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
)

log = structlog.get_logger(__name__)
OVERLOADED = 529

# The kinds are the OpenAI faces' (unused here: the status gives the type).
ANTHROPIC_ERRORS = ErrorTable(
    {
        InvalidParameterError: ErrorRule(400, "invalid_request_error"),  # too long prompts too
        ModelNotFoundError: ErrorRule(404, "not_found_error"),
        QueueFullError: ErrorRule(OVERLOADED, "overloaded_error", headers=RETRY_AFTER),
        ChoiceError: ErrorRule(500, "api_error"),
        **ACCESS_RULES,
    }
)


def error_event(message: str, status: int = 500) -> ErrorBody:
    """A stream's ``error`` event (the engine failed the request, or the server ended
    it)."""
    return ErrorBody(ErrorDetail(error_type(status), message))


# The chat fields the use case's errors name, as this face's body has them.
RENAMED = {
    "prompt": "messages",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
}


def anthropic_error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    if (
        isinstance(exc, InvalidParameterError)
        and not isinstance(exc, InvalidRequestError)  # complete as written
        and exc.param in RENAMED
    ):
        exc = exc.renamed(RENAMED[exc.param])
    error = ANTHROPIC_ERRORS.error(exc)
    headers: dict[str, str] | None = None
    if isinstance(error, HTTPError):
        status, message, headers = error.status, error.message, error.headers
    elif isinstance(error, HTTPException):
        status = error.status_code
        if status == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif status == 405:
            message = f"Method {request.method} is not allowed for {request.url.path}"
        else:
            message = str(error.detail)
    else:  # a bug: the details go to the log only
        log.error("unhandled exception", path=request.url.path, error=repr(exc))
        status, message = 500, "Internal server error"
    return Response(
        anthropic_error_body(message, error_type(status)),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


# The router's handlers: every exception (the app's OpenAI-format handlers would otherwise
# win for the types they list).
ANTHROPIC_HANDLERS = {
    Exception: anthropic_error_response,
    HTTPException: anthropic_error_response,
    HTTPError: anthropic_error_response,
}
