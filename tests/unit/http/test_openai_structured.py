"""The OpenAI faces' structured-output fields -> one StructuredOutput, or a 400 naming the
field."""

import json
from typing import Any

import msgspec
import pytest

from adapters.http.errors import HTTPError
from adapters.http.openai.schemas import ChatCompletionRequest, CompletionRequest
from adapters.http.openai.structured import structured_output
from domain.errors import InvalidParameterError
from domain.sampling import StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.convert(body, ChatCompletionRequest)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        (
            {"response_format": {"type": "json_object"}},
            (StructuredOutput("json_object"), "response_format"),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a-b_1", "schema": SCHEMA, "strict": True},
                }
            },
            (StructuredOutput("json_schema", json.dumps(SCHEMA)), "response_format"),
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_fallback": True}},
            (StructuredOutput("json_schema", json.dumps(SCHEMA)), "structured_outputs"),
        ),
        (
            {"structured_outputs": {"regex": "[a-z]+"}},
            (StructuredOutput("regex", "[a-z]+"), "structured_outputs"),
        ),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            (StructuredOutput("choice", '["yes", "no"]'), "structured_outputs"),
        ),
        (
            {"structured_outputs": {"json_object": True}},
            (StructuredOutput("json_object"), "structured_outputs"),
        ),
        (
            {"guided_json": json.dumps(SCHEMA), "guided_decoding_backend": "llguidance"},
            (StructuredOutput("json_schema", json.dumps(SCHEMA)), "guided_json"),
        ),
        ({"guided_regex": "a|b"}, (StructuredOutput("regex", "a|b"), "guided_regex")),
        ({"guided_choice": ["x"]}, (StructuredOutput("choice", '["x"]'), "guided_choice")),
        (
            {"guided_grammar": 'start: "a"'},
            (StructuredOutput("grammar", 'start: "a"'), "guided_grammar"),
        ),
    ],
)
def test_each_form_becomes_one_constraint(fields: dict[str, Any], expected: object) -> None:
    assert structured_output(chat(**fields)) == expected


def test_completions_take_the_same_fields() -> None:
    body = msgspec.convert(
        {"prompt": "hi", "response_format": {"type": "json_object"}}, CompletionRequest
    )
    assert structured_output(body) == (StructuredOutput("json_object"), "response_format")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}},
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": [1]},
                }
            },
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "extra": 1}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[1, 2]"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        # Two constraints at once: the second is named.
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_malformed_or_conflicting_fields_are_400s_naming_the_field(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(HTTPError) as error:
        structured_output(chat(**fields))
    assert (error.value.status, error.value.param) == (400, param)


def test_an_engine_error_is_renamed_to_the_field_used() -> None:
    error = InvalidParameterError("response_format", "invalid regex: (a").renamed("guided_regex")
    assert (error.param, str(error)) == ("guided_regex", "guided_regex: invalid regex: (a")
