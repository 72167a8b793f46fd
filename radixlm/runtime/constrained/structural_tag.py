"""SGLang's ``structural_tag`` grammar: free text, and after each trigger a tagged JSON call.

    {"structures": [{"begin": "<tool_call>\\n{\\"name\\": \\"f\\", \\"arguments\\": ",
                     "schema": {...}, "end": "}\\n</tool_call>"}, ...],
     "triggers": ["<tool_call>"]}

Text is free until a trigger appears; from there the output must be one structure's
``begin``, a JSON value valid for its ``schema``, and its ``end``; then text is free again.
Every ``begin`` starts with one of the triggers. (SGLang's and OpenAI-compatible servers'
legacy shape, which both xgrammar and llguidance compile; tool calling with
``tool_choice: "auto"`` is built on it, see ``entrypoints/function_call/constraint.py``.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_STRUCTURES = 512


@dataclass(frozen=True)
class Structure:
    begin: str
    schema: dict[str, Any]
    end: str


@dataclass(frozen=True)
class StructuralTag:
    structures: tuple[Structure, ...]
    triggers: tuple[str, ...]


def _strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
        raise ValueError(f"structural_tag {what} must be a list of non-empty strings")
    return value


def parse_structural_tag(spec: str | dict[str, Any],
                         canonical_schema: Callable[[Any], str] = json.dumps) -> StructuralTag:
    """The checked structural tag; ValueError naming what is wrong. Each schema goes through
    ``canonical_schema`` (base.py's check, from ``canonical_spec``)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError("structural_tag must be a JSON object with structures and triggers")
    extra = sorted(set(spec) - {"type", "structures", "triggers"})
    if extra or spec.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"structural_tag takes type, structures and triggers; got "
                         f"{extra or spec.get('type')!r}")
    triggers = _strings(spec.get("triggers"), "triggers")
    raw = spec.get("structures")
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_STRUCTURES:
        raise ValueError(f"structural_tag structures must be a list of 1 to {MAX_STRUCTURES} "
                         "objects")
    structures = []
    for i, s in enumerate(raw):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) \
                or not isinstance(s.get("end"), str) or "schema" not in s:
            raise ValueError(f"structural_tag structures[{i}] must have begin and end strings "
                             "and a schema")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ValueError(f"structural_tag structures[{i}].begin {s['begin']!r} does not "
                             "start with any trigger")
        schema = json.loads(canonical_schema(s["schema"]))
        structures.append(Structure(s["begin"], schema, s["end"]))
    return StructuralTag(tuple(structures), tuple(triggers))


def canonical_structural_tag(spec: str | dict[str, Any],
                             canonical_schema: Callable[[Any], str]) -> str:
    """The compact JSON text of a checked structural tag (the cache key)."""
    tag = parse_structural_tag(spec, canonical_schema)
    return json.dumps({"structures": [{"begin": s.begin, "schema": s.schema, "end": s.end}
                                      for s in tag.structures],
                       "triggers": list(tag.triggers)}, separators=(",", ":"),
                      ensure_ascii=False)
