"""Request schemas of tool calling and structured outputs: function definitions, tool_choice, the assistant's tool calls
a client sends back in the history, and OpenAI's response_format turned into a grammar (engine/sample/grammar.py)."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import Field

from specserve.engine.sample.grammar import GrammarSpec
from specserve.server.schema_base import StrictModel, UnsupportedFieldError


class FunctionCallIn(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(StrictModel):
    """An assistant message's tool call, as the client sends the history back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn
    index: int | None = None  # present when a client rebuilt the message from stream deltas


class FunctionDef(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments
    strict: bool | None = None


class ToolDef(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


def response_format_spec(fmt: dict[str, Any] | None) -> GrammarSpec | None:
    """OpenAI's response_format: text (nothing to enforce), json_object, or json_schema {name, schema, strict}."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return GrammarSpec("json_object", "", "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if set(fmt) != {"type", "json_schema"} or not isinstance(spec, dict):
            raise UnsupportedFieldError("response_format.json_schema", "response_format.json_schema: an object "
                                        "{name, schema, strict, description} is required")
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise UnsupportedFieldError("response_format.json_schema", "response_format.json_schema: unknown "
                                        f"field(s) {', '.join(sorted(unknown))}")
        name, schema = spec.get("name"), spec.get("schema", {})
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise UnsupportedFieldError("response_format.json_schema.name", "response_format.json_schema.name: "
                                        "1-64 letters, digits, _ or - (required)")
        if not isinstance(schema, dict) or not isinstance(spec.get("strict", False), (bool, type(None))):
            raise UnsupportedFieldError("response_format.json_schema.schema", "response_format.json_schema: "
                                        "schema must be an object and strict a boolean")
        return GrammarSpec("json_schema", json.dumps(schema), "response_format.json_schema.schema")
    raise UnsupportedFieldError("response_format", "response_format: type must be text, json_object or "
                                "json_schema (with only the fields OpenAI defines)")
