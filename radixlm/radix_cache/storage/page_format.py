"""The bytes of one stored page: a small JSON header, the raw K/V rows, a checksum.

Layout (no pickle: nothing in a page is executed or instantiated)::

    b"RLMKVPG1" | header length (u32 LE) | header (JSON) | payload | blake2b-128 of all before

Header: ``key`` (the page's content key), ``tokens`` (its token ids), ``dtype`` (the pool's
dtype name) and ``shape`` ``[2 * layers, tokens, kv heads, head_dim]`` (K_0, V_0, K_1, ...,
every KV head). ``decode_page`` accepts a page only when the checksum holds and the header
names exactly the key, tokens, dtype and shape the reader expects, so a truncated, corrupt,
renamed or foreign-layout file is a miss (the tokens are recomputed), never wrong KV.
"""

from __future__ import annotations

import hashlib
import struct

import msgspec
import torch

MAGIC = b"RLMKVPG1"
_DIGEST = 16
_LEN = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 20


class CorruptPage(ValueError):
    """A page whose bytes do not check out (the caller recomputes its tokens)."""


class PageHeader(msgspec.Struct, forbid_unknown_fields=True):
    key: str
    tokens: list[int]
    dtype: str
    shape: list[int]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _header(key: str, tokens: list[int], dtype: torch.dtype, shape: list[int]) -> bytes:
    return msgspec.json.encode(PageHeader(key, tokens, _dtype_name(dtype), shape))


def page_bytes(key: str, tokens: list[int], dtype: torch.dtype,
               shape: tuple[int, ...]) -> int:
    """The exact size of the page ``encode_page`` writes for these (a reader refuses a file
    of any other size before reading it)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (len(MAGIC) + _LEN.size + len(_header(key, list(tokens), dtype, list(shape)))
            + itemsize * torch.Size(shape).numel() + _DIGEST)


def encode_page(key: str, tokens: list[int], kv: torch.Tensor) -> bytes:
    """``kv``: ``[2 * layers, len(tokens), kv heads, head_dim]`` on the CPU."""
    assert kv.dim() == 4 and kv.shape[1] == len(tokens), (
        f"kv of shape {tuple(kv.shape)} for {len(tokens)} tokens")
    header = _header(key, tokens, kv.dtype, list(kv.shape))
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    body = b"".join((MAGIC, _LEN.pack(len(header)), header, payload))
    return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()


def decode_page(data: bytes | bytearray, key: str, tokens: list[int], dtype: torch.dtype,
                shape: tuple[int, ...]) -> torch.Tensor:
    """The K/V rows of a page read back (see the module docstring); ``CorruptPage`` if
    anything does not match."""
    if len(data) < len(MAGIC) + _LEN.size + _DIGEST or not data.startswith(MAGIC):
        raise CorruptPage(f"page {key}: not a radixlm page ({len(data)} bytes)")
    body, digest = memoryview(data)[:-_DIGEST], data[-_DIGEST:]
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
        raise CorruptPage(f"page {key}: checksum mismatch (truncated or corrupt)")
    (hlen,) = _LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if hlen > MAX_HEADER_BYTES or start + hlen > len(body):
        raise CorruptPage(f"page {key}: header length {hlen} out of range")
    try:
        header = msgspec.json.decode(body[start:start + hlen], type=PageHeader)
    except msgspec.DecodeError as e:
        raise CorruptPage(f"page {key}: bad header ({e})") from None
    expected = PageHeader(key, list(tokens), _dtype_name(dtype), list(shape))
    if header != expected:
        raise CorruptPage(f"page {key}: header does not match the page asked for")
    payload = body[start + hlen:]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(payload) != itemsize * torch.Size(shape).numel():
        raise CorruptPage(f"page {key}: {len(payload)} payload bytes for shape {shape}")
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(dtype).view(shape)
