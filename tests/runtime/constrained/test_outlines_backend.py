"""Constrained decoding: vocabulary bytes, automata, masks, jump-forward, bad inputs.

Oracles: Python `re.fullmatch` for regexes, `jsonschema` for JSON schemas, and interegular's
character FSM (independent of outlines-core) for the exact allowed-token sets.
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections import deque
from pathlib import Path
from typing import Any

import interegular
import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm.frontend_dsl.dtype_regex import (
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    dtype_to_regex,
)
from radixlm.runtime.constrained import (
    GrammarCompiler,
    allocate_token_bitmask,
    apply_token_bitmask_,
)
from radixlm.runtime.constrained.grammar import GrammarLimits
from radixlm.runtime.constrained.matcher import CompiledGrammar, GrammarMatcher
from radixlm.runtime.constrained.outlines_backend import OutlinesBackend
from radixlm.runtime.constrained.vocabulary import build_vocabulary, tokenizer_info

CORPUS = Path(__file__).resolve().parents[3] / "radixlm" / "data" / "tiny_corpus.txt"


def _trained_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS.read_text()], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>"
    )


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    try:
        from transformers import AutoTokenizer

        from radixlm.tiny_model import default_tiny_model_path

        return AutoTokenizer.from_pretrained(default_tiny_model_path())
    except ImportError:  # the tiny model module is not there: a tokenizer trained the same way
        return _trained_tokenizer()


def outlines(tokenizer: Any, **limits: int) -> GrammarCompiler:
    backend = OutlinesBackend(tokenizer, len(tokenizer), limits=GrammarLimits(**limits))
    return GrammarCompiler(backend)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> Any:
    c = outlines(tokenizer)
    yield c
    c.shutdown()


def accept_all(m: GrammarMatcher, ids: list[int]) -> bool:
    """Accept ``ids`` as a unit: all of them, or none (rolled back)."""
    for n, t in enumerate(ids):
        if not m.accept_token(t):
            m.rollback(n)
            return False
    return True


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# -- helpers: walks through the automaton --------------------------------------------------
_DIST: dict[int, dict[int, int]] = {}


def _distance_to_accept(g: CompiledGrammar) -> dict[int, int]:
    """Byte-DFA state -> fewest bytes to an accepting state (BFS on reversed edges)."""
    if id(g) not in _DIST:
        rev: dict[int, list[int]] = {}
        dist: dict[int, int] = {}
        for s, edges in g.byte_transitions.items():
            if s in g.byte_accepting:
                dist[s] = 0
            for b, t in edges.items():
                if b < 256:
                    rev.setdefault(t, []).append(s)
        queue = deque(dist)
        while queue:
            s = queue.popleft()
            for p in rev.get(s, []):
                if p not in dist:
                    dist[p] = dist[s] + 1
                    queue.append(p)
        _DIST[id(g)] = dist
    return _DIST[id(g)]


def _byte_state_after(m: GrammarMatcher, token: int) -> int:
    s = m.byte_state
    for b in m.grammar.info.token_bytes[token]:
        s = m.grammar.byte_transitions[s][b]
    return s


def random_walk(
    g: CompiledGrammar, tokenizer: Any, rng: random.Random, jump: bool = False, soft_cap: int = 40
) -> tuple[str, int]:
    """Sample uniformly among allowed tokens (steering to the end past soft_cap); returns
    (text, number of characters inserted by jump-forward)."""
    m = g.new_matcher()
    eos = g.info.eos_token_id
    ids: list[int] = []
    forced_chars = 0
    dist = _distance_to_accept(g)
    while not m.is_terminated() and len(ids) < 10 * soft_cap:
        if jump:
            forced = m.forced_string()
            if forced and accept_all(m, _encode(tokenizer, forced)):
                ids += _encode(tokenizer, forced)
                forced_chars += len(forced)
                continue
        allowed = m.allowed_token_ids()
        assert allowed, "a live state with nothing allowed"
        if eos in allowed and (rng.random() < 0.25 or len(ids) >= soft_cap):
            break
        choices = [t for t in allowed if t != eos]
        if len(ids) >= soft_cap:
            token = min(choices, key=lambda t: (dist[_byte_state_after(m, t)], rng.random()))
        else:
            token = rng.choice(choices)
        m.accept_token(token)
        ids.append(token)
    assert m.is_accepting(), "walk ended outside an accepting state"
    text = b"".join(g.info.token_bytes[t] for t in ids).decode("utf-8")
    return text, forced_chars


REGEXES = [
    (r"[0-9]+(\.[0-9]+)?", None),
    (r"(cat|category|dog)s?", None),
    (r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", None),
    # \d in Rust follows a newer Unicode than Python's re (Kawi digits...): an oracle in ASCII
    (r"\d{3}-\d{4}", r"[^-]{3}-[^-]{4}"),
    (r"((25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}(25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)", None),
    (r"[A-Z][a-z]* [A-Z][a-z]*", None),
    (r"\"[^\"\\]*\"", None),
    (r"(a+)+b", None),
    (r"héllo( wörld)?|日本語", None),
    (REGEX_INT, None),
    (REGEX_FLOAT, None),
    (REGEX_BOOL, None),
    (REGEX_STR, r"\"[^\"]*\""),  # Rust's \w also takes combining marks; Python's does not
]

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "active": {"type": "boolean"}},
                "required": ["id", "active"],
            },
            "note": {"type": "null"},
        },
        "required": ["user"],
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"enum": ["red", "green", "blue", 7, None]},
    {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"],
    },
    {
        "type": "object",
        "properties": {
            "a": {"type": "string"},
            "b": {"type": "integer"},
            "c": {"type": "boolean"},
        },
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}},
        "required": ["code"],
    },
    {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        "required": ["v"],
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"const": "key"}, "n": {"type": "integer"}},
            "required": ["k", "n"],
        },
        "maxItems": 3,
    },
    {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 5}},
        "required": ["s"],
    },
]

WALK_SETTINGS = settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.mark.parametrize(("regex", "oracle"), REGEXES)
@WALK_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), jump=st.booleans())
def test_regex_random_walks_match(
    compiler: Any, tokenizer: Any, regex: str, oracle: str | None, seed: int, jump: bool
) -> None:
    g = compiler.compile("regex", regex)
    text, _ = random_walk(g, tokenizer, random.Random(seed), jump=jump)
    assert re.fullmatch(oracle or regex, text), (regex, text)


@pytest.mark.parametrize("schema", SCHEMAS, ids=[str(i) for i in range(len(SCHEMAS))])
@WALK_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), jump=st.booleans())
def test_json_schema_random_walks_validate(
    compiler: Any, tokenizer: Any, schema: dict[str, Any], seed: int, jump: bool
) -> None:
    g = compiler.compile("json_schema", schema)
    text, _ = random_walk(g, tokenizer, random.Random(seed), jump=jump)
    jsonschema.validate(json.loads(text), schema)


# -- vocabulary ----------------------------------------------------------------------------
def test_vocabulary_bytes(tokenizer: Any) -> None:
    info = tokenizer_info(tokenizer)
    assert tokenizer_info(tokenizer) is info  # cached per tokenizer
    assert build_vocabulary(tokenizer) is info.vocabulary
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    spaced = next(i for i, p in enumerate(pieces) if p.startswith("Ġ") and len(p) > 2)
    assert info.token_bytes[spaced] == b" " + pieces[spaced][1:].encode()
    for special in tokenizer.all_special_ids:
        assert info.token_bytes[special] is None
    # byte-level pieces of multi-byte characters keep their (partial) bytes
    for text in ["héllo wörld", "日本語 ok", '{"a": [1, 2.5]}\n\tend']:
        ids = _encode(tokenizer, text)
        assert b"".join(info.token_bytes[t] for t in ids) == text.encode()
    partial = [b for b in info.token_bytes if b is not None and len(b) == 1 and b[0] >= 0x80]
    assert len(partial) >= 64  # lone UTF-8 lead/continuation bytes are tokens too


# -- masks ---------------------------------------------------------------------------------
MASK_REGEXES = [r"[0-9]+(\.[0-9]+)?", r"(cat|category|dog)s?", r"[a-c]{2,4}x?", r"(true|null)"]


def _live_oracle(regex: str) -> Any:
    """text -> can it be extended to a full match? (interegular's FSM, not outlines-core)."""
    fsm = interegular.parse_pattern(regex).to_fsm()
    live: dict[Any, bool] = {}

    def check(text: str) -> bool:
        state = fsm.initial
        for ch in text:
            state = fsm.map.get(state, {}).get(fsm.alphabet[ch])
            if state is None:
                return False
        if state not in live:
            live[state] = fsm.islive(state)
        return live[state]

    return check, fsm


@pytest.mark.parametrize("regex", MASK_REGEXES)
def test_mask_is_exactly_the_live_continuations(compiler: Any, regex: str) -> None:
    g = compiler.compile("regex", regex)
    info = g.info
    check, fsm = _live_oracle(regex)
    rng = random.Random(0)
    m = g.new_matcher()
    bitmask = allocate_token_bitmask(2, info.vocab_size)
    prefix = ""
    for _ in range(6):
        m.fill_bitmask(bitmask, 1)
        allowed = set(m.allowed_token_ids())
        bits = ((bitmask[1].unsqueeze(-1) >> torch.arange(32)) & 1).flatten()[: info.vocab_size]
        assert set(bits.nonzero().flatten().tolist()) == allowed
        assert bitmask[0].eq(-1).all()  # the other row is untouched
        for t, data in enumerate(info.token_bytes):
            if data is None or t == info.eos_token_id:
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:  # a partial character never continues an ASCII regex
                assert t not in allowed, (regex, prefix, data)
                continue
            assert (t in allowed) == check(prefix + text), (regex, prefix, text)
        accepting = fsm.accepts(prefix)
        assert (info.eos_token_id in allowed) == accepting == m.is_accepting()
        choices = sorted(allowed - {info.eos_token_id})
        if not choices:
            assert m.is_terminated()
            break
        token = rng.choice(choices)
        m.accept_token(token)
        prefix += info.token_bytes[token].decode()


def test_apply_token_bitmask(compiler: Any) -> None:
    g = compiler.compile("regex", r"(yes|no)")
    vocab = g.info.vocab_size
    bitmask = allocate_token_bitmask(3, vocab + 40)  # wider than the tokenizer: padded vocab
    g.new_matcher().fill_bitmask(bitmask, 1)
    logits = torch.randn(3, vocab + 40)
    ref = logits.clone()
    apply_token_bitmask_(logits, bitmask)
    allowed = g.new_matcher().allowed_token_ids()
    finite = logits[1].isfinite().nonzero().flatten().tolist()
    assert finite == allowed and len(allowed) >= 2
    assert torch.equal(logits[1, allowed], ref[1, allowed])
    assert torch.equal(logits[0], ref[0]) and torch.equal(logits[2], ref[2])  # unconstrained


def test_accept_rollback_copy_and_termination(compiler: Any, tokenizer: Any) -> None:
    g = compiler.compile("regex", r"abc(de)?")
    m = g.new_matcher()
    assert not m.accept_token(_encode(tokenizer, "z")[0])  # refused: nothing changes
    for t in _encode(tokenizer, "abc"):
        m.accept_token(t)
    assert m.is_accepting() and not m.is_terminated()
    fork = m.copy()
    for t in _encode(tokenizer, "de"):
        fork.accept_token(t)
    assert fork.is_terminated() and m.is_accepting() and not m.is_terminated()
    fork.rollback(len(_encode(tokenizer, "de")))
    assert fork.state == m.state and fork.byte_state == m.byte_state
    m.accept_token(g.info.eos_token_id)
    assert m.is_terminated() and m.allowed_token_ids() == [g.info.eos_token_id]


# -- jump-forward --------------------------------------------------------------------------
LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_identifier": {"type": "integer"},
        "preferred_contact_channel": {"enum": ["email", "telephone"]},
        "subscription_is_active": {"type": "boolean"},
    },
    "required": ["customer_identifier", "preferred_contact_channel", "subscription_is_active"],
}


def test_forced_string_after_open_quote(compiler: Any, tokenizer: Any) -> None:
    g = compiler.compile("json_schema", LONG_KEYS)
    m = g.new_matcher()
    assert m.forced_string() == "{"
    assert accept_all(m, _encode(tokenizer, "{"))
    for t in _encode(tokenizer, '"'):
        m.accept_token(t)
    assert m.forced_string() == 'customer_identifier"'
    assert not accept_all(m, _encode(tokenizer, "xyz"))  # rejected: nothing changes
    assert m.forced_string() == 'customer_identifier"'


@WALK_SETTINGS
@given(seed=st.integers(0, 2**32 - 1))
def test_jump_forward_covers_fixed_keys(compiler: Any, tokenizer: Any, seed: int) -> None:
    g = compiler.compile("json_schema", LONG_KEYS)
    text, forced_chars = random_walk(g, tokenizer, random.Random(seed), jump=True, soft_cap=8)
    jsonschema.validate(json.loads(text), LONG_KEYS)
    assert forced_chars / len(text) > 0.5, (text, forced_chars)


# -- bad inputs, limits, cache -------------------------------------------------------------
BAD_REGEXES = [
    (r"a(?=b)", "lookahead"),
    (r"(?<=a)b", "lookbehind"),
    (r"(a)\1", "backreference"),
    (r"\bword\b", "word boundary"),
    (r"a^b", "anchor"),
    (r"(ab", "invalid regex"),
    (r"a{100000}", "too large"),
    ("x" * 100_001, "too long"),
]


@pytest.mark.parametrize(("regex", "message"), BAD_REGEXES, ids=[m for _, m in BAD_REGEXES])
def test_bad_regex_is_a_clear_value_error(compiler: Any, regex: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compiler.compile("regex", regex)


BAD_SCHEMAS = [
    ('{"type": ', "not valid JSON"),
    ("[1, 2]", "must be an object"),
    (False, "false"),
    ({"type": "foo"}, "unsupported json_schema"),
    ({"type": "string", "pattern": "(?=a)b"}, "lookahead"),
    ('{"items":' * 10_000 + "{}" + "}" * 10_000, "nested too deeply"),
]


@pytest.mark.parametrize(("schema", "message"), BAD_SCHEMAS, ids=[m for _, m in BAD_SCHEMAS])
def test_bad_schema_is_a_clear_value_error(compiler: Any, schema: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compiler.compile("json_schema", schema)


def test_deep_schema_dict_fails_fast(compiler: Any) -> None:
    schema: dict[str, Any] = {}
    for _ in range(10_000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match="nested too deeply"):
        compiler.compile("json_schema", schema)


def test_pathological_regex_is_fast(compiler: Any, tokenizer: Any) -> None:
    g = compiler.compile("regex", r"(a+)+b")
    m = g.new_matcher()
    for t in _encode(tokenizer, "aaaaab"):
        m.accept_token(t)
    assert m.is_terminated()


def test_unknown_kind_and_types(compiler: Any) -> None:
    with pytest.raises(ValueError, match="grammar kind"):
        compiler.compile("cfg", "a")
    with pytest.raises(ValueError, match="outlines grammar backend cannot enforce 'ebnf'"):
        compiler.compile("ebnf", 'root ::= "a"')
    with pytest.raises(ValueError, match="regex must be a string"):
        compiler.compile("regex", {"a": 1})


def test_cache_returns_the_same_grammar(compiler: Any) -> None:
    schema = {"type": "object", "properties": {"q": {"type": "integer"}}}
    first = compiler.compile("json_schema", schema)
    hits = compiler.cache_hits
    assert compiler.compile("json_schema", json.dumps(schema, indent=2)) is first
    assert compiler.cache_hits == hits + 1
    assert compiler.compile("regex", "[0-9]+") is compiler.compile("regex", "[0-9]+")


def test_submit_never_waits_for_the_compile(tokenizer: Any) -> None:
    """A compile held on a gate: submit returns a pending future, which completes once the
    compile may go on (no clock involved: the time limit is far away)."""
    gate = threading.Event()
    backend = OutlinesBackend(tokenizer, len(tokenizer))
    real = backend.compile
    backend.compile = lambda *a: gate.wait() and real(*a)
    held = GrammarCompiler(backend, timeout_s=600)
    try:
        fut = held.submit("regex", "[a-z]+")
        assert not fut.done()
        gate.set()
        assert fut.result(timeout=60) is not None
    finally:
        gate.set()
        held.shutdown()


def test_time_limit_fails_the_future(tokenizer: Any) -> None:
    """An injected 3 s compile against a 0.05 s limit: the future fails naming the limit,
    and the failure is not cached."""
    slow = GrammarCompiler(OutlinesBackend(tokenizer, len(tokenizer)), timeout_s=0.05,
                           compile_delay_s=3.0)
    try:
        fut = slow.submit("regex", "[a-z]+")
        with pytest.raises(ValueError, match="exceeded the time limit of 0.05 s"):
            fut.result(timeout=20)
        assert slow.submit("regex", "[a-z]+") is not fut  # not cached
    finally:
        slow.shutdown()


def test_state_limit(tokenizer: Any) -> None:
    small = outlines(tokenizer, max_states=50, max_expanded_size=100)
    try:
        with pytest.raises(ValueError, match="limit 50"):
            small.compile("regex", "[a-z]{60}")  # 60 unrolled elements < 100, 62 states
        with pytest.raises(ValueError, match="too large"):
            small.compile("regex", "[a-z]{101}")
    finally:
        small.shutdown()


# -- dtype regexes -------------------------------------------------------------------------
def test_dtype_regexes(compiler: Any) -> None:
    assert dtype_to_regex(int) == dtype_to_regex("int") == REGEX_INT
    assert dtype_to_regex(float) == REGEX_FLOAT and dtype_to_regex(bool) == REGEX_BOOL
    assert dtype_to_regex(str) == REGEX_STR
    with pytest.raises(ValueError, match="unsupported dtype 'list'"):
        dtype_to_regex(list)
    assert re.fullmatch(REGEX_INT, "-42 \n") and not re.fullmatch(REGEX_INT, "4.2")
    assert re.fullmatch(REGEX_FLOAT, "3.14") and re.fullmatch(REGEX_FLOAT, ".5")
    assert re.fullmatch(REGEX_BOOL, "True") and not re.fullmatch(REGEX_BOOL, "true")
    assert re.fullmatch(REGEX_STR, '"hello world"')
