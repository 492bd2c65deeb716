"""One error table per face: every mapped exception answers with its status, type and
param; anything else is left to the face's catch-all."""

import json

import pytest

from adapters.http.errors import GENERATE_ERRORS, OPENAI_ERRORS, ErrorTable, HTTPError
from adapters.http.tinker.errors import TINKER_ERRORS, refused_key, tinker_error_response
from application.tinker.downloads import LinkRefusedError
from domain.errors import (
    EmptyPromptError,
    InvalidParameterError,
    PromptTooLongError,
    QueueFullError,
)
from domain.tinker.errors import (
    BackendFailure,
    InvalidTrainingRequest,
    NotFoundError,
    RetryLaterError,
    SequenceConflictError,
    SessionClosedError,
    UnsupportedFeatureError,
)

TOO_LONG = PromptTooLongError(10, 5, 12)


def answer(table: ErrorTable, e: Exception, field: str = "prompt") -> HTTPError:
    error = table.error(e, field)
    assert isinstance(error, HTTPError)
    assert error.message == str(e)
    return error


@pytest.mark.parametrize(
    ("exc", "field", "status", "kind", "param", "code"),
    [
        (TOO_LONG, "messages", 400, "invalid_request_error", "messages", "context_length_exceeded"),
        (EmptyPromptError(), "prompt", 400, "invalid_request_error", "prompt", None),
        (EmptyPromptError(), "messages", 400, "invalid_request_error", "messages", None),
        (
            InvalidParameterError("top_p", "bad"),
            "messages",
            400,
            "invalid_request_error",
            "top_p",
            None,
        ),
        (QueueFullError("full"), "prompt", 429, "server_error", None, "queue_full"),
    ],
)
def test_openai_table(
    exc: Exception, field: str, status: int, kind: str, param: str | None, code: str | None
) -> None:
    error = answer(OPENAI_ERRORS, exc, field)
    assert (error.status, error.kind, error.param, error.code) == (status, kind, param, code)
    assert error.headers == ({"Retry-After": "1"} if status == 429 else {})


@pytest.mark.parametrize(
    ("exc", "status", "kind", "param"),
    [
        (EmptyPromptError(), 400, "invalid_request_error", "prompt"),
        (TOO_LONG, 422, "invalid_request_error", "prompt"),
        (InvalidParameterError("temperature", "bad"), 422, "invalid_request_error", "temperature"),
        (QueueFullError("full"), 503, "overloaded_error", None),
    ],
)
def test_generate_table(exc: Exception, status: int, kind: str, param: str | None) -> None:
    error = answer(GENERATE_ERRORS, exc)
    assert (error.status, error.kind, error.param, error.code) == (status, kind, param, None)
    assert error.headers == ({"Retry-After": "1"} if status == 503 else {})


@pytest.mark.parametrize(
    ("exc", "status", "category"),
    [
        (NotFoundError("no"), 404, "user"),
        (SessionClosedError("ended"), 410, "user"),
        (RetryLaterError("full"), 429, "user"),
        (LinkRefusedError("bad link"), 403, "user"),
        (InvalidTrainingRequest("bad"), 400, "user"),
        (UnsupportedFeatureError("no"), 400, "user"),
        (SequenceConflictError("again"), 400, "user"),
        (BackendFailure("broke"), 400, "server"),
    ],
)
def test_tinker_table(exc: Exception, status: int, category: str) -> None:
    error = answer(TINKER_ERRORS, exc)
    assert (error.status, error.kind) == (status, category)
    response = tinker_error_response(None, exc)  # type: ignore[arg-type]
    assert response.status_code == status
    body = json.loads(response.content)
    assert body == {"detail": str(exc), "error": str(exc), "category": category}
    assert ("retry-after" in {k.lower() for k in response.headers}) == (status == 429)


@pytest.mark.parametrize("table", [OPENAI_ERRORS, GENERATE_ERRORS, TINKER_ERRORS])
def test_unmapped_errors_and_http_errors_pass_through(table: ErrorTable) -> None:
    bug = RuntimeError("a bug")
    assert table.error(bug) is bug
    ready = HTTPError(418, "teapot", "x")
    assert table.error(ready) is ready


def test_the_tinker_face_hides_unexpected_errors_and_answers_its_own() -> None:
    response = tinker_error_response(None, RuntimeError("/secret/path"))  # type: ignore[arg-type]
    assert response.status_code == 500
    assert json.loads(response.content)["category"] == "server"
    assert b"/secret/path" not in response.content
    response = tinker_error_response(None, refused_key("invalid API key"))  # type: ignore[arg-type]
    assert response.status_code == 401
    assert json.loads(response.content)["error"] == "invalid API key"
