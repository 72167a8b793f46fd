"""Token bytes of a Hugging Face tokenizer, and the outlines-core vocabulary built from them.

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2, the tiny model) store each token as a
printable alias of its bytes ('Ġ' for b' ', 'Ċ' for b'\\n'); the automaton must see the bytes
the detokenizer will produce, so the aliases are mapped back through the GPT-2 alphabet.
SentencePiece-style tokens ('▁the', '<0x0A>') are handled too. Special tokens are left out.

outlines-core 0.2.14's `Index` drops every transition from an accepting state into a
non-accepting one (its DFA reports matches one byte late), so `[0-9]+(\\.[0-9]+)?` could never
emit the '.'. The workaround used here: every regex is compiled as `(?:R)` + SENTINEL, and the
vocabulary maps SENTINEL's bytes to the real EOS id. A state then allows EOS exactly when R
has fully matched, and no match is ever reported before the sentinel, so no transition is
lost. outlines-core's own EOS id is a placeholder just past the tokenizer's ids.
Tokens containing the byte 0xF4 are left out of the vocabulary: otherwise single-byte tokens
could spell the sentinel. 0xF4 only starts characters U+100000..U+10FFFF (a private-use
plane), so constrained outputs merely lose those.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from outlines_core import Vocabulary

from radixlm.runtime.constrained.base import special_token_ids

logger = logging.getLogger(__name__)

SENTINEL = "\U0010ffff"  # a Unicode noncharacter: no real token contains its bytes
SENTINEL_BYTES = SENTINEL.encode()


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable alias -> byte value."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.decoder is not None:
        return "ByteLevel" in repr(backend.decoder)
    vocab = tokenizer.get_vocab()
    return "Ġ" in "".join(list(vocab)[:5000]) or "Ġthe" in vocab


def _piece_bytes(piece: str, byte_level: bool) -> bytes:
    if byte_level:
        dec = _byte_decoder()
        if all(c in dec for c in piece):
            return bytes(dec[c] for c in piece)
        return piece.encode()
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("▁", " ").encode()


@dataclass(frozen=True)
class TokenizerInfo:
    """What the constrained decoder needs from a tokenizer, computed once.

    token_bytes[i] is the byte string token i decodes to, or None for a special token
    (never allowed by a grammar). vocab_size is len(tokenizer); eos_token_id the id that
    ends a constrained request.
    """

    token_bytes: tuple[bytes | None, ...]
    eos_token_id: int
    vocab_size: int
    vocabulary: Vocabulary


def token_bytes_of(tokenizer: Any) -> list[bytes | None]:
    """Bytes of every token id in [0, len(tokenizer)); None for special tokens."""
    size = len(tokenizer)
    special = special_token_ids(tokenizer)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    byte_level = _is_byte_level(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    out: list[bytes | None] = []
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            out.append(None)
        elif i in added:  # non-special added tokens are stored as plain text
            out.append(str(piece).encode())
        else:
            out.append(_piece_bytes(piece, byte_level))
    return out


def _build_info(tokenizer: Any) -> TokenizerInfo:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("constrained decoding needs a tokenizer with an eos_token_id")
    token_bytes = token_bytes_of(tokenizer)
    size = len(token_bytes)
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(token_bytes):
        if b and i != eos and SENTINEL_BYTES[0] not in b:
            by_bytes.setdefault(b, []).append(i)
    by_bytes.setdefault(SENTINEL_BYTES, []).append(eos)
    vocabulary = Vocabulary(size, by_bytes)
    logger.debug("built vocabulary: %d token ids, %d distinct byte strings", size, len(by_bytes))
    return TokenizerInfo(tuple(token_bytes), eos, size, vocabulary)


_CACHE: weakref.WeakKeyDictionary[Any, TokenizerInfo] = weakref.WeakKeyDictionary()
_CACHE_BY_ID: dict[int, TokenizerInfo] = {}
_LOCK = threading.Lock()


def tokenizer_info(tokenizer: Any) -> TokenizerInfo:
    """TokenizerInfo of `tokenizer`, cached per tokenizer object."""
    with _LOCK:
        try:
            cached = _CACHE.get(tokenizer)
        except TypeError:  # not weak-referenceable
            cached = _CACHE_BY_ID.get(id(tokenizer))
        if cached is not None:
            return cached
        info = _build_info(tokenizer)
        try:
            _CACHE[tokenizer] = info
        except TypeError:
            _CACHE_BY_ID[id(tokenizer)] = info
        return info


def build_vocabulary(tokenizer: Any) -> Vocabulary:
    """The outlines-core Vocabulary of `tokenizer` (with the sentinel entry, see module doc)."""
    return tokenizer_info(tokenizer).vocabulary
