"""CompiledGrammar (shared, immutable automata) and GrammarMatcher (one request's position).

Masks are int32 bitmasks, one row per request: bit j of word i allows token 32 * i + j
(the layout of outlines-core, xgrammar and llguidance). A row is 1/32 of a bool row, so a
[B, V] batch mask is cheap to copy to the GPU; `apply_token_bitmask_` unpacks it there.
Each token state's row is computed once (from the Index) and then copied with memmove.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from outlines_core import Index

from radixlm.runtime.constrained.grammar import BYTE_SENTINEL_ID
from radixlm.runtime.constrained.vocabulary import TokenizerInfo

logger = logging.getLogger(__name__)

MAX_CACHED_ROWS = 8192  # per grammar; past this, rows are recomputed on each fill


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch_size: int, vocab_size: int, pin: bool = False) -> torch.Tensor:
    """A [batch_size, ceil(vocab_size / 32)] int32 bitmask with every token allowed."""
    shape = (batch_size, bitmask_width(vocab_size))
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits[b, t] = -inf wherever bit t of bitmask row b is 0. In place, vectorised."""
    assert logits.dim() == 2 and bitmask.dim() == 2, (logits.shape, bitmask.shape)
    assert logits.shape[0] == bitmask.shape[0], (logits.shape, bitmask.shape)
    batch, vocab = logits.shape
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(batch, -1)  # [B, W * 32]
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:  # ids past the mask (padding of the model's vocab) are never allowed
        pad = torch.zeros(batch, vocab - allowed.shape[1], dtype=torch.bool, device=logits.device)
        allowed = torch.cat([allowed, pad], dim=1)
    logits.masked_fill_(~allowed, float("-inf"))


@dataclass(eq=False)
class CompiledGrammar:
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
    _bool_rows: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
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

    def bool_row(self, state: int) -> np.ndarray:
        row = self._bool_rows.get(state)
        if row is None:
            packed = self.bitmask_row(state).view(np.uint8)
            row = np.unpackbits(packed, bitorder="little", count=self.info.vocab_size)
            row = row.view(np.bool_)
            if len(self._bool_rows) < MAX_CACHED_ROWS:
                self._bool_rows[state] = row
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


class GrammarMatcher:
    """Where one request is in its grammar: token state, byte-DFA state, and history.

    Scheduler contract: before sampling, `fill_mask(mask, row)`; after sampling,
    `accept_token(token_id)`; finish the request when `is_terminated()` (only EOS is left)
    or when the sampled token is EOS. Optional jump-forward: `forced_string()`, tokenize it,
    `jump_forward(forced, ids)`.
    """

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self.state: int = grammar.index.get_initial_state()
        self.byte_state: int = grammar.byte_initial
        self.finished = False  # EOS accepted
        self._history: list[tuple[int, int, bool]] = []

    # -- masks ---------------------------------------------------------------------------
    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        """Write this request's allowed tokens into row `row` of an int32 bitmask [B, W]
        (preferred, see module doc) or a bool mask [B, V]."""
        if self.finished:
            self._fill_only_eos(mask, row)
        elif mask.dtype == torch.int32:
            _copy_row(mask, row, self.grammar.bitmask_row(self.state))
        elif mask.dtype == torch.bool:
            _copy_row(mask, row, self.grammar.bool_row(self.state))
        else:
            raise AssertionError(f"mask must be int32 (bitmask) or bool, got {mask.dtype}")

    def _fill_only_eos(self, mask: torch.Tensor, row: int) -> None:
        eos = self.grammar.info.eos_token_id
        mask[row] = 0
        if mask.dtype == torch.int32:
            mask[row, eos // 32] = ((1 << (eos % 32)) ^ 0x80000000) - 0x80000000  # as int32
        else:
            mask[row, eos] = True

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

    def accept_token(self, token_id: int) -> None:
        """Advance over a sampled token. A token the mask did not allow is a bug: asserts."""
        assert not self.finished, f"token {token_id} after EOS"
        self._history.append((self.state, self.byte_state, self.finished))
        if token_id == self.grammar.info.eos_token_id:
            assert self.is_accepting(), f"EOS in non-accepting state {self.state}"
            self.finished = True
            return
        step = self._step(self.state, self.byte_state, token_id)
        if step is None:
            self._history.pop()
            raise AssertionError(f"token {token_id} is not allowed in state {self.state}")
        self.state, self.byte_state = step

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

    def jump_forward(self, forced: str, token_ids: list[int]) -> bool:
        """Accept `token_ids` (the tokenization of `forced`) as a unit. Returns False and
        changes nothing if the automaton does not accept them token by token."""
        del forced  # the tokens are what the model will see; they alone are checked
        state, byte_state = self.state, self.byte_state
        steps: list[tuple[int, int]] = []
        for token_id in token_ids:
            step = self._step(state, byte_state, token_id)
            if step is None:
                return False
            steps.append((state, byte_state))
            state, byte_state = step
        self._history.extend((s, bs, False) for s, bs in steps)
        self.state, self.byte_state = state, byte_state
        return True
