"""Python functions as OpenAI function tools (as the Agents SDK's ``function_tool`` does).

``function_tool(fn)`` reads the schema from the signature's type hints and the description
from the docstring (its first part; ``Args:`` lines describe the parameters)::

    def get_weather(city: Literal["Paris", "Oslo"], days: int = 1) -> str:
        '''The forecast.

        Args:
            city: where
        '''
    function_tool(get_weather) == {"type": "function", "function": {
        "name": "get_weather", "description": "The forecast.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                       "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"],
                                               "description": "where"},
                                      "days": {"type": "integer", "default": 1}}}}}

Types, kept small and exact: str, int, float, bool, ``Literal[...]`` of those,
``list[T]`` and ``Optional[T]`` (``T | None``); anything else is a TypeError that names the
parameter.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Raises|Yields)\s*:\s*$")
_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SUPPORTED = "str, int, float, bool, Literal[...], list[...] and Optional[...]"


def function_tool(fn: Callable[..., Any], name: str | None = None,
                  description: str | None = None) -> dict[str, Any]:
    """The OpenAI tool dict of a Python function (see the module docstring)."""
    if not callable(fn):
        raise TypeError(f"a tool is an OpenAI tool dict or a function, got {fn!r}")
    tool_name = name or getattr(fn, "__name__", "")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # noqa: BLE001 - an unresolvable annotation is the caller's
        raise TypeError(f"tool {tool_name!r}: cannot read its type hints: {e}") from e
    summary, arg_docs = parse_docstring(inspect.getdoc(fn) or "")
    props: dict[str, Any] = {}
    required: list[str] = []
    for pname, p in inspect.signature(fn).parameters.items():
        where = f"tool {tool_name!r} parameter {pname!r}"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"{where}: *args and **kwargs cannot be described to a model")
        if pname not in hints:
            raise TypeError(f"{where} needs a type annotation ({_SUPPORTED})")
        schema = json_schema_of(hints[pname], where)
        if pname in arg_docs:
            schema["description"] = arg_docs[pname]
        if p.default is p.empty:
            required.append(pname)
        elif _is_json(p.default):
            schema["default"] = p.default
        props[pname] = schema
    params = {"type": "object", "properties": props, "required": required,
              "additionalProperties": False}
    out: dict[str, Any] = {"name": tool_name}
    if description or summary:
        out["description"] = description or summary
    out["parameters"] = params
    return {"type": "function", "function": out}


def json_schema_of(tp: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one annotation; TypeError naming ``where`` for other types."""
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if not args or not all(type(a) in _SCALARS for a in args):
            raise TypeError(f"{where}: Literal values must be str, int, float or bool")
        kinds = {_SCALARS[type(a)] for a in args}
        out: dict[str, Any] = {"type": kinds.pop()} if len(kinds) == 1 else {}
        return {**out, "enum": list(args)}
    if tp is list or origin is list:
        return {"type": "array", **({"items": json_schema_of(args[0], where)} if args else {})}
    if origin is Union or isinstance(tp, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return {"anyOf": [json_schema_of(rest[0], where), {"type": "null"}]}
    raise TypeError(f"{where}: type {tp!r} is not supported; tools take {_SUPPORTED}")


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(summary, {parameter: description}) of a Google-style docstring."""
    summary: list[str] = []
    args: dict[str, str] = {}
    section, current, depth = None, None, None
    for line in doc.splitlines():
        heading = _SECTION.match(line)
        if heading:
            section, current, depth = heading.group(1), None, None
            continue
        if section is None:
            summary.append(line.strip())
            continue
        if section not in ("Args", "Arguments", "Parameters") or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        m = _ARG_LINE.match(line)
        if m and (depth is None or indent <= depth):  # a new "name: text" entry
            depth, current = indent, m.group(1).lstrip("*")
            args[current] = m.group(2).strip()
        elif current is not None:  # a continuation line
            args[current] = f"{args[current]} {line.strip()}".strip()
    return " ".join(" ".join(summary).split()), args


def _is_json(value: Any) -> bool:
    if value is None or type(value) in _SCALARS:
        return True
    if isinstance(value, list):
        return all(_is_json(v) for v in value)
    return False
