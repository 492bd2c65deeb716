"""One mapping from failures to HTTP responses: OpenAI's error schema everywhere."""

import re
from collections.abc import Mapping

import msgspec
import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException

from adapters.http.schemas import ErrorDetail, ErrorResponse
from domain.errors import (
    EmptyPromptError,
    InvalidParameterError,
    PromptTooLongError,
    QueueFullError,
)

_encoder = msgspec.json.Encoder()
log = structlog.get_logger(__name__)


class HTTPError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )
        self.headers = dict(headers or {})


# A full engine frees places as its requests finish: a client may retry soon.
RETRY_AFTER = {"Retry-After": "1"}
# Content types whose body is not JSON whatever it looks like (curl -d sends the first).
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def error_response(_: Request, exc: HTTPError) -> Response[bytes]:
    body = ErrorResponse(ErrorDetail(exc.message, exc.kind, exc.param, exc.code))
    return Response(
        _encoder.encode(body),
        status_code=exc.status,
        media_type="application/json",
        headers=exc.headers,
    )


def check_content_type(request: Request) -> None:
    """A JSON body must not come as form data (as the OpenAI API answers: a 400); no
    content type, or any other, is read as JSON."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type in FORM_TYPES:
        raise HTTPError(
            400,
            f"the body must be JSON sent as application/json, not {media_type}",
            "invalid_request_error",
        )


def error_param(message: str) -> str | None:
    """The field a msgspec validation message names: ``... - at `$.max_tokens``` ->
    ``max_tokens``; ``Object missing required field `prompt``` -> ``prompt``."""
    path = match.group(1) if (match := _PATH.search(message)) else ""
    if missing := _MISSING.search(message):
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


def openai_error(e: Exception, field: str) -> Exception:
    """A domain error as the OpenAI endpoints answer it (errors about the prompt name
    ``field``: ``prompt``, or ``messages`` for chat); anything else is left as it is."""
    if isinstance(e, PromptTooLongError):  # OpenAI's code for it
        return HTTPError(400, str(e), "invalid_request_error", field, "context_length_exceeded")
    if isinstance(e, InvalidParameterError):
        param = field if e.param == "prompt" else e.param
        return HTTPError(400, str(e), "invalid_request_error", param)
    if isinstance(e, QueueFullError):
        return HTTPError(503, str(e), "server_error", code="overloaded", headers=RETRY_AFTER)
    return e


def generate_error(e: Exception) -> Exception:
    """A domain error as ``/v1/generate`` answers it (seed 000 §7: an empty prompt 400,
    other invalid values 422, a full engine 503)."""
    if isinstance(e, EmptyPromptError):
        return HTTPError(400, str(e), "invalid_request_error", "prompt")
    if isinstance(e, InvalidParameterError):
        return HTTPError(422, str(e), "invalid_request_error", e.param)
    if isinstance(e, QueueFullError):
        return HTTPError(503, str(e), "overloaded_error", headers=RETRY_AFTER)
    return e


def framework_error_response(request: Request, exc: Exception) -> Response[bytes]:
    """Litestar's own errors (unknown route, wrong method, ...) and unexpected exceptions,
    in the same schema: an OpenAI client parses every error body alike."""
    if not isinstance(exc, HTTPException):
        log.error("unhandled exception", path=request.url.path, error=repr(exc))
        return error_response(request, HTTPError(500, "Internal server error", "server_error"))
    status = exc.status_code
    if status == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif status == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}"
    else:
        message = exc.detail
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return error_response(request, HTTPError(status, message, kind))
