"""One mapping from failures to HTTP responses: OpenAI's error schema everywhere."""

import msgspec
import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException

from adapters.http.schemas import ErrorDetail, ErrorResponse

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
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )


def error_response(_: Request, exc: HTTPError) -> Response[bytes]:
    body = ErrorResponse(ErrorDetail(exc.message, exc.kind, exc.param, exc.code))
    return Response(_encoder.encode(body), status_code=exc.status, media_type="application/json")


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
