"""One mapping from failures to HTTP responses: OpenAI's error schema everywhere."""

import msgspec
from litestar import Request, Response

from adapters.http.schemas import ErrorDetail, ErrorResponse

_encoder = msgspec.json.Encoder()


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
