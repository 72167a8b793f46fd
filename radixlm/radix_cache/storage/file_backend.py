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

No file is trusted (anyone who could write the directory could plant anything in it): the
directory must be this user's (else refused) and is made 0700 if group or others could
reach it (with a warning); a page is opened ``O_NOFOLLOW | O_NONBLOCK`` inside a fan-out
folder opened ``O_NOFOLLOW`` (a symlink, FIFO, device, socket or directory is refused
without a byte read, and never blocks the open), must be a regular file of exactly the size
its reader expects (``fstat`` before reading), and is read with that bound. What is refused
is counted (``refused_files``), deleted where it can be, and is a miss.
"""

from __future__ import annotations

import logging
import os
import re
import stat
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
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_PAGE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_SHARED_BITS = 0o077  # any access by group or others


class RefusedPage(OSError):
    """A directory entry where a page should be that is not one (see the module docstring)."""


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
        self.refused_files = 0
        self.bytes_read = 0
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            self._warn("mkdir", f"cannot create {self.root}: {e}; pages will not be stored")
        else:
            self._make_private()
        self._usage = 0
        self._scanned_at = 0.0
        self._rescan()

    # --- the contract -----------------------------------------------------------------
    def path(self, key: str) -> Path:
        assert _KEY.match(key), f"bad page key {key!r}"
        return self.root / key[:2] / (key + SUFFIX)

    def get(self, key: str, size: int) -> bytearray | None:
        path = self.path(key)
        try:
            folder = os.open(path.parent, _OPEN_DIR)
        except FileNotFoundError:
            return None
        except OSError as e:  # a symlink (ELOOP) or a file (ENOTDIR) where the folder is
            return self._refused(path.parent, f"not a folder of pages ({e.strerror})")
        try:
            _check_folder_stat(os.fstat(folder))
        except RefusedPage as e:  # not ours to clean: left alone, every page in it a miss
            os.close(folder)
            return self._refused(path.parent, str(e), delete=False)
        try:
            return self._read_page(folder, path.name, size)
        except FileNotFoundError:
            return None
        except RefusedPage as e:
            return self._refused(path, str(e), folder)
        except OSError as e:
            self.read_errors += 1
            self._warn("read", f"reading {path}: {e}; recomputing")
            return None
        finally:
            os.close(folder)

    def _read_page(self, folder: int, name: str, size: int) -> bytearray:
        """The ``size`` bytes of regular file ``name`` in ``folder``; ``RefusedPage`` if it
        is anything else (checked before it is opened, then on the open file)."""
        _check_page(os.stat(name, dir_fd=folder, follow_symlinks=False), size)
        fd = os.open(name, _OPEN_PAGE, dir_fd=folder)  # no FIFO or device blocks here
        try:
            _check_page(os.fstat(fd), size)  # the file opened, not the name looked up
            data = bytearray(size)
            view, got = memoryview(data), 0
            while got < size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    raise RefusedPage(f"{got} of {size} bytes (cut short while read)")
                got += n
            self.bytes_read += got
            try:
                os.utime(fd)  # the LRU order; on the file read, not on a name
            except OSError:
                pass  # a read-only directory: the LRU order just stays the write order
            return data
        finally:
            os.close(fd)

    def put(self, key: str, data: bytes) -> bool:
        path = self.path(key)
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            _check_folder_stat(os.lstat(path.parent))  # not a planted link or open folder
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
        return self.size(key) is not None

    def size(self, key: str) -> int | None:
        try:
            st = os.lstat(self.path(key))
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def delete(self, key: str) -> None:
        _unlink(self.path(key))

    def info(self) -> dict[str, object]:
        return {"backend": self.name, "dir": str(self.root), "max_bytes": self.max_bytes,
                "used_bytes": self._usage, "write_errors": self.write_errors,
                "read_errors": self.read_errors, "refused_files": self.refused_files,
                "bytes_read": self.bytes_read, "trimmed_files": self.trimmed_files}

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
            folders = [d for d in os.scandir(self.root)
                       if d.is_dir(follow_symlinks=False) and len(d.name) == 2]
        except OSError:
            folders = []
        for folder in folders:
            try:
                entries = list(os.scandir(folder.path))
            except OSError:
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue  # deleted meanwhile
                if not stat.S_ISREG(st.st_mode):
                    continue  # a reader refuses (and deletes) it; it holds no bytes here
                if e.name.endswith(SUFFIX):
                    files.append((st.st_mtime, st.st_size, Path(e.path)))
                elif e.name.startswith(".tmp-") and now - st.st_mtime > STALE_TMP_S:
                    _unlink(Path(e.path))
        with self._lock:
            self._usage = sum(f[1] for f in files)
            self._scanned_at = time.monotonic()
        return files

    # --- helpers --------------------------------------------------------------------------
    def _make_private(self) -> None:
        """Refuse a directory that is not this user's; make one that group or others can
        reach 0700, with a warning (they could plant pages, or read every tenant's tokens
        in the headers)."""
        st = os.stat(self.root)  # a symlinked root is the operator's choice: its target
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"--hicache-storage-dir {self.root} is not a directory")
        if st.st_uid != os.geteuid():
            raise ValueError(
                f"--hicache-storage-dir {self.root} belongs to uid {st.st_uid}, not to this "
                f"server's ({os.geteuid()}): refused (its owner could plant pages there)")
        mode = stat.S_IMODE(st.st_mode)
        if mode & _SHARED_BITS:
            os.chmod(self.root, mode & ~_SHARED_BITS)
            logger.warning(
                "hicache storage: %s was mode %04o (group or others could plant or read "
                "pages); changed to %04o", self.root, mode, mode & ~_SHARED_BITS)

    def _refused(self, path: Path, why: str, folder: int | None = None,
                 delete: bool = True) -> None:
        """Count and warn about a refused entry; ``delete`` it (a folder only if empty) so
        that the page is written again."""
        self.refused_files += 1
        self._warn("refused", f"{path}: {why}; refused, its tokens are recomputed")
        if not delete:
            return None
        for remove in (os.unlink, os.rmdir):
            try:
                if folder is None:
                    remove(path)
                else:
                    remove(path.name, dir_fd=folder)
                break
            except OSError:
                pass  # a folder (then rmdir: only if empty), or gone
        return None

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


def _check_folder_stat(st: os.stat_result) -> None:
    """A fan-out folder must be a real folder of this user that only this user can write."""
    if not stat.S_ISDIR(st.st_mode):
        raise RefusedPage("not a folder")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RefusedPage(f"folder of uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}")


def _check_page(st: os.stat_result, size: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise RefusedPage(f"not a regular file (mode {st.st_mode:o})")
    if st.st_size != size:
        raise RefusedPage(f"{st.st_size} bytes where the page has {size}")


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False
