"""Constrained decoding: regex / JSON schema / EBNF -> token bitmasks, and jump-forward.

    backend = create_grammar_backend("xgrammar", tokenizer, vocab_size)  # the one choice
    compiler = GrammarCompiler(backend)
    fut = compiler.submit("json_schema", schema)   # never blocks; compiled off the loop
    ...                                            # the request waits until fut.done()
    matcher = fut.result().new_matcher()           # ValueError here for a bad grammar
    bitmask = allocate_token_bitmask(batch_size, vocab_size)
    matcher.fill_bitmask(bitmask, row)             # each step, before sampling
    apply_token_bitmask_(logits, bitmask)          # in the sampler, in place
    matcher.accept_token(token_id)                 # after sampling
    matcher.is_terminated()                        # finish: only EOS left

Layout: base.py (the interface, bitmasks, spec checks), one module per backend
(xgrammar_backend.py, llguidance_backend.py, outlines_backend.py with grammar.py,
matcher.py and vocabulary.py), compiler.py (worker thread, LRU cache, time limit),
compile_worker.py (the child process that probes each spec within memory and time limits),
probe.py and productivity.py (grammars that match nothing), regex_size.py,
step_budget.py (what a grammar costs per decode step, --grammar-step-budget-ms),
jump_forward.py (canonical jump-forward over any matcher, capped per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixlm.runtime.config import GRAMMAR_BACKENDS
from radixlm.runtime.constrained.base import (
    GRAMMAR_KINDS,
    MAX_SCHEMA_DEPTH,
    Grammar,
    GrammarBackend,
    Matcher,
    allocate_token_bitmask,
    allowed_ids,
    apply_token_bitmask_,
    bitmask_width,
    canonical_schema,
    canonical_spec,
)
from radixlm.runtime.constrained.compiler import GrammarCompiler


def create_grammar_backend(name: str, tokenizer: Any, vocab_size: int,
                           stop_token_ids: Sequence[int] = ()) -> GrammarBackend:
    """The grammar backend ``name`` for one tokenizer: the one place a backend is chosen
    (``--grammar-backend``; the default, xgrammar, was the fastest at a 128k vocabulary in
    docs/benchmarks.md). Each module is imported on first use: it loads its library,
    seconds of start-up that a server using another backend should not pay."""
    if name == "xgrammar":
        from radixlm.runtime.constrained.xgrammar_backend import XGrammarBackend as cls
    elif name == "llguidance":
        from radixlm.runtime.constrained.llguidance_backend import LLGuidanceBackend as cls
    elif name == "outlines":
        from radixlm.runtime.constrained.outlines_backend import OutlinesBackend as cls
    else:
        raise ValueError(f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {name!r}")
    return cls(tokenizer, vocab_size, stop_token_ids)


__all__ = [
    "GRAMMAR_BACKENDS",
    "GRAMMAR_KINDS",
    "MAX_SCHEMA_DEPTH",
    "Grammar",
    "GrammarBackend",
    "GrammarCompiler",
    "Matcher",
    "allocate_token_bitmask",
    "allowed_ids",
    "apply_token_bitmask_",
    "bitmask_width",
    "canonical_schema",
    "canonical_spec",
    "create_grammar_backend",
]
