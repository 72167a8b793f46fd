"""The one small interface every grammar backend implements, and what they share.

    backend = create_grammar_backend("xgrammar", tokenizer, vocab_size)   # __init__.py
    grammar = backend.compile("json_schema", canonical_spec)  # ValueError: a 400
    matcher = grammar.new_matcher()                           # one per request
    matcher.fill_bitmask(bitmask, row)     # before sampling: packed int32 row
    matcher.accept_token(token_id)         # after sampling; False if not allowed
    matcher.is_terminated()                # EOS accepted, or nothing but EOS is left
    matcher.forced_string()                # text every continuation starts with
    matcher.rollback(n)                    # undo the last n accepted tokens

Masks are int32 bitmasks, one row per request: bit j of word i allows token 32 * i + j
(the layout of xgrammar, llguidance and outlines-core). ``apply_token_bitmask_`` masks a
batch of logits in place with torch ops, the same code on CPU and CUDA.

Grammar kinds: ``regex``, ``json_schema`` (text or object; ``{"type": "object"}`` with no
properties is free-form JSON, what OpenAI's ``json_object`` means) and ``ebnf`` (a GBNF
grammar, SGLang's ``ebnf`` sampling parameter) and ``structural_tag`` (free text with
JSON-schema calls after triggers, structural_tag.py; xgrammar and llguidance). A kind, or a
JSON schema keyword, that a backend cannot enforce is a ValueError naming the backend, the
keyword and where it is.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Sequence
from typing import Any

import torch

from radixlm.runtime.constrained.productivity import check_productive
from radixlm.runtime.constrained.schema_walk import (
    SUBSCHEMA_LISTS,
    SUBSCHEMA_MAPS,
    walk_schema,
)
from radixlm.runtime.constrained.structural_tag import (
    canonical_structural_tag,
    parse_structural_tag,
)

GRAMMAR_KINDS = ("regex", "json_schema", "ebnf", "structural_tag")
MAX_SCHEMA_DEPTH = 64
MAX_SPEC_CHARS = 1 << 20

# Keywords that carry no constraint (annotations and bookkeeping): every backend accepts them.
ANNOTATION_KEYWORDS = frozenset({
    "$schema", "$id", "$comment", "$anchor", "title", "description", "default", "examples",
    "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding",
})
# --- bitmasks --------------------------------------------------------------------------------
def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A [batch_size, ceil(vocab_size / 32)] int32 bitmask with every token allowed."""
    return torch.full((batch_size, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits[b, t] = -inf wherever bit t of bitmask row b is 0. In place, vectorised;
    ids past the mask (padding of the model's vocabulary) are never allowed."""
    assert logits.dim() == 2 and bitmask.dim() == 2, (logits.shape, bitmask.shape)
    assert logits.shape[0] == bitmask.shape[0], (logits.shape, bitmask.shape)
    batch, vocab = logits.shape
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(batch, -1)  # [B, W * 32]
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        pad = torch.zeros(batch, vocab - allowed.shape[1], dtype=torch.bool, device=logits.device)
        allowed = torch.cat([allowed, pad], dim=1)
    logits.masked_fill_(~allowed, float("-inf"))


def allowed_ids(row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a bitmask row allows (tests, checks)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((row.view(-1, 1) >> shifts) & 1).bool().flatten()[:vocab_size]
    return bits.nonzero().flatten().tolist()


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of special tokens (never text a grammar may produce)."""
    special: set[int] = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return special | {i for i, tok in added.items() if getattr(tok, "special", False)}


# --- the interface ------------------------------------------------------------------------------
class Matcher(abc.ABC):
    """Where one request is in its grammar."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of an int32 bitmask [B, W]."""

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (and no change) if the grammar forbids it."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """Whether the request should finish: EOS accepted, or EOS is all that is left."""

    @abc.abstractmethod
    def forced_string(self) -> str:
        """The text every continuation of the grammar starts with (jump-forward)."""

    def is_accepting(self) -> bool:
        """Whether the text so far is a whole match (the request may end here)."""
        return self.is_terminated()


class Grammar(abc.ABC):
    """One compiled grammar over one tokenizer, shared by the requests that use it."""

    kind: str

    @abc.abstractmethod
    def new_matcher(self) -> Matcher: ...


class GrammarBackend(abc.ABC):
    """Compiles grammars for one tokenizer. ``compile`` may run on a worker thread."""

    name = ""
    kinds: frozenset[str] = frozenset(GRAMMAR_KINDS)
    # JSON schema keywords the backend enforces (beyond ANNOTATION_KEYWORDS); any other
    # keyword is refused, since a backend that ignores one would emit output breaking it
    schema_keywords: frozenset[str] = frozenset()
    # compiled before a server reports ready (GrammarCompiler.warm_up): OpenAI's
    # json_object, the grammar most clients ask for first
    warm_specs: tuple[tuple[str, Any], ...] = (("json_schema", {"type": "object"}),)

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = ()
                 ) -> None:
        """``stop_token_ids``: every id that ends a request (the model's EOS ids); the
        grammar allows them only where it may end, and never as text."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = tokenizer.eos_token_id
        if self.eos_token_id is None:
            raise ValueError("constrained decoding needs a tokenizer with an eos_token_id")
        self.stop_token_ids = sorted({self.eos_token_id, *stop_token_ids})

    def compile(self, kind: str, spec: str) -> Grammar:
        """Compile a canonical spec (``canonical_spec``); ValueError for a bad grammar."""
        if kind not in self.kinds:
            raise ValueError(f"the {self.name} grammar backend cannot enforce {kind!r} "
                             f"grammars (it supports {', '.join(sorted(self.kinds))}); "
                             "choose another with --grammar-backend")
        if kind == "json_schema":
            schema = json.loads(spec)
            self.check_schema(schema)
            check_productive(schema)
        if kind == "structural_tag":
            for s in parse_structural_tag(spec).structures:
                self.check_schema(s.schema)
                check_productive(s.schema)
        return self._compile(kind, spec)

    @abc.abstractmethod
    def _compile(self, kind: str, spec: str) -> Grammar: ...

    def export(self, grammar: Grammar) -> Any:
        """``grammar`` as plain data (msgpack: bytes, numbers, lists) that ``restore``
        rebuilds without compiling, or None (the compile worker's caller then compiles
        the spec again). For a backend whose compile is slow (outlines)."""
        return None

    def restore(self, kind: str, spec: str, payload: Any) -> Grammar:
        raise NotImplementedError(f"the {self.name} backend exports nothing")

    def check_schema(self, schema: Any) -> None:
        """ValueError naming the first keyword (and where) this backend cannot enforce."""
        allowed = self.schema_keywords | ANNOTATION_KEYWORDS
        for node, where in walk_schema(schema):
            bad = sorted(k for k in node if k not in allowed)
            if bad:
                raise ValueError(f"unsupported json_schema: the {self.name} grammar backend "
                                 f"cannot enforce keyword {bad[0]!r} at {where}")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object that declares ``properties`` and says
    nothing of ``additionalProperties`` allows only those properties: what xgrammar's
    strict mode and outlines-core do, and OpenAI's structured outputs require. Output
    valid for the copy is valid for the original; free-form objects stay free."""
    schema = json.loads(json.dumps(schema))
    for node, _ in walk_schema(schema):
        if ("properties" in node and "additionalProperties" not in node
                and "patternProperties" not in node):
            node["additionalProperties"] = False
    return schema


# --- specs ------------------------------------------------------------------------------
def canonical_spec(kind: str, spec: Any) -> str:
    """Check the cheap parts of a spec and return its canonical text (the cache key)."""
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {kind!r}")
    if kind == "json_schema":
        return canonical_schema(spec)
    if kind == "structural_tag":
        if isinstance(spec, str) and len(spec) > MAX_SPEC_CHARS:
            raise ValueError(f"{kind} has {len(spec)} characters (limit {MAX_SPEC_CHARS})")
        return canonical_structural_tag(spec, canonical_schema)
    if not isinstance(spec, str):
        raise ValueError(f"{kind} must be a string, got {type(spec).__name__}")
    if not spec.strip():
        raise ValueError(f"{kind} is empty")
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"{kind} has {len(spec)} characters (limit {MAX_SPEC_CHARS})")
    return spec


def _depth(obj: Any, limit: int) -> int:
    """Container nesting depth of a JSON value, iteratively; stops past ``limit``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, d + 1) for child in children)
    return deepest


def canonical_schema(spec: str | dict[str, Any] | bool) -> str:
    """Parse and check a JSON schema; return it as compact JSON text (key order kept)."""
    if isinstance(spec, str):
        try:
            obj = json.loads(spec)
        except RecursionError:
            raise ValueError(
                f"json_schema is nested too deeply (limit {MAX_SCHEMA_DEPTH} levels)"
            ) from None
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
    else:
        obj = spec
    if obj is True:
        obj = {}
    if obj is False:
        raise ValueError("json_schema is `false`: no output can satisfy it")
    if not isinstance(obj, dict):
        raise ValueError(f"json_schema must be an object or a boolean, got {type(obj).__name__}")
    if _depth(obj, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"json_schema is nested too deeply (limit {MAX_SCHEMA_DEPTH} levels)")
    _check_structure(obj)
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"json_schema cannot be serialised as JSON: {e}") from None


def _check_structure(schema: dict[str, Any]) -> None:
    """Shapes every backend needs: maps where maps go, lists where lists go."""
    for node, where in walk_schema(schema):
        for key in SUBSCHEMA_MAPS:
            if key in node and not isinstance(node[key], dict):
                raise ValueError(f"invalid json_schema: {key!r} at {where} must be an object")
        for key in (*SUBSCHEMA_LISTS, "required", "enum"):
            if key in node and not isinstance(node[key], list):
                raise ValueError(f"invalid json_schema: {key!r} at {where} must be an array")
        if "type" in node and not isinstance(node["type"], (str, list)):
            raise ValueError(f"invalid json_schema: 'type' at {where} must be a string or an "
                             "array of strings")
