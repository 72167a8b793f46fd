"""The output of ``tool_choice: "required"`` or a named function, as SGLang and vLLM
constrain it whatever the model's own format::

    [{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]

``forced_schema`` is the JSON schema the whole output is held to (one item per call, each
one of the allowed tools with arguments valid for its parameters); ``JsonArrayFormat``
reads it back.
"""

from __future__ import annotations

import json
from typing import Any

from radixlm.runtime.entrypoints.openai.function_call.core import ToolCallFormat
from radixlm.runtime.entrypoints.openai.function_call.mistral import CallArray
from radixlm.runtime.entrypoints.openai.function_call.scan import TextMemo

_REF_KEYS = ("$defs", "definitions")


class JsonArrayFormat(ToolCallFormat):
    name = "json_array"
    triggers = ("[",)

    def region(self, text: str, start: int, memo: TextMemo) -> CallArray:
        return CallArray(start, memo)


def _rewrite_refs(node: Any, prefix: str) -> Any:
    """A copy of ``node`` whose local $refs point into the hoisted ``$defs``."""
    if isinstance(node, list):
        return [_rewrite_refs(x, prefix) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            rest = v[1:]
            for key in _REF_KEYS:
                if rest.startswith(f"/{key}/"):
                    rest = "__" + rest[len(key) + 2:]
                    break
            out[k] = f"#/$defs/{prefix}{rest}"  # "#" itself: the parameters' own entry
        else:
            out[k] = _rewrite_refs(v, prefix)
    return out


def _item(name: str, params: dict[str, Any], index: int, defs: dict[str, Any]
          ) -> dict[str, Any]:
    """One call's schema; parameters with $refs move to the top-level ``$defs``."""
    if '"$ref"' in json.dumps(params):
        prefix = f"tool{index}"
        params = _rewrite_refs(params, prefix)
        for key in _REF_KEYS:
            for sub, schema in (params.pop(key, None) or {}).items():
                defs[f"{prefix}__{sub}"] = schema
        defs[prefix] = params
        params = {"$ref": f"#/$defs/{prefix}"}
    return {"type": "object", "properties": {"name": {"enum": [name]}, "parameters": params},
            "required": ["name", "parameters"]}


def forced_schema(tools: list[tuple[str, dict[str, Any]]], parallel: bool) -> dict[str, Any]:
    """The whole output's schema for calls of ``tools`` ((name, parameters) pairs)."""
    defs: dict[str, Any] = {}
    items = [_item(name, params, i, defs) for i, (name, params) in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
