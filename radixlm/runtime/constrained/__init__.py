"""Constrained decoding: regex / JSON schema -> token masks (outlines-core), jump-forward.

    compiler = GrammarCompiler(tokenizer)
    fut = compiler.submit("json_schema", schema)      # never blocks; compiled off the loop
    ...                                                # request waits until fut.done()
    matcher = fut.result().new_matcher()               # ValueError here for a bad grammar
    bitmask = allocate_token_bitmask(batch_size, vocab_size)
    matcher.fill_mask(bitmask, row)                    # each step, before sampling
    apply_token_bitmask_(logits, bitmask)              # in the sampler
    matcher.accept_token(token_id)                     # after sampling
    matcher.is_terminated()                            # finish: only EOS left

Layout: vocabulary.py (token bytes, outlines-core Vocabulary), grammar.py (spec checks,
schema -> regex, automata), matcher.py (CompiledGrammar, GrammarMatcher, bitmask helpers),
compiler.py (GrammarCompiler: worker thread, LRU cache, time limit).
"""

from radixlm.runtime.constrained.compiler import GRAMMAR_KINDS, GrammarCompiler, compile_grammar
from radixlm.runtime.constrained.grammar import (
    JSON_WHITESPACE_PATTERN,
    MAX_SCHEMA_DEPTH,
    GrammarLimits,
)
from radixlm.runtime.constrained.matcher import (
    CompiledGrammar,
    GrammarMatcher,
    allocate_token_bitmask,
    apply_token_bitmask_,
    bitmask_width,
)
from radixlm.runtime.constrained.vocabulary import (
    TokenizerInfo,
    build_vocabulary,
    token_bytes_of,
    tokenizer_info,
)

__all__ = [
    "GRAMMAR_KINDS",
    "JSON_WHITESPACE_PATTERN",
    "MAX_SCHEMA_DEPTH",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarLimits",
    "GrammarMatcher",
    "TokenizerInfo",
    "allocate_token_bitmask",
    "apply_token_bitmask_",
    "bitmask_width",
    "build_vocabulary",
    "compile_grammar",
    "token_bytes_of",
    "tokenizer_info",
]
