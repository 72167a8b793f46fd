"""The outlines backend's grammar and matcher: CompiledGrammar (shared, immutable automata)
and GrammarMatcher (one request's position). Each token state's bitmask row is computed
once (from the Index) and then copied with memmove.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from outlines_core import Index

from radixlm.runtime.constrained.base import Grammar, Matcher, bitmask_width
from radixlm.runtime.constrained.grammar import BYTE_SENTINEL_ID
from radixlm.runtime.constrained.vocabulary import TokenizerInfo

logger = logging.getLogger(__name__)

MAX_CACHED_ROWS = 8192  # per grammar; past this, rows are recomputed on each fill


@dataclass(eq=False)
class CompiledGrammar(Grammar):
    """The automata of one grammar over one tokenizer; shared by all requests using it.

    `index` is the token-level automaton (outlines-core); `byte_transitions` the byte-level
    DFA of the same regex (state -> {byte: next}), used for jump-forward. In both, the EOS /
    sentinel edge exists wherever R could still read the sentinel's character, so acceptance
    is "that edge leads to a final state" (`is_accepting_state`, `byte_accepting`), and the
    EOS bit of a mask row is set from it. Only the caches change after construction.
    """

    kind: str
    spec: str
    regex: str
    info: TokenizerInfo
    index: Index
    byte_initial: int
    byte_transitions: dict[int, dict[int, int]]
    byte_accepting: frozenset[int]
    compile_time_s: float = 0.0
    _rows: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _terminal: dict[int, bool] = field(default_factory=dict, repr=False)

    @property
    def num_states(self) -> int:
        return len(self.byte_transitions)

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self)

    def is_accepting_state(self, state: int) -> bool:
        after = self.index.get_next_state(state, self.info.eos_token_id)
        return after is not None and self.index.is_final_state(after)

    def allowed_token_ids(self, state: int) -> list[int]:
        """Sorted ids allowed in token state `state` (EOS included when accepting)."""
        eos = self.info.eos_token_id
        ids = [t for t in self.index.get_allowed_tokens(state) or [] if t != eos]
        if self.is_accepting_state(state):
            ids.append(eos)
        return sorted(t for t in ids if t < self.info.vocab_size)

    def bitmask_row(self, state: int) -> np.ndarray:
        """Packed int32 allowed-token row of `state`, width ceil(vocab_size / 32).

        Computed on the first visit of a state (about 0.4 ms at vocab 2k, 6 ms at 32k with
        most tokens allowed), then copied from the cache.
        """
        row = self._rows.get(state)
        if row is None:
            vocab, eos = self.info.vocab_size, self.info.eos_token_id
            ids = np.array(self.index.get_allowed_tokens(state) or [], dtype=np.int64)
            bits = np.zeros(bitmask_width(vocab) * 32, dtype=np.uint8)
            bits[ids[ids < vocab]] = 1
            bits[eos] = self.is_accepting_state(state)
            row = np.packbits(bits, bitorder="little").view(np.int32)
            if len(self._rows) < MAX_CACHED_ROWS:
                self._rows[state] = row
        return row

    def is_terminal(self, state: int) -> bool:
        """Whether EOS is the only token allowed in `state`."""
        done = self._terminal.get(state)
        if done is None:
            done = self.allowed_token_ids(state) == [self.info.eos_token_id]
            self._terminal[state] = done
        return done


def _copy_row(dst: torch.Tensor, row: int, src: np.ndarray) -> None:
    """dst[row, :len(src)] = src; dst[row, len(src):] = 0 — memmove on contiguous CPU rows."""
    n = src.shape[0]
    assert dst.dim() == 2 and dst.shape[1] >= n, (tuple(dst.shape), n)
    if dst.device.type == "cpu" and dst.is_contiguous():
        base = dst.data_ptr() + row * dst.stride(0) * dst.element_size()
        ctypes.memmove(base, src.ctypes.data, src.nbytes)
        if dst.shape[1] > n:
            ctypes.memset(base + src.nbytes, 0, (dst.shape[1] - n) * dst.element_size())
    else:
        dst[row, :n].copy_(torch.from_numpy(src))
        dst[row, n:] = 0


class GrammarMatcher(Matcher):
    """Where one request is in its grammar: token state, byte-DFA state, and history."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self.state: int = grammar.index.get_initial_state()
        self.byte_state: int = grammar.byte_initial
        self.finished = False  # EOS accepted
        self._history: list[tuple[int, int, bool]] = []

    # -- masks ---------------------------------------------------------------------------
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        assert bitmask.dtype == torch.int32, bitmask.dtype
        if self.finished:
            self._fill_only_eos(bitmask, row)
        else:
            _copy_row(bitmask, row, self.grammar.bitmask_row(self.state))

    def _fill_only_eos(self, bitmask: torch.Tensor, row: int) -> None:
        eos = self.grammar.info.eos_token_id
        bitmask[row] = 0
        bitmask[row, eos // 32] = ((1 << (eos % 32)) ^ 0x80000000) - 0x80000000  # as int32

    def allowed_token_ids(self) -> list[int]:
        if self.finished:
            return [self.grammar.info.eos_token_id]
        return self.grammar.allowed_token_ids(self.state)

    # -- advancing -----------------------------------------------------------------------
    def _step(self, state: int, byte_state: int, token_id: int) -> tuple[int, int] | None:
        """Next (token state, byte state) after `token_id`, or None if not allowed."""
        nxt = self.grammar.index.get_next_state(state, token_id)
        if nxt is None or token_id == self.grammar.info.eos_token_id:
            return None
        trans = self.grammar.byte_transitions
        data = self.grammar.info.token_bytes[token_id]
        assert data is not None, f"special token {token_id} allowed by the index"
        for b in data:
            byte_state = trans[byte_state][b]
        return nxt, byte_state

    def accept_token(self, token_id: int) -> bool:
        if self.finished:
            return False
        if token_id == self.grammar.info.eos_token_id:
            if not self.is_accepting():
                return False
            self._history.append((self.state, self.byte_state, self.finished))
            self.finished = True
            return True
        step = self._step(self.state, self.byte_state, token_id)
        if step is None:
            return False
        self._history.append((self.state, self.byte_state, self.finished))
        self.state, self.byte_state = step
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        assert 0 <= num_tokens <= len(self._history), (num_tokens, len(self._history))
        if num_tokens:
            self.state, self.byte_state, self.finished = self._history[-num_tokens]
            del self._history[-num_tokens:]

    def copy(self) -> GrammarMatcher:
        other = GrammarMatcher(self.grammar)
        other.state, other.byte_state, other.finished = self.state, self.byte_state, self.finished
        other._history = list(self._history)
        return other

    # -- status --------------------------------------------------------------------------
    def is_accepting(self) -> bool:
        """Whether the text so far is a complete match (EOS allowed)."""
        return self.grammar.is_accepting_state(self.state)

    def is_terminated(self) -> bool:
        """Whether the request should finish: EOS accepted, or EOS is all that is left."""
        return self.finished or self.grammar.is_terminal(self.state)

    # -- jump-forward --------------------------------------------------------------------
    def forced_string(self) -> str:
        """The longest text the grammar forces from here (every match continues with it)."""
        if self.finished:
            return ""
        trans = self.grammar.byte_transitions
        state, out = self.byte_state, bytearray()
        seen = {state}
        while True:
            nxt = {b: t for b, t in trans[state].items() if b != BYTE_SENTINEL_ID}
            if len(nxt) != 1 or state in self.grammar.byte_accepting:
                break
            ((b, state),) = nxt.items()
            if state in seen:  # a forced cycle: the language is infinite and fixed; stop
                break
            seen.add(state)
            out.append(b)
        if out and 0x80 <= out[0] < 0xC0:  # mid-character: not expressible as text
            return ""
        return out.decode("utf-8", errors="ignore") if out else ""
