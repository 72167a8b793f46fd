"""The stored responses that ``previous_response_id`` and ``GET /v1/responses/{id}`` read.

In memory, one least-recently-used list per tenant, each bounded twice: at most
``--max-stored-responses`` responses and ``--max-stored-response-bytes`` bytes. The bounds
are per tenant (the tenants of ``--api-key``; a server without tenants is one), so one
tenant storing or chaining evicts only its own responses, never another's; the server
holds at most tenants x bytes. An entry is kept as JSON bytes (the response object, each
chat message of its conversation, each validated input item), and its size is what those
bytes take in memory, so the bound counts what is stored: no field the server ignores is
kept, and no Python object around the JSON grows past it.

An entry records the tenant whose key created it (``auth.py``): another tenant's lookup
finds nothing, exactly as for an unknown id, so ids of other tenants can be neither read,
continued, nor deleted, nor told apart from ids never issued. Nothing survives a restart
(OpenAI keeps responses 30 days; vLLM and SGLang keep them in memory too).
"""

from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.entrypoints.http_utils import encode_json

logger = logging.getLogger(__name__)

# the entry's own objects (dataclass, tuples, its key and its place in the LRU)
ENTRY_OVERHEAD = 512


@dataclass(frozen=True)
class StoredResponse:
    """One response as JSON: the object ``GET`` returns, the chat messages a continuation
    renders before its own input (the chain's input and output, without instructions),
    and the input items ``GET .../input_items`` lists (with their ids)."""

    response: bytes
    messages: tuple[bytes, ...]
    input_items: tuple[bytes, ...]
    item_ids: tuple[str, ...]
    size: int

    @classmethod
    def of(cls, response: dict[str, Any], messages: list[dict[str, Any]],
           input_items: list[dict[str, Any]]) -> StoredResponse:
        """Encode an entry (seconds for a large one: run it off the event loop)."""
        body = encode_json(response)
        msgs = tuple(encode_json(m) for m in messages)
        items = tuple(encode_json(i) for i in input_items)
        ids = tuple(i["id"] for i in input_items)
        size = ENTRY_OVERHEAD + sum(sys.getsizeof(x) for x in (body, *msgs, *items, *ids))
        return cls(body, msgs, items, ids, size)


class _TenantResponses:
    """One tenant's entries, least recently used first, and their bytes."""

    def __init__(self) -> None:
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.total_bytes = 0

    def pop(self, response_id: str) -> None:
        entry = self.entries.pop(response_id, None)
        if entry is not None:
            self.total_bytes -= entry.size


class ResponseStore:
    """``put`` / ``get`` / ``delete`` by response id, scoped to a tenant; both bounds hold
    for each tenant's entries."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._tenants: dict[str | None, _TenantResponses] = {}

    def __len__(self) -> int:
        return sum(len(t.entries) for t in self._tenants.values())

    @property
    def total_bytes(self) -> int:
        return sum(t.total_bytes for t in self._tenants.values())

    def tenant_bytes(self, tenant: str | None) -> int:
        own = self._tenants.get(tenant)
        return 0 if own is None else own.total_bytes

    def put(self, response_id: str, entry: StoredResponse, tenant: str | None) -> bool:
        """Store ``entry`` under ``response_id``, evicting ``tenant``'s least recently used
        entries to keep its bounds; False (nothing stored) if it alone is over a bound."""
        if self.max_entries == 0 or entry.size > self.max_bytes:
            logger.warning("response %s not stored: %d bytes, a tenant's stored responses "
                           "hold at most %d bytes and %d responses "
                           "(--max-stored-response-bytes, --max-stored-responses)",
                           response_id, entry.size, self.max_bytes, self.max_entries)
            return False
        own = self._tenants.setdefault(tenant, _TenantResponses())
        own.pop(response_id)
        own.entries[response_id] = entry
        own.total_bytes += entry.size
        while len(own.entries) > self.max_entries or own.total_bytes > self.max_bytes:
            oldest = next(iter(own.entries))
            logger.debug("evicting stored response %s", oldest)
            own.pop(oldest)
        return True

    def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        """The entry of ``response_id`` if ``tenant`` created it (it becomes the most
        recently used), else None."""
        own = self._tenants.get(tenant)
        if own is None or response_id not in own.entries:
            return None
        own.entries.move_to_end(response_id)
        return own.entries[response_id]

    def delete(self, response_id: str, tenant: str | None) -> bool:
        own = self._tenants.get(tenant)
        if own is None or response_id not in own.entries:
            return False
        own.pop(response_id)
        if not own.entries:
            del self._tenants[tenant]
        return True
