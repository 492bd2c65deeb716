"""JSON schemas for structured-output tests and the grammar-library comparison.

Each case: a name, a schema, a user prompt that asks the model for such a document, and a
valid example (the comparison walks it token by token; a unit test checks it validates).
They cover types, enums, const, nested objects, arrays with min/max items, string
patterns and lengths, numeric bounds, required, additionalProperties false, anyOf, $ref.
"""

from typing import Any, NamedTuple


class SchemaCase(NamedTuple):
    name: str
    schema: dict[str, Any]
    prompt: str
    example: Any


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """A closed object: every property required unless ``required`` says otherwise."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SHORT = {"type": "string", "maxLength": 40}

SCHEMAS: list[SchemaCase] = [
    SchemaCase("string", {"type": "string", "maxLength": 60}, "Name a city.", "Paris"),
    # Bounds on top-level numbers: a small model left free continues a number's digits.
    SchemaCase(
        "integer",
        {"type": "integer", "minimum": 0, "maximum": 100},
        "How many legs has a spider?",
        8,
    ),
    SchemaCase(
        "number",
        {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.01},
        "What is pi to two decimals?",
        3.14,
    ),
    SchemaCase("boolean", {"type": "boolean"}, "Is water wet?", True),
    SchemaCase("null", {"type": "null"}, "Say nothing.", None),
    SchemaCase(
        "enum_string",
        {"enum": ["red", "green", "blue"]},
        "Pick a primary colour of light.",
        "green",
    ),
    SchemaCase("enum_mixed", {"enum": [1, "two", None, True]}, "Pick one value.", "two"),
    SchemaCase("const", {"const": "yes"}, "Do you agree?", "yes"),
    SchemaCase(
        "person",
        _obj({"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 150}}),
        "Describe a person with a name and an age.",
        {"name": "Ada", "age": 36},
    ),
    SchemaCase(
        "optional_fields",
        _obj(
            {"title": SHORT, "year": {"type": "integer"}, "rating": {"type": "number"}},
            required=["title"],
        ),
        "Describe a film.",
        {"title": "Alien", "year": 1979},
    ),
    SchemaCase(
        "nested_object",
        _obj(
            {
                "user": _obj({"id": {"type": "integer"}, "email": SHORT}),
                "active": {"type": "boolean"},
            }
        ),
        "Describe a user account.",
        {"user": {"id": 7, "email": "a@b.c"}, "active": False},
    ),
    SchemaCase(
        "deeply_nested",
        _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "integer"}})})})}),
        "Give a nested object a.b.c.d holding a number.",
        {"a": {"b": {"c": {"d": 1}}}},
    ),
    SchemaCase(
        "array_of_integers",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 5},
        "List a few prime numbers.",
        [2, 3, 5],
    ),
    SchemaCase(
        "array_exact",
        {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "minItems": 3,
            "maxItems": 3,
        },
        "Name three fruits.",
        ["apple", "pear", "plum"],
    ),
    SchemaCase(
        "array_of_objects",
        {
            "type": "array",
            "items": _obj({"sku": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 99}}),
            "minItems": 1,
            "maxItems": 3,
        },
        "List the items of a shopping order.",
        [{"sku": "A1", "qty": 2}],
    ),
    SchemaCase(
        "array_empty_allowed",
        {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
        "Give a list of booleans.",
        [],
    ),
    SchemaCase(
        "pattern_date",
        {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "When did the Apollo 11 landing happen? Answer as YYYY-MM-DD.",
        "1969-07-20",
    ),
    SchemaCase(
        "pattern_in_object",
        _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}, "name": SHORT}),
        "Give an airport code and its city.",
        {"code": "CDG", "name": "Paris"},
    ),
    SchemaCase(
        "string_lengths",
        _obj({"word": {"type": "string", "minLength": 3, "maxLength": 8}}),
        "Give a word.",
        {"word": "hello"},
    ),
    SchemaCase(
        "number_bounds",
        _obj(
            {
                "celsius": {"type": "number", "minimum": -50, "maximum": 60},
                "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            }
        ),
        "Report today's weather.",
        {"celsius": 21.5, "humidity": 40},
    ),
    SchemaCase(
        "exclusive_bounds",
        {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        "Pick a number between 1 and 9.",
        5,
    ),
    SchemaCase(
        "anyof_scalar",
        {"anyOf": [{"type": "integer", "maximum": 9999}, {"type": "string", "maxLength": 20}]},
        "Give an id, a number or a short string.",
        "abc",
    ),
    SchemaCase(
        "anyof_objects",
        {
            "anyOf": [
                _obj({"kind": {"const": "circle"}, "radius": {"type": "number"}}),
                _obj({"kind": {"const": "square"}, "side": {"type": "number"}}),
            ]
        },
        "Describe a shape.",
        {"kind": "square", "side": 2},
    ),
    SchemaCase(
        "nullable",
        _obj({"nickname": {"anyOf": [SHORT, {"type": "null"}]}}),
        "Give a nickname, or null.",
        {"nickname": None},
    ),
    SchemaCase(
        "type_list",
        _obj({"value": {"type": ["integer", "boolean"]}}),
        "Give a value that is a number or a boolean.",
        {"value": True},
    ),
    SchemaCase(
        "enum_in_object",
        _obj(
            {
                "status": {"enum": ["open", "closed", "pending"]},
                "priority": {"enum": [1, 2, 3]},
            }
        ),
        "Describe a ticket's status and priority.",
        {"status": "open", "priority": 2},
    ),
    SchemaCase(
        "ref_defs",
        {
            "$defs": {"point": _obj({"x": {"type": "number"}, "y": {"type": "number"}})},
            **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
        },
        "Describe a line segment by its two end points.",
        {"start": {"x": 0, "y": 0}, "end": {"x": 1, "y": 2}},
    ),
    SchemaCase(
        "open_object",
        {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
        "Describe a record with an id.",
        {"id": 1, "extra": "x"},
    ),
    SchemaCase(
        "tool_call",  # the shape tool_choice=required builds: one of the tools' calls
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "anyOf": [
                    _obj(
                        {
                            "name": {"const": "get_weather"},
                            "parameters": _obj({"city": SHORT}),
                        }
                    ),
                    _obj(
                        {
                            "name": {"const": "get_time"},
                            "parameters": _obj({"timezone": SHORT}),
                        }
                    ),
                ]
            },
        },
        "Call a tool to get the weather in Paris.",
        [{"name": "get_weather", "parameters": {"city": "Paris"}}],
    ),
    SchemaCase(
        "mixed_record",
        _obj(
            {
                "id": {"type": "integer"},
                "tags": {"type": "array", "items": SHORT, "maxItems": 3},
                "score": {"type": "number"},
                "valid": {"type": "boolean"},
                "owner": _obj({"name": SHORT}),
            }
        ),
        "Describe a database record.",
        {"id": 1, "tags": ["a"], "score": 0.5, "valid": True, "owner": {"name": "Bo"}},
    ),
    SchemaCase(
        "matrix",
        {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
            "minItems": 2,
            "maxItems": 2,
        },
        "Give a 2x2 matrix of integers.",
        [[1, 0], [0, 1]],
    ),
    SchemaCase(
        "recipe",
        _obj(
            {
                "dish": SHORT,
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": {
                    "type": "array",
                    "items": _obj({"item": SHORT, "grams": {"type": "integer", "minimum": 0}}),
                    "minItems": 1,
                    "maxItems": 4,
                },
                "vegetarian": {"type": "boolean"},
            }
        ),
        "Write a short recipe.",
        {
            "dish": "Soup",
            "servings": 2,
            "ingredients": [{"item": "leek", "grams": 300}],
            "vegetarian": True,
        },
    ),
    SchemaCase(
        "empty_schema",  # any JSON value
        {},
        "Give a JSON list of the numbers one, two and three.",
        {"x": [1, "y"]},
    ),
    SchemaCase(
        "object_any",  # what json_object asks for
        {"type": "object"},
        "Give any JSON object.",
        {"k": 1},
    ),
]
