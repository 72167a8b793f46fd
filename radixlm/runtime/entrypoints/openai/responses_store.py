"""The stored responses that ``previous_response_id`` and ``GET /v1/responses/{id}`` read.

In memory, least recently used first out, bounded twice: at most ``--max-stored-responses``
responses and ``--max-stored-response-bytes`` bytes (each entry's size is its response
object plus its conversation, JSON-encoded), so a client cannot grow the server's memory
by chaining or storing. An entry records the tenant whose key created it (``auth.py``):
another tenant's lookup finds nothing, exactly as for an unknown id, so ids of other
tenants can be neither read, continued, nor deleted, nor told apart from ids never issued.
Nothing survives a restart (OpenAI keeps responses 30 days; vLLM and SGLang keep them in
memory too).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredResponse:
    """One response: the object ``GET`` returns and the chat messages a continuation
    renders before its own input (the chain's input and output, without instructions)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    input_items: list[dict[str, Any]]
    tenant: str | None
    size: int


class ResponseStore:
    """``put`` / ``get`` / ``delete`` by response id, scoped to a tenant."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]],
            input_items: list[dict[str, Any]], tenant: str | None) -> bool:
        """Store ``response`` under its id, evicting the least recently used entries to
        stay within both bounds; False (nothing stored) if it alone is over a bound."""
        size = sum(len(msgspec.json.encode(x)) for x in (response, messages, input_items))
        if self.max_entries == 0 or size > self.max_bytes:
            logger.warning("response %s not stored: %d bytes, the store holds at most %d "
                           "bytes and %d responses (--max-stored-response-bytes, "
                           "--max-stored-responses)", response["id"], size, self.max_bytes,
                           self.max_entries)
            return False
        self._pop(response["id"])
        self._entries[response["id"]] = StoredResponse(response, messages, input_items,
                                                       tenant, size)
        self.total_bytes += size
        while len(self._entries) > self.max_entries or self.total_bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            logger.debug("evicting stored response %s", oldest)
            self._pop(oldest)
        return True

    def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        """The entry of ``response_id`` if ``tenant`` created it (it becomes the most
        recently used), else None."""
        entry = self._entries.get(response_id)
        if entry is None or entry.tenant != tenant:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, tenant: str | None) -> bool:
        if self.get(response_id, tenant) is None:
            return False
        self._pop(response_id)
        return True

    def _pop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.total_bytes -= entry.size
