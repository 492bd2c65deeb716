"""Failures as HTTP responses: :class:`HTTPError`, the OpenAI error schema (the OpenAI and
native faces answer in it), and one :class:`ErrorTable` per face mapping domain errors to
a status, an error type and a param (the Tinker face's table is in ``adapters.http.tinker``).

Handlers raise domain errors as they come; a face registers its table as Litestar
exception handlers (:func:`exception_handlers`), which answer in OpenAI's schema. A route
whose prompt comes in another field than ``prompt`` says so in its ``opt``
(:data:`PROMPT_FIELD`): chat's errors about the prompt name ``messages``.
"""

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ExceptionHandlersMap

from adapters.http.schemas import ErrorDetail, ErrorResponse
from domain.errors import (
    EmptyPromptError,
    InvalidParameterError,
    ModelNotFoundError,
    PromptTooLongError,
    QueueFullError,
    StoreUnavailableError,
)
from domain.tenancy import (
    AuthenticationError,
    LimitsUnavailableError,
    PermissionDeniedError,
    RateLimitedError,
)
from domain.tinker.errors import error_payload

_encoder = msgspec.json.Encoder()
log = structlog.get_logger(__name__)
T = TypeVar("T")
# A route's ``opt`` key: the request field its prompt comes in (default ``prompt``).
PROMPT_FIELD = "prompt_field"


class HTTPError(Exception):
    """An answer in the face's error format: ``kind`` is the error type (OpenAI's
    ``type``, Tinker's ``category``)."""

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


# Content types whose body is not JSON whatever it looks like (curl -d sends the first).
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


# How a rule names the failing field: from the error and the request field the caller
# says the prompt came from (``prompt``, or ``messages`` for chat).
ParamOf = Callable[[Exception, str], str | None]


def own_param(e: Exception, _: str) -> str | None:
    """The parameter the error names."""
    return getattr(e, "param", None)


def prompt_as_field(e: Exception, field: str) -> str | None:
    """The parameter the error names, the prompt's under the caller's field name."""
    param = getattr(e, "param", None)
    return field if param == "prompt" else param


def the_field(_: Exception, field: str) -> str | None:
    return field


def no_param(_: Exception, __: str) -> str | None:
    return None


@dataclass(frozen=True, slots=True)
class ErrorRule:
    """How a face answers one exception type. ``kind``: the error type, or a function of
    the exception giving it."""

    status: int
    kind: str | Callable[[Exception], str]
    param: ParamOf = no_param
    code: str | None = None
    # Fixed headers, or a function of the exception giving them (Retry-After from it).
    headers: Mapping[str, str] | Callable[[Exception], Mapping[str, str]] | None = None


class ErrorTable:
    """A face's exception -> answer mapping; an exception's nearest listed class wins."""

    def __init__(self, rules: Mapping[type[Exception], ErrorRule]) -> None:
        self.rules = dict(rules)

    def rule(self, e: Exception) -> ErrorRule | None:
        for cls in type(e).__mro__:
            if (rule := self.rules.get(cls)) is not None:
                return rule
        return None

    def error(self, e: Exception, field: str = "prompt") -> Exception:
        """``e`` as an :class:`HTTPError`, or ``e`` itself when the table has no rule."""
        rule = self.rule(e)
        if rule is None or isinstance(e, HTTPError):
            return e
        kind = rule.kind if isinstance(rule.kind, str) else rule.kind(e)
        headers = rule.headers(e) if callable(rule.headers) else rule.headers
        return HTTPError(rule.status, str(e), kind, rule.param(e, field), rule.code, headers)


# A full engine frees places as its requests finish: a client may retry soon.
RETRY_AFTER = {"Retry-After": "1"}


def rate_limit_headers(e: Exception) -> dict[str, str]:
    """Retry-After and the OpenAI-style ``x-ratelimit-*`` headers of the refused limit."""
    assert isinstance(e, RateLimitedError)
    state, suffix = e.state, "requests" if e.limit == "requests" else "tokens"
    headers = {"Retry-After": str(e.retry_after_s)}
    if e.limit in ("requests", "tokens"):
        headers.update(
            {
                f"x-ratelimit-limit-{suffix}": str(state.limit),
                f"x-ratelimit-remaining-{suffix}": str(state.remaining),
                f"x-ratelimit-reset-{suffix}": f"{state.reset_s:.3f}s",
            }
        )
    return headers


def rate_limit_kind(e: Exception) -> str:
    """OpenAI's ``type`` of a 429: the limit reached (``requests``, ``tokens``...)."""
    return e.limit if isinstance(e, RateLimitedError) else "requests"


# Who may call (every face answers these in its own format).
ACCESS_RULES: dict[type[Exception], ErrorRule] = {
    AuthenticationError: ErrorRule(401, "invalid_request_error", code="invalid_api_key"),
    PermissionDeniedError: ErrorRule(403, "permission_error", code="permission_denied"),
    RateLimitedError: ErrorRule(
        429, rate_limit_kind, code="rate_limit_exceeded", headers=rate_limit_headers
    ),
    LimitsUnavailableError: ErrorRule(503, "server_error", headers=RETRY_AFTER),
    # A records database (usage, audit, rollouts) down: the admin and usage reads.
    StoreUnavailableError: ErrorRule(503, "server_error", headers=RETRY_AFTER),
}

# The OpenAI endpoints (as OpenAI answers: invalid values are 400).
OPENAI_ERRORS = ErrorTable(
    {
        PromptTooLongError: ErrorRule(
            400, "invalid_request_error", the_field, "context_length_exceeded"
        ),
        InvalidParameterError: ErrorRule(400, "invalid_request_error", prompt_as_field),
        ModelNotFoundError: ErrorRule(404, "invalid_request_error", own_param, "model_not_found"),
        # A full queue is a 429 (the openai SDK retries it after Retry-After).
        QueueFullError: ErrorRule(429, "server_error", code="queue_full", headers=RETRY_AFTER),
        **ACCESS_RULES,
    }
)

# ``/v1/generate`` (an empty prompt 400, other invalid values 422, a full
# engine 503).
GENERATE_ERRORS = ErrorTable(
    {
        EmptyPromptError: ErrorRule(400, "invalid_request_error", own_param),
        InvalidParameterError: ErrorRule(422, "invalid_request_error", own_param),
        QueueFullError: ErrorRule(503, "overloaded_error", headers=RETRY_AFTER),
        **ACCESS_RULES,
    }
)


# The Tinker face's paths; every other API path answers in OpenAI's error schema.
TINKER_PREFIX = "/api/"
# The Messages face's path (and its count_tokens below it): Anthropic's error format.
ANTHROPIC_PATH = "/v1/messages"


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(f"{ANTHROPIC_PATH}/")


def anthropic_error_body(message: str, kind: str) -> bytes:
    """An error body in Anthropic's format (``kind``: its error type)."""
    return _encoder.encode({"type": "error", "error": {"type": kind, "message": message}})


# Anthropic's error types follow the status.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_type(status: int) -> str:
    return ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def openai_error_body(message: str, kind: str) -> bytes:
    """An error body in OpenAI's schema (the OpenAI faces' and ``/v1/generate``'s)."""
    return _encoder.encode(ErrorResponse(ErrorDetail(message, kind, None, None)))


def tinker_error_body(message: str, category: str) -> bytes:
    """An error body in the Tinker face's format."""
    return _encoder.encode(error_payload(message, category))


def face_error_body(path: str, message: str, kind: str, category: str = "user") -> bytes:
    """An error body in the format of the face serving ``path``, for answers written
    outside the app (the server's body deadline): Tinker's under ``/api/`` (``category``),
    Anthropic's under ``/v1/messages``, OpenAI's schema elsewhere (``kind``)."""
    if path.startswith(TINKER_PREFIX):
        return tinker_error_body(message, category)
    if is_anthropic(path):
        return anthropic_error_body(message, kind)
    return openai_error_body(message, kind)


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


def exception_handlers(table: ErrorTable) -> ExceptionHandlersMap:
    """``table`` as Litestar exception handlers, for a router or controller: each listed
    exception answers in OpenAI's schema (prompt errors under the route's
    :data:`PROMPT_FIELD`)."""

    def handle(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
        error = table.error(exc, request.route_handler.opt.get(PROMPT_FIELD, "prompt"))
        assert isinstance(error, HTTPError)  # the table lists the exception's class
        return error_response(request, error)

    return {cls: handle for cls in table.rules}


def decode_json(
    decoder: msgspec.json.Decoder[T], raw: bytes, invalid: Callable[[str], HTTPError]
) -> T:
    """A JSON body; malformed JSON is a 400, a valid one the decoder refuses is
    ``invalid(msgspec's message)``."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as e:
        raise invalid(str(e)) from e
    except UnicodeDecodeError as e:  # a string's bytes are not UTF-8 (msgspec < 0.23)
        raise HTTPError(400, "malformed JSON: invalid UTF-8", "invalid_request_error") from e
    except msgspec.DecodeError as e:
        # msgspec >= 0.23 reports a string's bad bytes as a DecodeError of its own wording:
        # one message whatever the version.
        detail = "invalid UTF-8" if "utf-8" in str(e).lower() else str(e)
        raise HTTPError(400, f"malformed JSON: {detail}", "invalid_request_error") from e
    except RecursionError as e:  # msgspec's guard against deeply nested input
        raise HTTPError(400, "malformed JSON: nested too deeply", "invalid_request_error") from e


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
    if is_anthropic(request.url.path):  # routing's errors (405) under the Messages face
        body = anthropic_error_body(message, anthropic_type(status))
        return Response(body, status_code=status, media_type="application/json")
    return error_response(request, HTTPError(status, message, kind))
