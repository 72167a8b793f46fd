"""Content keys of stored pages, and the model identity every key carries.

A page's key chains its tokens with its parent page's key; the first page of a sequence
chains with the model identity and the request's cache namespace instead::

    key_0 = H(identity, namespace, None,  tokens[0:B])
    key_i = H(identity, namespace, key_{i-1}, tokens[iB:(i+1)B])

``H`` is blake2b-128 over msgpack, so a key names the whole prefix up to its page, the model
that computed it (checkpoint files, config, dtypes, layout, weight version) and the tenant /
``extra_key`` / ``cache_salt`` namespace: another model, a weight update or another tenant
derives other keys and never reads the page. Keys are stable across processes and
machines (no Python ``hash()``), so servers sharing a directory, and a restarted one,
find each other's pages.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import msgspec

_FORMAT = "radixlm-kv-page-v1"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _digest(obj: object) -> str:
    return hashlib.blake2b(msgspec.msgpack.encode(obj), digest_size=16).hexdigest()


def checkpoint_fingerprint(model_path: str) -> list[object]:
    """What identifies a checkpoint directory without reading its weights: its real path,
    ``config.json``'s bytes, and each weight file's name, size and mtime (a rewrite in
    place changes them)."""
    root = Path(os.path.realpath(model_path))
    config = root / "config.json"
    parts: list[object] = [str(root), hashlib.blake2b(
        config.read_bytes() if config.is_file() else b"", digest_size=16).hexdigest()]
    if root.is_dir():
        for f in sorted(root.iterdir()):
            if f.suffix in _WEIGHT_SUFFIXES and f.is_file():
                st = f.stat()
                parts.append([f.name, st.st_size, st.st_mtime_ns])
    return parts


def model_identity(model_path: str, weight_version: str, layout: dict[str, object]) -> str:
    """The identity hashed into every key: the checkpoint (``checkpoint_fingerprint``), its
    ``weight_version`` and the KV ``layout`` (dtypes, geometry, device, tensor-parallel
    size, quantization: whatever changes the KV bytes)."""
    return _digest([_FORMAT, checkpoint_fingerprint(model_path), weight_version,
                    sorted(layout.items())])


def page_keys(identity: str, namespace: str | None, token_ids: Sequence[int],
              block_tokens: int, num_pages: int | None = None) -> list[str]:
    """Keys of the first ``num_pages`` whole pages of ``token_ids`` (all whole pages when
    None), each of ``block_tokens`` tokens."""
    whole = len(token_ids) // block_tokens
    count = whole if num_pages is None else min(num_pages, whole)
    keys: list[str] = []
    parent = None
    for i in range(count):
        tokens = list(token_ids[i * block_tokens:(i + 1) * block_tokens])
        parent = _digest([identity, namespace, parent, tokens])
        keys.append(parent)
    return keys
