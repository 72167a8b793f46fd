"""walk_schema: every sub-schema of a JSON schema with its location; used by the keyword
checks (base.py) and the productivity check (productivity.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties",
                  "dependentSchemas")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMA_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def walk_schema(schema: Any, path: str = "#") -> Iterator[tuple[dict[str, Any], str]]:
    """Every sub-schema object of ``schema`` with its JSON-pointer-like location."""
    stack: list[tuple[Any, str]] = [(schema, path)]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node, where
        for key in SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{where}/{key}/{name}") for name, sub in node[key].items())
        for key in SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{where}/{key}/{i}") for i, sub in enumerate(node[key]))
        for key in SUBSCHEMA_ONES:
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{where}/{key}"))
