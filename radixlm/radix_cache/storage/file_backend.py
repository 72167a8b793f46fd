"""The file backend: one file per page under ``--hicache-storage-dir``, bounded in size.

``DIR/ab/abcdef....kv`` holds the page whose key starts ``ab`` (256 fan-out folders keep
listings short). Writes go to a private temporary file in the same folder and are renamed
over the target (atomic on POSIX: concurrent writers of one page, from threads or from
other servers, each publish a whole file and the last one wins; a reader sees a whole
file or none). Reads refresh the file's mtime, which orders the tier's LRU: when the
directory passes ``max_bytes`` the writer that noticed deletes the oldest pages until it is
under 90% of it. Several servers may share one directory; each keeps its own running
total and rescans the directory at least every ``RESCAN_S`` seconds. Files and folders are
created private to the server's user (0600 / 0700). No fsync: a page cut short by a crash
fails its checksum and is recomputed.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path

from radixlm.radix_cache.storage.base import StorageBackend

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
RESCAN_S = 30.0
TRIM_TO = 0.9  # of max_bytes, after a trim
STALE_TMP_S = 600.0  # a temporary file this old was left by a writer that died
WARN_EVERY_S = 60.0
_KEY = re.compile(r"^[0-9a-f]{32}$")


class FileStorage(StorageBackend):
    """Pages as files under ``root`` (created 0700 if missing), at most ``max_bytes``."""

    name = "file"

    def __init__(self, root: str, max_bytes: int) -> None:
        self.root = Path(root).expanduser()
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._last_warning: dict[str, float] = {}
        self.write_errors = 0
        self.read_errors = 0
        self.trimmed_files = 0
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            self._warn("mkdir", f"cannot create {self.root}: {e}; pages will not be stored")
        self._usage = 0
        self._scanned_at = 0.0
        self._rescan()

    # --- the contract -----------------------------------------------------------------
    def path(self, key: str) -> Path:
        assert _KEY.match(key), f"bad page key {key!r}"
        return self.root / key[:2] / (key + SUFFIX)

    def get(self, key: str) -> bytes | None:
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            self.read_errors += 1
            self._warn("read", f"reading {path}: {e}; recomputing")
            return None
        self._touch(path)
        return data

    def put(self, key: str, data: bytes) -> bool:
        path = self.path(key)
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        except OSError as e:
            return self._write_failed(path, e)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            _unlink(Path(tmp))
            return self._write_failed(path, e)
        with self._lock:
            self._usage += len(data)
            over = self._usage > self.max_bytes
        if over or time.monotonic() - self._scanned_at > RESCAN_S:
            self.trim()
        return True

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def size(self, key: str) -> int | None:
        try:
            return self.path(key).stat().st_size
        except OSError:
            return None

    def delete(self, key: str) -> None:
        _unlink(self.path(key))

    def info(self) -> dict[str, object]:
        return {"backend": self.name, "dir": str(self.root), "max_bytes": self.max_bytes,
                "used_bytes": self._usage, "write_errors": self.write_errors,
                "read_errors": self.read_errors, "trimmed_files": self.trimmed_files}

    # --- size bound ---------------------------------------------------------------------
    def trim(self) -> None:
        """Rescan; if over ``max_bytes``, delete least recently used pages (oldest mtime)
        until under ``TRIM_TO`` of it."""
        files = self._rescan()
        if self._usage <= self.max_bytes:
            return
        files.sort(key=lambda f: f[0])
        usage, removed = self._usage, 0
        for _, size, path in files:
            if usage <= self.max_bytes * TRIM_TO:
                break
            if _unlink(path):
                usage -= size
                removed += 1
        with self._lock:
            self._usage = usage
        self.trimmed_files += removed
        logger.info("hicache storage %s over %d bytes: removed %d least recently used pages",
                    self.root, self.max_bytes, removed)

    def _rescan(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every page; sets the running total; removes temporary
        files left by dead writers."""
        files: list[tuple[float, int, Path]] = []
        now = time.time()
        try:
            folders = [d for d in os.scandir(self.root) if d.is_dir() and len(d.name) == 2]
        except OSError:
            folders = []
        for folder in folders:
            try:
                entries = list(os.scandir(folder.path))
            except OSError:
                continue
            for e in entries:
                try:
                    st = e.stat()
                except OSError:
                    continue  # deleted meanwhile
                if e.name.endswith(SUFFIX):
                    files.append((st.st_mtime, st.st_size, Path(e.path)))
                elif e.name.startswith(".tmp-") and now - st.st_mtime > STALE_TMP_S:
                    _unlink(Path(e.path))
        with self._lock:
            self._usage = sum(f[1] for f in files)
            self._scanned_at = time.monotonic()
        return files

    # --- helpers --------------------------------------------------------------------------
    def _touch(self, path: Path) -> None:
        try:
            os.utime(path)
        except OSError:
            pass  # a read-only directory: the LRU order just stays the write order

    def _write_failed(self, path: Path, e: OSError) -> bool:
        self.write_errors += 1
        self._warn("write", f"cannot write {path}: {e}; the page will be recomputed when "
                            "needed")
        return False

    def _warn(self, what: str, message: str) -> None:
        """At most one warning per kind per ``WARN_EVERY_S`` (a full disk would flood)."""
        now = time.monotonic()
        if now - self._last_warning.get(what, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._last_warning[what] = now
            logger.warning("hicache storage: %s", message)


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False
