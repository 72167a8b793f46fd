"""The storage backend contract: bytes under string keys, with every failure a miss."""

from __future__ import annotations

from abc import ABC, abstractmethod


class StorageBackend(ABC):
    """Where pages live below the KV pool.

    Contract: ``get`` returns the bytes last ``put`` under ``key`` if they are exactly the
    ``size`` the caller expects, else None (missing, another size, not a plain stored object,
    or any I/O error: the caller recomputes); it reads at most ``size`` bytes and never
    waits on a writer (a stored object is untrusted input); ``put`` is atomic (a reader
    sees the old bytes, the new ones or none, never a mix) and returns False instead of
    raising on a full or read-only medium. Both may run on any thread. Integrity of the
    bytes is the caller's (``page_format`` checksums them); a backend may lose any page at
    any time.
    """

    name: str

    @abstractmethod
    def get(self, key: str, size: int) -> bytes | bytearray | None:
        """The page under ``key`` if it is ``size`` bytes, or None."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` (replacing any); False if it could not."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a page is stored under ``key`` (it may still be lost before a get)."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """Bytes stored under ``key``, None if none (a writer skips a page stored whole)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Forget ``key`` (a corrupt page); no error if it is missing."""

    @abstractmethod
    def info(self) -> dict[str, object]:
        """What ``/get_server_info`` shows about this backend."""
