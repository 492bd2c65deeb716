"""Hostile bodies against /v1/completions, /v1/chat/completions and /v1/generate (the fake
model, in process): never a 5xx, errors in the API's schema, nothing left in the engine."""

from typing import Any

import pytest
from litestar.testing import TestClient

from tests.robustness.fuzz import (
    Hit,
    KnownDefect,
    Path,
    Payload,
    assert_error_format,
    checked,
    encode,
    fuzz_path,
    payloads,
    xfail_if_hit,
)
from tests.robustness.harness import MODEL, fake_stack

_SAMPLING: list[Path] = [
    ("model",),
    ("max_tokens",),
    ("temperature",),
    ("top_p",),
    ("top_k",),
    ("min_p",),
    ("repetition_penalty",),
    ("presence_penalty",),
    ("frequency_penalty",),
    ("seed",),
    ("stop",),
    ("stop_token_ids",),
    ("stream",),
    ("stream_options",),
    ("n",),
    ("logprobs",),
    ("logit_bias",),
    ("ignore_eos",),
]
ENDPOINTS: dict[str, tuple[dict[str, Any], list[Path]]] = {
    "/v1/completions": (
        {"model": MODEL, "prompt": "hi", "max_tokens": 4},
        [("prompt",), ("prompt", 0), ("echo",), ("best_of",), ("suffix",), *_SAMPLING],
    ),
    "/v1/chat/completions": (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        [
            ("messages",),
            ("messages", 0),
            ("messages", 0, "role"),
            ("messages", 0, "content"),
            ("messages", 0, "name"),
            ("max_completion_tokens",),
            ("tools",),
            ("tool_choice",),
            ("response_format",),
            ("top_logprobs",),
            *_SAMPLING,
        ],
    ),
    "/v1/generate": (
        {"model": MODEL, "prompt": "hi", "max_tokens": 4},
        [
            ("prompt",),
            ("model",),
            ("max_tokens",),
            ("temperature",),
            ("top_p",),
            ("top_k",),
            ("repetition_penalty",),
            ("stop",),
            ("seed",),
            ("stream",),
        ],
    ),
}
STRATEGIES = {path: payloads(valid, paths) for path, (valid, paths) in ENDPOINTS.items()}


def check(path: str, payload: Payload) -> None:
    """One request on a fresh app (a leftover must not fail the examples after it)."""
    stack = fake_stack(max_model_len=512, max_waiting_requests=8, max_num_seqs=4)
    with TestClient(stack.app()) as http:
        response = http.post(path, content=payload.content, headers=payload.headers())
        assert response.status_code < 500, (response.status_code, response.text[:500])
        if response.status_code >= 400:
            assert_error_format(path, response.status_code, response.text)
        assert stack.wait_idle(timeout_s=2.0) == {}


# Known defects on these endpoints (examples failing only so would xfail): none left.
DEFECTS: list[KnownDefect] = []


def fuzz(path: str, max_examples: int | None = None) -> None:
    fuzz_path(check, path, STRATEGIES[path], DEFECTS, max_examples)


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_fuzzed_bodies_get_a_4xx_in_the_error_schema_and_leave_nothing_queued(path: str) -> None:
    fuzz(path)


@pytest.mark.slow
@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_fuzzed_bodies_thoroughly(path: str) -> None:
    fuzz(path, max_examples=600)


# The issue's own findings, as fixed examples on each endpoint: (id, the prompt (or chat
# content) as raw JSON, more raw fields, content type).
KNOWN: list[tuple[str, bytes, bytes, str | None]] = [
    ("invalid-utf8-in-a-string", b'"h\xffi"', b"", "application/json"),
    ("invalid-utf8-escape", b'"\\udcff"', b"", "application/json"),
    ("form-urlencoded-json", b'"hi"', b"", "application/x-www-form-urlencoded"),
    ("no-content-type", b'"hi"', b"", None),
    ("float-max-tokens", b'"hi"', b', "max_tokens": 1e20', "application/json"),
    ("seed-past-uint64", b'"hi"', b', "seed": 18446744073709551616', "application/json"),
    ("nan-temperature", b'"hi"', b', "temperature": NaN', "application/json"),
    ("deep-prompt", b"[" * 5000 + b"]" * 5000, b"", "application/json"),
    ("a-bad-token-id-among-prompts", b"[[1, 2, 3], [-1]]", b"", "application/json"),
    ("token-id-past-int64", b"[99999999999999999999]", b"", "application/json"),
]


def known_body(path: str, prompt: bytes, extra: bytes) -> bytes:
    if path == "/v1/chat/completions":
        slot = b'"messages": [{"role": "user", "content": ' + prompt + b"}]"
    else:
        slot = b'"prompt": ' + prompt
    return b'{"model": "' + MODEL.encode() + b'", ' + slot + extra + b"}"


@pytest.mark.parametrize("path", list(ENDPOINTS))
@pytest.mark.parametrize(
    ("prompt", "extra", "content_type"), [k[1:] for k in KNOWN], ids=[k[0] for k in KNOWN]
)
def test_known_hostile_bodies(
    path: str, prompt: bytes, extra: bytes, content_type: str | None
) -> None:
    hits: list[Hit] = []
    checked(check, path, Payload(known_body(path, prompt, extra), content_type), DEFECTS, hits)
    xfail_if_hit(hits)


def test_the_valid_request_each_strategy_mutates_succeeds() -> None:
    stack = fake_stack()
    with TestClient(stack.app()) as http:
        for path, (valid, _) in ENDPOINTS.items():
            assert http.post(path, content=encode(valid, True)).status_code == 200, path
