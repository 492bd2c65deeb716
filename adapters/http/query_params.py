"""Query-string values read strictly (the usage API, the audit trail): a parameter given
twice, a number that does not parse or lies past ±2**53 is an ``InvalidRequestError``
naming it (a 400 in the face's format), never a 500."""

from typing import Any

from domain.errors import InvalidRequestError

LIMIT = 2**53


def one(params: Any, name: str) -> str | None:
    """The value of ``name`` (None: absent)."""
    values = params.getall(name, [])
    if len(values) > 1:
        raise InvalidRequestError(name, f"{name} is given {len(values)} times")
    return values[0] if values else None


def integer(params: Any, name: str) -> int | None:
    value = one(params, name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise InvalidRequestError(name, f"{name} must be an integer, got {value[:40]!r}") from None
    if not -LIMIT <= number <= LIMIT:
        raise InvalidRequestError(name, f"{name} is out of range")
    return number


def number(params: Any, name: str) -> float | None:
    value = one(params, name)
    if value is None:
        return None
    try:
        parsed = float(value)
    except ValueError:
        raise InvalidRequestError(name, f"{name} must be a number, got {value[:40]!r}") from None
    if not -LIMIT <= parsed <= LIMIT:  # NaN and the infinities too
        raise InvalidRequestError(name, f"{name} is out of range")
    return parsed


def values(params: Any, name: str) -> frozenset[str] | None:
    """Every value of ``name`` (also written ``name[]``), None when none."""
    found = params.getall(name, []) + params.getall(f"{name}[]", [])
    return frozenset(found) if found else None
