"""Tool arguments: exactly what each tool's published input schema says, nothing more.

The SDK builds a tool's argument model from the method's signature in pydantic's
lax mode: ``true`` and ``"1"`` pass as the integer 1, a string holding JSON is
parsed into an array or object, and an argument the tool does not take is
dropped without a word. For a fencing token that is a hole (an agent that sent
``fencingToken: true`` gets a write admitted under token 1), and a misspelt
argument (``fencing_token``) silently turns a fenced write into an unfenced one.

``strict_tool`` rebuilds each tool's model strict (no conversion between JSON
types: a boolean or a string is never a number) and closed
(``additionalProperties: false``), drops the JSON-in-a-string pre-parsing, and
publishes the strict model's own schema in ``tools/list``: an argument object
is accepted exactly when it validates against that schema.
``invalid_arguments_text`` turns what it refuses into one sentence per argument.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mcp.server.mcpserver.tools import Tool
from mcp.server.mcpserver.utilities.func_metadata import ArgModelBase, FuncMetadata
from pydantic import ConfigDict, ValidationError, create_model

__all__ = ["StrictArguments", "invalid_arguments_text", "strict_tool"]

_MAX_SHOWN_INPUT = 80
# pydantic's type errors -> the JSON type the schema asks for.
_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "a boolean",
    "list_type": "an array",
    "dict_type": "an object",
}
_RANGE_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


class StrictArguments(ArgModelBase):
    """The base of every tool's argument model: strict types, unknown names refused."""

    model_config = ConfigDict(extra="forbid", strict=True, arbitrary_types_allowed=True)


class _StrictMetadata(FuncMetadata):
    def pre_parse_json(self, data: dict[str, Any]) -> dict[str, Any]:
        """The arguments as JSON means them, before the strict model sees them.

        No JSON inside strings: ``"tags": "[\\"a\\"]"`` stays a string, so it is
        refused. A number with a zero fraction is an integer, as JSON Schema
        reads ``"type": "integer"``: ``1.0`` is the token 1 (``1.5`` is refused).
        """
        return {
            name: int(value) if isinstance(value, float) and value.is_integer() else value
            for name, value in data.items()
        }


def strict_tool(tool: Tool) -> Tool:
    """``tool`` with a strict, closed argument model, and that model's schema published."""
    lax = tool.fn_metadata.arg_model
    fields: dict[str, Any] = {
        name: (field.annotation, field) for name, field in lax.model_fields.items()
    }
    strict = create_model(
        lax.__name__, __base__=StrictArguments, __module__=lax.__module__, **fields
    )
    metadata = _StrictMetadata(
        arg_model=strict,
        output_schema=tool.fn_metadata.output_schema,
        output_model=tool.fn_metadata.output_model,
        wrap_output=tool.fn_metadata.wrap_output,
    )
    parameters = strict.model_json_schema(by_alias=True)
    return tool.model_copy(update={"fn_metadata": metadata, "parameters": parameters})


def invalid_arguments_text(tool: str, error: ValidationError, schema: Mapping[str, Any]) -> str:
    """What ``error`` refused, one sentence per argument, in the tool's camelCase names.

    ``schema`` is the tool's input schema: it lists the arguments the tool takes
    (named when an unknown one is refused) and the bounds of numbers.
    """
    problems = error.errors(include_url=False)
    properties: Mapping[str, Any] = schema.get("properties", {})
    unknown = [_where(problem) for problem in problems if problem["type"] == "extra_forbidden"]
    sentences = []
    if unknown:
        noun = "argument" if len(unknown) == 1 else "arguments"
        sentences.append(
            f"unknown {noun} {', '.join(unknown)} ({tool} takes {', '.join(properties)})"
        )
    sentences += [
        _sentence(problem, properties)
        for problem in problems
        if problem["type"] != "extra_forbidden"
    ]
    return f"Invalid arguments for {tool}: " + "; ".join(sentences)


def _sentence(problem: Mapping[str, Any], properties: Mapping[str, Any]) -> str:
    where = _where(problem)
    kind = problem["type"]
    value = problem.get("input")
    if kind == "missing":
        return f"{where} is required"
    if kind in _EXPECTED:
        return f"{where}: must be {_EXPECTED[kind]}, not {_json_type(value)} (got {_shown(value)})"
    if kind in _RANGE_ERRORS:
        low, high = _bounds(properties.get(where, {}))
        if low is not None and high is not None:
            return f"{where}: must be between {low} and {high} (got {_shown(value)})"
    message = str(problem.get("msg", "is invalid"))
    return f"{where}: {message[:1].lower()}{message[1:]} (got {_shown(value)})"


def _where(problem: Mapping[str, Any]) -> str:
    """``("fields", "body")`` -> ``fields[body]``."""
    location = problem.get("loc", ())
    parts = [str(part) for part in location] if isinstance(location, Iterable) else []
    return (parts[0] + "".join(f"[{part}]" for part in parts[1:])) if parts else "arguments"


def _bounds(prop: Mapping[str, Any]) -> tuple[object, object]:
    """The ``minimum`` and ``maximum`` of a property, looking inside ``anyOf`` (optionals)."""
    choices: Sequence[Mapping[str, Any]] = [prop, *prop.get("anyOf", ())]
    for choice in choices:
        if "minimum" in choice or "maximum" in choice:
            return choice.get("minimum"), choice.get("maximum")
    return None, None


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _shown(value: object) -> str:
    """The refused value as JSON (what the caller sent), cut short."""
    try:
        shown = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        shown = repr(value)
    if len(shown) > _MAX_SHOWN_INPUT:
        shown = shown[: _MAX_SHOWN_INPUT - 3] + "..."
    return shown
