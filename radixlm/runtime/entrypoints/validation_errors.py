"""A 400's message from a pydantic ValidationError: the field's path, the value's problem
and the limit, in one line a client can act on."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from radixlm.runtime.entrypoints.refused_fields import refusal


def describe(err: ValidationError) -> tuple[str, str | None]:
    """A 400's message for a validation error: the field's path, the value's problem and
    the limit (pydantic's message carries the bound). Where a field takes one of several
    forms, the form that got furthest into the value explains it best; where none got in,
    one line lists the forms."""
    found = [(_path(e["loc"]), e) for e in err.errors(include_url=False)]
    deepest = max(len(p) for p, _ in found)
    by_path: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for path, e in found:
        if len(path) == deepest:
            by_path.setdefault(path, []).append(e)
    parts = [_problem(path, errs) for path, errs in list(by_path.items())[:3]]
    first = ".".join(str(x) for x in found[0][0]) if deepest else None
    return "; ".join(parts), first


_KINDS = {"dict_type": "an object", "model_type": "an object", "model_attributes_type":
          "an object", "list_type": "an array", "string_type": "a string", "bool_type":
          "a boolean", "int_type": "an integer", "float_type": "a number"}


def _problem(path: tuple[Any, ...], errs: list[dict[str, Any]]) -> str:
    loc = ".".join(str(x) for x in path)
    e = errs[0]
    if e["type"] == "json_invalid":
        why = e["ctx"].get("error", "")
        return (f"the request body is nested too deeply to parse ({why})"
                if "recursion limit" in why else f"the request body is not valid JSON ({why})")
    kinds = list(dict.fromkeys(_KINDS.get(x["type"], "") for x in errs))
    if len(errs) > 1 and all(kinds):
        forms = ", ".join(kinds[:-1]) + f" or {kinds[-1]}" if len(kinds) > 1 else kinds[0]
        problem = f"Input should be {forms}"
    else:
        problem = e["msg"]
    if e["type"] == "extra_forbidden" and path and refusal(str(path[-1])):
        return f"{loc} is not supported: {refusal(str(path[-1]))}"
    if "input" in e and e["type"] not in ("missing", "extra_forbidden"):
        problem += f", got {_short(e['input'])}"
    return f"{loc}: {problem}" if loc else problem


def _path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """The field path without pydantic's names of union members (``str``, ``list[int]``)."""
    return tuple(p for p in loc if not (isinstance(p, str) and (
        "[" in p or p in _TYPE_TAGS or p in _MODEL_NAMES)))


# pydantic names union members and nested models in an error's location; a path leaves them out
_MODEL_NAMES = {"SamplingParamsIn", "StreamOptions", "ContentPart", "ChatMessage",
                "JsonSchemaFormat", "ResponseFormat", "NamedToolChoice", "FunctionName"}
_TYPE_TAGS = {"str", "int", "bool", "float", "constrained-int", "constrained-float", "dict",
              "function-after", "literal"}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
