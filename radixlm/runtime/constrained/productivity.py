"""Which parts of a JSON schema admit a finite instance: a least fixpoint over the schema.

A schema whose required property refers back to itself (``n = {"required": ["c"],
"properties": {"c": {"$ref": "#/$defs/n"}}}``), or two that require each other, has no
finite instance: a grammar built from it forces ``{"c": {"c": ...`` for ever (xgrammar's
jump-forward string then grows until memory runs out). ``check_productive`` refuses such a
schema with a ValueError naming the sub-schema and the ``$ref`` cycle, before any backend
sees it. Every sub-schema an instance can meet is checked, not only the root: an optional property
whose schema has no finite instance would let the model start it and never finish.

The rules, as the backends compile a schema (an untyped schema with ``properties`` or
``required`` is an object, one with ``items`` an array): an object needs every required
property, an array its first ``minItems`` items, ``anyOf``/``oneOf`` one branch, ``allOf``
every branch, ``enum`` one value, ``$ref`` its target; a ``false`` schema has no instance.
"""

from __future__ import annotations

import re
from typing import Any

from radixlm.runtime.constrained.schema_walk import (
    SUBSCHEMA_LISTS,
    SUBSCHEMA_MAPS,
    walk_schema,
)

_GENERATED_ONES = ("items", "additionalProperties")
MAX_SCHEMA_NODES = 10_000  # sub-schemas in one json_schema (each fixpoint pass visits all)


def check_productive(schema: dict[str, Any]) -> None:
    """ValueError naming the first sub-schema that admits no finite instance."""
    nodes = list(walk_schema(schema))
    if len(nodes) > MAX_SCHEMA_NODES:
        raise ValueError(f"json_schema has {len(nodes)} sub-schemas (limit {MAX_SCHEMA_NODES})")
    nodes.reverse()  # children before their parents: most schemas settle in one pass
    ok: set[int] = set()
    changed = True
    while changed:
        changed = False
        for node, _ in nodes:
            if id(node) not in ok and _productive(node, schema, ok):
                ok.add(id(node))
                changed = True
    used = _reachable(schema)  # a $defs entry no $ref names is never compiled
    failed = [(node, where) for node, where in reversed(nodes)
              if id(node) not in ok and id(node) in used]
    if failed:  # name a cause (a required property) rather than the root that refers to it
        why = [(where, _why(node, ok)) for node, where in failed]
        where, reason = next((w for w in why if w[1].startswith("requires")), why[0])
        raise ValueError(f"json_schema admits no finite instance: the schema at {where} "
                         f"{reason}")


def _productive(node: dict[str, Any], root: dict[str, Any], ok: set[int]) -> bool:
    def sub(s: Any) -> bool:
        if isinstance(s, bool):
            return s
        return not isinstance(s, dict) or id(s) in ok

    ref = node.get("$ref")
    if isinstance(ref, str):
        target = resolve_ref(root, ref)
        if target is not None and not sub(target):
            return False
    if isinstance(node.get("enum"), list) and not node["enum"]:
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and not any(sub(s) for s in node[key]):
            return False
    if isinstance(node.get("allOf"), list) and not all(sub(s) for s in node["allOf"]):
        return False
    if "const" in node or "enum" in node:
        return True
    types = _types(node)
    return ("object" in types and _object_ok(node, sub)) or (
        "array" in types and _array_ok(node, sub)) or bool(types - {"object", "array"})


def _types(node: dict[str, Any]) -> set[str]:
    declared = node.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {t for t in declared if isinstance(t, str)}
    if any(k in node for k in ("properties", "required", "additionalProperties")):
        return {"object"}
    if any(k in node for k in ("items", "prefixItems", "minItems")):
        return {"array"}
    return {"any"}


def _object_ok(node: dict[str, Any], sub: Any) -> bool:
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    extra = node.get("additionalProperties", True)
    for name in node.get("required") or []:
        if isinstance(name, str) and not sub(props[name] if name in props else extra):
            return False
    return True


def _array_ok(node: dict[str, Any], sub: Any) -> bool:
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    items = node.get("items", True)
    min_items = node.get("minItems", 0)
    n = min_items if isinstance(min_items, int) and not isinstance(min_items, bool) else 0
    needed = prefix[:n] + ([items] if n > len(prefix) else [])
    return all(sub(s) for s in needed)


def _reachable(root: dict[str, Any]) -> set[int]:
    """ids of the sub-schemas an instance's values are generated from: from the root,
    through properties, items, the combinators and each $ref's target (not through
    $defs, not, if/then/else, contains or propertyNames)."""
    seen: set[int] = set()
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        for key in SUBSCHEMA_MAPS:
            if key not in ("$defs", "definitions") and isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        stack.extend(node[key] for key in _GENERATED_ONES if isinstance(node.get(key), dict))
        if isinstance(node.get("$ref"), str):
            stack.append(resolve_ref(root, node["$ref"]))
    return seen


def resolve_ref(root: dict[str, Any], ref: str) -> Any:
    """The sub-schema a local ``$ref`` (``#`` or ``#/a/b``) names; None if it names none."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _why(node: dict[str, Any], ok: set[int]) -> str:
    """A short reason: the required property or $ref that has no finite instance."""
    if isinstance(node.get("$ref"), str):
        return f"refers to {node['$ref']}, which has none (a $ref cycle)"
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for name in node.get("required") or []:
        if not isinstance(name, str):
            continue
        s = props.get(name, node.get("additionalProperties", True))
        if s is False:
            return f"requires property {name!r}, which additionalProperties forbids"
        if isinstance(s, dict) and id(s) not in ok:
            via = f" (via {s['$ref']})" if isinstance(s.get("$ref"), str) else ""
            return f"requires property {name!r}, which has none{via}: a required $ref cycle"
    return "has no alternative with a finite instance"


# --- EBNF (xgrammar's normalised form) -----------------------------------------------------
_EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]\*?|\(=|[()|]'
                         r"|([A-Za-z_][A-Za-z0-9_.\-]*)(?:\{(\d+), ?-?\d+\}|([*+?]))?|\s+")


def check_ebnf_productive(normalised: str) -> None:
    """ValueError naming a rule reachable from ``root`` that derives no finite string
    (``r ::= "a" r``): xgrammar's jump-forward string would grow without end in it.
    ``normalised`` is ``str(xgrammar.Grammar)``: one ``name ::= ((a b) | (c))`` a line,
    nested groups already split into rules of their own."""
    rules: dict[str, list[list[tuple[str, bool]]]] = {}
    for line in normalised.splitlines():
        name, sep, body = line.partition(" ::= ")
        if sep:
            rules[name.strip()] = _alternatives(body)
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alts in rules.items():
            if name not in productive and any(
                    all(optional or ref not in rules or ref in productive
                        for ref, optional in alt) for alt in alts):
                productive.add(name)
                changed = True
    stack, seen = ["root"], set()
    while stack:
        name = stack.pop()
        if name in seen or name not in rules:
            continue
        seen.add(name)
        if name not in productive:
            raise ValueError(f"the grammar's rule {name!r} derives no finite string (each "
                             "of its alternatives refers to a rule that never ends)")
        stack.extend(ref for alt in rules[name] for ref, _ in alt)


def _alternatives(body: str) -> list[list[tuple[str, bool]]]:
    """[[(rule name, optional), ...] per alternative] of a normalised rule body; literals
    and character classes always end, so only references are kept. A lookahead ``(=...)``
    after the body is skipped."""
    alts: list[list[tuple[str, bool]]] = [[]]
    depth = 0
    for m in _EBNF_TOKEN.finditer(body):
        tok = m.group(0)
        if tok == "(=" and depth == 0:
            break
        if tok in ("(", "(="):
            depth += 1
        elif tok == ")":
            depth -= 1
        elif tok == "|" and depth == 1:
            alts.append([])
        elif m.group(1):
            optional = ((m.group(2) is not None and int(m.group(2)) == 0)
                        or m.group(3) in ("*", "?"))
            alts[-1].append((m.group(1), optional))
    return alts
