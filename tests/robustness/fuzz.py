"""Hypothesis strategies for hostile request bodies, and the checks every answer must pass."""

import copy
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# Values that broke servers before: lone surrogates (invalid UTF-8 once encoded), NUL,
# control tokens, a long string; numbers past int64, past float32, NaN and infinities.
NASTY_STRINGS = st.sampled_from(
    ["", "\udcff", "\ud800", "\x00", "<|im_start|>system\n", "\u2028", "é😀", "a" * 3000]
)
NASTY_NUMBERS = st.sampled_from(
    [
        0,
        -1,
        2**31,
        2**53 + 1,
        2**63,
        -(2**63) - 1,
        2**64,
        10**30,
        1e20,
        1e38,
        1e39,
        1e308,
        -1e308,
        5e-324,
        0.5,
        1.7,
        float("inf"),
        float("-inf"),
        float("nan"),
    ]
)
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | NASTY_NUMBERS
    | st.floats()
    | st.text(max_size=12)
    | NASTY_STRINGS
)
JSON_VALUES = st.recursive(
    LEAVES,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)
NUMBER_LISTS = st.lists(NASTY_NUMBERS | st.integers() | st.floats(), max_size=8)
CONTENT_TYPES = st.sampled_from(
    [
        "application/json",
        "application/json",
        "application/json",
        None,
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json; charset=utf-16",
        "application/x-protobuf",
    ]
)

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Payload:
    content: bytes
    content_type: str | None

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = dict(extra or {})
        if self.content_type is not None:
            headers["content-type"] = self.content_type
        return headers

    def __repr__(self) -> str:  # what a failure report shows
        return f"Payload({self.content[:300]!r}, content_type={self.content_type!r})"


def encode(body: Any, ascii_only: bool) -> bytes:
    """JSON as a careless client writes it: NaN and infinities as bare words, lone
    surrogates as ``\\udcff`` escapes or (``ascii_only`` False) as invalid UTF-8 bytes."""
    text = json.dumps(body, ensure_ascii=ascii_only, allow_nan=True)
    return text.encode("utf-8", "surrogatepass")


@st.composite
def mutated(draw: st.DrawFn, valid: dict[str, Any], paths: Sequence[Path]) -> Any:
    """``valid`` with up to three of ``paths`` replaced by hostile values or dropped, and
    sometimes an unknown field."""
    body = copy.deepcopy(valid)
    for path in draw(st.lists(st.sampled_from(list(paths)), max_size=3, unique=True)):
        parent = _walk(body, path[:-1])
        if parent is None:
            continue
        key = path[-1]
        if isinstance(parent, dict) and draw(st.integers(0, 3)) == 0:
            parent.pop(key, None)
        elif isinstance(parent, dict) or (isinstance(key, int) and key < len(parent)):
            parent[key] = draw(JSON_VALUES | NUMBER_LISTS | NASTY_NUMBERS | NASTY_STRINGS)
    if isinstance(body, dict) and draw(st.integers(0, 4)) == 0:
        body[draw(st.text(min_size=1, max_size=12))] = draw(JSON_VALUES)
    return body


def _walk(body: Any, path: Path) -> Any:
    for key in path:
        if (
            isinstance(body, dict)
            and isinstance(key, str)
            and isinstance(body.get(key), dict | list)
        ) or (isinstance(body, list) and isinstance(key, int) and key < len(body)):
            body = body[key]  # type: ignore[index]
        else:
            return None
    return body


def deep(valid: dict[str, Any], field: str, depth: int) -> bytes:
    """``valid`` with ``field`` nested ``depth`` lists deep."""
    head, _, tail = encode({**valid, field: "@"}, True).partition(b'"@"')
    return head + b"[" * depth + b"1" + b"]" * depth + tail


def payloads(valid: dict[str, Any], paths: Sequence[Path]) -> st.SearchStrategy[Payload]:
    """Bodies for an endpoint whose well-formed request is ``valid``."""
    good = encode(valid, True)
    json_bodies = st.builds(encode, mutated(valid, paths) | JSON_VALUES, st.booleans())
    broken = st.one_of(
        st.binary(max_size=64),
        st.integers(0, len(good) - 1).map(lambda n: good[:n]),  # truncated
        st.integers(1, len(good) - 2).map(lambda n: good[:n] + b"\xff\xfe" + good[n:]),
        st.sampled_from([1000, 100_000]).map(lambda d: b"[" * d + b"]" * d),
        st.sampled_from([1000, 100_000]).map(lambda d: deep(valid, paths[0][0], d)),  # type: ignore[arg-type]
    )
    return st.builds(Payload, json_bodies | broken, CONTENT_TYPES)


LEAKS = ("Traceback", 'File "', "site-packages", os.getcwd())


def assert_error_format(path: str, status: int, text: str) -> None:
    """A 4xx body in the API's own schema, naming no exception or file."""
    body = json.loads(text)
    if path.startswith("/api/v1/"):  # Tinker: {"detail", "error", "category"}
        assert isinstance(body.get("error"), str) and isinstance(body.get("category"), str), body
        assert body["category"] == "user", body
    else:  # OpenAI's schema (also /v1/generate's errors)
        error = body.get("error")
        assert isinstance(error, dict), body
        assert isinstance(error.get("message"), str) and isinstance(error.get("type"), str), body
    for leak in LEAKS:
        assert leak not in text, (status, text[:500])


# --- known defects ------------------------------------------------------------------------


@dataclass(frozen=True)
class KnownDefect:
    """A failure another part of the work is fixing: a fuzz example that fails this way is
    reported as an xfail (naming the owner), any other failure fails the test."""

    owner: str
    reason: str
    matches: Callable[[str, Payload, str], bool]  # (path, payload, failure message)


@dataclass
class Hit:
    defect: KnownDefect
    path: str
    payload: Payload
    failure: str


def checked(
    check: Callable[[str, Payload], None],
    path: str,
    payload: Payload,
    defects: Sequence[KnownDefect],
    hits: list[Hit],
) -> None:
    try:
        check(path, payload)
    except AssertionError as e:
        failure = str(e)
        defect = next((d for d in defects if d.matches(path, payload, failure)), None)
        if defect is None:
            raise
        hits.append(Hit(defect, path, payload, failure.splitlines()[0][:200]))


def fuzz_path(
    check: Callable[[str, Payload], None],
    path: str,
    strategy: st.SearchStrategy[Payload],
    defects: Sequence[KnownDefect],
    max_examples: int | None = None,
) -> None:
    """``check(path, payload)`` on payloads drawn from ``strategy`` (as many as the profile
    says, or ``max_examples``); failures of a known defect end the test as an xfail."""
    hits: list[Hit] = []

    @given(payload=strategy)
    def run(payload: Payload) -> None:
        checked(check, path, payload, defects, hits)

    if max_examples is not None:
        run = settings(max_examples=max_examples)(run)
    run()
    xfail_if_hit(hits)


def xfail_if_hit(hits: list[Hit]) -> None:
    """End the test as an xfail naming the known defects it ran into."""
    if hits:
        seen = {(h.defect.owner, h.defect.reason): h for h in hits}
        lines = [
            f"[{o}] {r}; e.g. {h.path} {h.payload!r}: {h.failure}" for (o, r), h in seen.items()
        ]
        pytest.xfail("; ".join(lines))


def is_utf8(content: bytes) -> bool:
    try:
        content.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
