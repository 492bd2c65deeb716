"""Structured outputs on the OpenAI faces: the request's one output constraint, from
OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) or vLLM's
extensions (``structured_outputs``, and the older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``), as a :class:`StructuredOutput`. Malformed or
conflicting fields are 400s naming the field; whether the constraint compiles is checked
when the prompt is prepared (its errors name the field it came from).
"""

import json
import re
from typing import Any, NoReturn

from adapters.http.errors import HTTPError
from adapters.http.openai.schemas import ChatCompletionRequest, CompletionRequest
from domain.sampling import StructuredOutput

# What ``guided_decoding_backend`` may name: ours, or the server's choice.
BACKENDS = ("llguidance", "guidance", "auto")
_SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
# vLLM's StructuredOutputsParams: one constraint, and options we accept (ours are fixed:
# no free whitespace, no fallback to another backend).
_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_NO_OP_KEYS = {"disable_fallback", "disable_any_whitespace"}

Body = CompletionRequest | ChatCompletionRequest


def structured_output(body: Body) -> tuple[StructuredOutput, str] | None:
    """The body's output constraint and the field it came from (None: free text)."""
    _check_backend(body)
    if body.guided_whitespace_pattern is not None:
        _fail("guided_whitespace_pattern", "is not supported (JSON has a fixed layout)")
    found = [
        (constraint, field)
        for field, constraint in (
            ("response_format", response_format(body.response_format)),
            ("structured_outputs", structured_outputs(body.structured_outputs)),
            ("guided_json", _json_schema(body.guided_json, "guided_json")),
            ("guided_regex", _text("regex", body.guided_regex, "guided_regex")),
            ("guided_choice", _choice(body.guided_choice, "guided_choice")),
            ("guided_grammar", _text("grammar", body.guided_grammar, "guided_grammar")),
        )
        if constraint is not None
    ]
    if len(found) > 1:
        fields = ", ".join(field for _, field in found)
        _fail(found[1][1], f"only one output constraint may be set, got {fields}")
    return found[0] if found else None


def response_format(value: dict[str, Any] | None) -> StructuredOutput | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        _only(value, {"type"}, "response_format")
        return None
    if kind == "json_object":
        _only(value, {"type"}, "response_format")
        return StructuredOutput("json_object")
    if kind != "json_schema":
        _fail("response_format", f"type must be text, json_object or json_schema, got {kind!r}")
    _only(value, {"type", "json_schema"}, "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        _fail("response_format", "json_schema must be an object with a name and a schema")
    _only(spec, _JSON_SCHEMA_KEYS, "response_format", "json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        _fail("response_format", "json_schema.name must be 1-64 letters, digits, _ or -")
    if not isinstance(spec.get("strict", False), bool | None):
        _fail("response_format", "json_schema.strict must be a boolean")
    if not isinstance(spec.get("description", ""), str):
        _fail("response_format", "json_schema.description must be a string")
    return _json_schema(spec.get("schema", {}), "response_format")


def structured_outputs(value: dict[str, Any] | None) -> StructuredOutput | None:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar,
    json_object."""
    if value is None:
        return None
    field = "structured_outputs"
    _only(value, {*_CONSTRAINT_KEYS, *_NO_OP_KEYS}, field)
    given = [k for k in _CONSTRAINT_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        _fail(field, f"needs exactly one of {', '.join(_CONSTRAINT_KEYS)}")
    key = given[0]
    if key == "json":
        return _json_schema(value[key], field)
    if key == "choice":
        return _choice(value[key], field)
    if key == "json_object":
        if value[key] is not True:
            _fail(field, "json_object must be true")
        return StructuredOutput("json_object")
    return _text("regex" if key == "regex" else "grammar", value[key], field)


def _json_schema(schema: Any, field: str) -> StructuredOutput | None:
    """A schema given as an object or as JSON text."""
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            _fail(field, "the schema is not valid JSON")
    if not isinstance(schema, dict):
        _fail(field, "the schema must be a JSON object")
    return StructuredOutput("json_schema", json.dumps(schema))


def _choice(choices: Any, field: str) -> StructuredOutput | None:
    if choices is None:
        return None
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        _fail(field, "choices must be a non-empty list of strings")
    return StructuredOutput("choice", json.dumps(choices))


def _text(kind: str, spec: Any, field: str) -> StructuredOutput | None:
    if spec is None:
        return None
    if not isinstance(spec, str) or not spec:
        _fail(field, f"the {kind} must be a non-empty string")
    return StructuredOutput("regex" if kind == "regex" else "grammar", spec)


def _check_backend(body: Body) -> None:
    backend = body.guided_decoding_backend
    if backend is not None and backend not in BACKENDS:
        _fail(
            "guided_decoding_backend",
            f"this server decodes with llguidance; got {backend!r} (use one of "
            f"{', '.join(BACKENDS)}, or leave it out)",
        )


def _only(value: dict[str, Any], keys: set[str], field: str, inside: str = "") -> None:
    extra = sorted(set(value) - keys)
    if extra:
        where = f" in {inside}" if inside else ""
        _fail(field, f"unknown or unsupported key {extra[0]!r}{where}")


def _fail(field: str, message: str) -> NoReturn:
    raise HTTPError(400, f"{field}: {message}", "invalid_request_error", field)
