"""The GGUF container, read by our own bounded reader: the header, the metadata, the tensor
infos and every tensor's byte range, checked before anything reads the data.

``read_container(path)`` returns ``(metadata, tensors, version)``, the tensors as the file
lists them (``RawTensor``: GGML dims innermost first, type, absolute byte range). It does not
use ``gguf.GGUFReader``, which loops over counts read from the file before checking them
against its size and turns a truncated file into an IndexError or a silently short array; it
refuses, with a ``GGUFError`` naming the key or tensor:

    the container   bad magic or version, a header cut short, a string or array longer than
                    the bytes left, a duplicate key or tensor, an alignment that is not a
                    power of two, a split file
    the tensors     an unknown GGML type (its number), a type no weight is read from, a zero
                    or absurd dimension, a row not a whole number of blocks, data
                    misaligned, past the end of the file or overlapping another tensor's

Every count is checked against the bytes left before a loop runs over it, so a hostile
file costs at most a pass over its own bytes. The tensor data is never read here.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 1024
MAX_ARRAY_DEPTH = 2

# value type -> (struct format, size); STRING 8 and ARRAY 9 are read apart
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file radixlm refuses; the message names the file and the key or tensor."""


@dataclass(frozen=True)
class RawTensor:
    """A tensor as the file lists it: GGML dims (innermost first), type, absolute offset."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


# GGML types no weight of ours is read from (integer tensors, llama.cpp's activation
# types, types the gguf package has no dequantizer for): refused by name at open
NOT_WEIGHT_TYPES = frozenset(int(t) for t in (
    GGMLQuantizationType.Q8_1, GGMLQuantizationType.Q8_K, GGMLQuantizationType.I8,
    GGMLQuantizationType.I16, GGMLQuantizationType.I32, GGMLQuantizationType.I64,
    GGMLQuantizationType.F64, GGMLQuantizationType.Q1_0))


class _Cursor:
    """Bounded little-endian reads from the mapped header; each read checks the bytes left."""

    def __init__(self, buf: mmap.mmap | bytes, where: str) -> None:
        self.buf, self.pos, self.size, self.where = buf, 0, len(buf), where

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.where}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} at byte {self.pos} needs {n} bytes, the file has "
                            f"{max(self.size - self.pos, 0)} left (truncated or corrupt)")

    def scalar(self, vtype: int, what: str) -> Any:
        fmt, n = _SCALARS[vtype]
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        # a float32 as its shortest decimal (1e-05, not 9.999999747378752e-06), as written
        return float(str(np.float32(value))) if vtype == 6 else value

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.u64(f"{what}'s length")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long (at most {limit})")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 ({e})") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
            return self.array(what, depth)
        raise self.fail(f"{what} has unknown value type {vtype}")

    def array(self, what: str, depth: int) -> list:
        etype = self.u32(f"{what}'s element type")
        count = self.u64(f"{what}'s element count")
        least = _SCALARS[etype][1] if etype in _SCALARS else 8 if etype == STRING else 12
        if etype not in _SCALARS and etype not in (STRING, ARRAY):
            raise self.fail(f"{what}: array of unknown value type {etype}")
        # every element takes at least `least` bytes: refuse before looping over the count
        self.need(count * least, f"{what} ({count} elements of type {etype})")
        if etype in _NUMPY:
            arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
            self.pos += count * least
            return (arr != 0).tolist() if etype == 7 else arr.tolist()
        return [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(count)]


def _read_header(cur: _Cursor) -> tuple[int, dict[str, Any], list[tuple], int]:
    """(version, metadata, tensor infos as read, end of the tensor infos)."""
    cur.need(4, "magic")
    if bytes(cur.buf[0:4]) != MAGIC:
        raise cur.fail(f"not a GGUF file (magic {bytes(cur.buf[0:4])!r}, expected {MAGIC!r})")
    cur.pos = 4
    version = cur.u32("version")
    if version not in VERSIONS:
        endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise cur.fail(f"GGUF version {version}{endian} is not supported (versions {VERSIONS})")
    n_tensors, n_kv = cur.u64("tensor count"), cur.u64("metadata count")
    # each key/value takes at least 13 bytes, each tensor info at least 25
    cur.need(n_kv * 13 + n_tensors * 25, f"{n_kv} metadata entries and {n_tensors} tensors")
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}", MAX_NAME)
        vtype = cur.u32(f"metadata {key!r}'s type")
        if key in meta:
            raise cur.fail(f"metadata key {key!r} appears twice")
        meta[key] = cur.value(vtype, f"metadata {key!r}")
    infos = []
    for i in range(n_tensors):
        name = cur.string(f"tensor #{i}'s name", MAX_NAME)
        n_dims = cur.u32(f"tensor {name!r}'s dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = tuple(cur.u64(f"tensor {name!r}'s dimension {d}") for d in range(n_dims))
        ggml_type = cur.u32(f"tensor {name!r}'s type")
        offset = cur.u64(f"tensor {name!r}'s offset")
        infos.append((name, dims, ggml_type, offset))
    return version, meta, infos, cur.pos


def _check_tensor(name: str, dims: tuple[int, ...], ggml_type: int, where: str,
                  file_size: int) -> int:
    """The tensor's byte size, after checking its type and dimensions."""
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"{where}: tensor {name!r} has unknown GGML type {ggml_type}") from None
    if ggml_type in NOT_WEIGHT_TYPES:
        raise GGUFError(f"{where}: tensor {name!r} has GGML type "
                        f"{GGMLQuantizationType(ggml_type).name}, which radixlm reads no "
                        "weights from")
    if any(d == 0 for d in dims):
        raise GGUFError(f"{where}: tensor {name!r} has a zero dimension {list(dims)}")
    if dims[0] % block:
        raise GGUFError(f"{where}: tensor {name!r}'s rows of {dims[0]} are not whole "
                        f"{GGMLQuantizationType(ggml_type).name} blocks of {block}")
    elements = math.prod(dims)  # Python ints: no overflow to hide an absurd product
    if elements // block * size > file_size:
        raise GGUFError(f"{where}: tensor {name!r} of dimensions {list(dims)} needs more "
                        f"bytes than the whole file's {file_size}")
    return elements // block * size


def _alignment(meta: dict[str, Any], where: str) -> int:
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 \
            or align & (align - 1) or align > 1 << 20:
        raise GGUFError(f"{where}: general.alignment {align!r} is not a power of two")
    return align


def _layout(infos: list[tuple], header_end: int, align: int, where: str,
            file_size: int) -> list[RawTensor]:
    """The tensors with absolute offsets, checked: aligned, inside the file, disjoint."""
    data_start = -(-header_end // align) * align
    tensors, seen = [], set()
    for name, dims, ggml_type, offset in infos:
        if name in seen:
            raise GGUFError(f"{where}: tensor {name!r} appears twice")
        seen.add(name)
        nbytes = _check_tensor(name, dims, ggml_type, where, file_size)
        if offset % align:
            raise GGUFError(f"{where}: tensor {name!r}'s offset {offset} is not a multiple "
                            f"of the alignment {align}")
        start = data_start + offset
        if start + nbytes > file_size:
            raise GGUFError(f"{where}: tensor {name!r} (bytes {start} to {start + nbytes}) "
                            f"runs past the end of the file ({file_size} bytes)")
        tensors.append(RawTensor(name, dims, ggml_type, start, nbytes))
    ordered = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + a.nbytes > b.offset:
            raise GGUFError(f"{where}: tensors {a.name!r} and {b.name!r} overlap")
    return tensors


def read_container(path: str | os.PathLike) -> tuple[dict[str, Any], list[RawTensor], int]:
    """(metadata, tensors, version) of the GGUF file at ``path``, every byte range checked."""
    path = Path(path)
    where = str(path)
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"{where}: {size} bytes is too short for a GGUF header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        version, meta, infos, end = _read_header(_Cursor(buf, where))
    if int(meta.get("split.count", 1) or 1) > 1:
        raise GGUFError(f"{where}: a split GGUF file (split.count {meta['split.count']}); "
                        "merge the parts first (llama-gguf-split --merge)")
    return meta, _layout(infos, end, _alignment(meta, where), where, size), version

