"""The API-key guard (adapters/http/auth.py): where keys are read, which are accepted, and
the tenant each stands for."""

from types import SimpleNamespace
from typing import Any

import pytest

from adapters.http.auth import ApiKeyGuard, tenant_id
from adapters.http.errors import HTTPError


class Refused(Exception):
    pass


def conn(**headers: str) -> Any:
    """A connection with these headers (lower-case names, as Litestar gives them)."""
    return SimpleNamespace(headers={k.replace("_", "-"): v for k, v in headers.items()})


GUARD = ApiKeyGuard(Refused, prefix="tml-")


def refusal(guard: ApiKeyGuard, connection: Any) -> str:
    with pytest.raises(Refused) as raised:
        guard.tenant(connection)
    return str(raised.value)


def test_the_key_comes_in_x_api_key_or_as_a_bearer_token() -> None:
    assert GUARD.key(conn(x_api_key="tml-a")) == "tml-a"
    assert GUARD.key(conn(authorization="Bearer tml-b")) == "tml-b"
    # X-API-Key first; an empty one falls back to the bearer token.
    assert GUARD.key(conn(x_api_key="tml-a", authorization="Bearer tml-b")) == "tml-a"
    assert GUARD.key(conn(x_api_key="", authorization="Bearer tml-b")) == "tml-b"
    # Another scheme, or none, is no key.
    assert GUARD.key(conn(authorization="Basic dG1sLWE6")) == ""
    assert GUARD.key(conn(authorization="tml-a")) == ""
    assert GUARD.key(conn()) == ""


def test_headers_and_bearer_are_configured_per_face() -> None:
    guard = ApiKeyGuard(Refused, headers=("api-key", "x-goog-api-key"), bearer=False)
    assert guard.key(conn(api_key="k1")) == "k1"
    assert guard.key(conn(x_goog_api_key="k2")) == "k2"
    assert guard.key(conn(x_api_key="k3")) == ""
    assert guard.key(conn(authorization="Bearer k4")) == ""


def test_a_missing_key_is_refused_with_where_to_send_it() -> None:
    assert "X-API-Key" in refusal(GUARD, conn())
    assert "X-API-Key" in refusal(GUARD, conn(authorization="Bearer "))


def test_without_a_key_set_any_key_with_the_prefix_is_accepted() -> None:
    assert GUARD.tenant(conn(x_api_key="tml-anything")) == tenant_id("tml-anything")
    assert refusal(GUARD, conn(x_api_key="sk-abc")) == "API keys start with 'tml-'"


def test_with_a_key_set_only_its_keys_are_accepted_prefix_or_not() -> None:
    guard = ApiKeyGuard(Refused, keys=frozenset({"tml-good", "other"}), prefix="tml-")
    assert guard.tenant(conn(x_api_key="tml-good")) == tenant_id("tml-good")
    assert guard.tenant(conn(authorization="Bearer other")) == tenant_id("other")
    assert refusal(guard, conn(x_api_key="tml-unknown")) == "invalid API key"
    assert refusal(guard, conn(x_api_key="sk-x")) == "invalid API key"


def test_an_empty_key_set_accepts_nobody() -> None:
    guard = ApiKeyGuard(Refused, keys=frozenset())
    assert refusal(guard, conn(x_api_key="tml-a")) == "invalid API key"


def test_a_tenant_is_a_stable_hash_of_the_key_never_the_key() -> None:
    a, b = tenant_id("tml-secret-a"), tenant_id("tml-secret-b")
    assert a == tenant_id("tml-secret-a") != b
    assert len(a) == 24 and all(c in "0123456789abcdef" for c in a)
    assert "secret" not in a
    # The same key in either header is the same tenant.
    assert GUARD.tenant(conn(x_api_key="tml-k")) == GUARD.tenant(conn(authorization="Bearer tml-k"))


def test_refusals_take_the_face_s_error_format() -> None:
    guard = ApiKeyGuard(lambda message: HTTPError(401, message, "authentication_error"))
    with pytest.raises(HTTPError) as raised:
        guard.tenant(conn())
    assert (raised.value.status, raised.value.kind) == (401, "authentication_error")
