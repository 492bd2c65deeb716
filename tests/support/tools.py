"""OpenAI tool definitions for the tests that call chat completions with ``tools``."""

from typing import Any


def function_tool(
    name: str, description: str, properties: dict[str, Any], **schema: Any
) -> dict[str, Any]:
    """A function tool whose arguments are an object of ``properties``, all of them required
    (``schema``: more keywords of that object's JSON schema)."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(properties),
                **schema,
            },
        },
    }
