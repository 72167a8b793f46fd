"""The stored responses (``responses_store.py``): least recently used out, within both the
count and the byte bound, each tenant within its own; a tenant sees only its own; an entry
over the byte bound alone is not stored; an entry's size is what it keeps in memory."""

from __future__ import annotations

import sys

import msgspec

from radixlm.runtime.entrypoints.openai.responses_store import ResponseStore, StoredResponse


def _entry(text: str = "x", items: list | None = None) -> StoredResponse:
    return StoredResponse.of({"id": "r", "output": text}, [{"role": "user", "content": text}],
                             items or [])


def _put(store: ResponseStore, rid: str, tenant: str | None = None, text: str = "x") -> bool:
    return store.put(rid, _entry(text), tenant)


def test_least_recently_used_goes_first():
    store = ResponseStore(max_entries=2, max_bytes=1 << 20)
    _put(store, "a"), _put(store, "b")
    assert store.get("a", None) is not None  # a is now the most recently used
    _put(store, "c")
    assert store.get("b", None) is None and store.get("a", None) is not None
    assert len(store) == 2


def test_byte_bound_evicts_and_an_oversized_entry_is_not_stored():
    size = _entry("y" * 60).size
    store = ResponseStore(max_entries=100, max_bytes=3 * size + 10)
    for i in range(4):
        assert _put(store, f"r{i}", text="y" * 60)
    assert store.total_bytes <= 3 * size + 10 and store.get("r3", None) is not None
    assert store.get("r0", None) is None
    assert not _put(store, "huge", text="z" * 4 * size)
    assert store.get("huge", None) is None and store.get("r3", None) is not None
    assert not ResponseStore(0, 1 << 20).put("a", _entry(), None)


def test_tenants_see_only_their_own():
    store = ResponseStore(max_entries=10, max_bytes=1 << 20)
    _put(store, "a", tenant="alice")
    assert store.get("a", "bob") is None and store.get("a", None) is None
    assert not store.delete("a", "bob")
    assert store.get("a", "alice") is not None
    assert store.delete("a", "alice") and store.get("a", "alice") is None
    assert store.total_bytes == 0


def test_a_tenant_filling_the_store_evicts_only_its_own():
    """Bob storing far past both bounds leaves Alice's response where it was (one LRU
    for all tenants let him evict it: issue 55)."""
    store = ResponseStore(max_entries=4, max_bytes=20 * _entry().size)
    _put(store, "alice-1", tenant="alice")
    for i in range(45):
        _put(store, f"bob-{i}", tenant="bob")
    assert store.get("alice-1", "alice") is not None
    assert store.get("bob-44", "bob") is not None and store.get("bob-0", "bob") is None
    assert len(store) == 5
    for i in range(30):  # the byte bound, per tenant as well
        _put(store, f"big-{i}", tenant="bob", text="b" * 200)
    assert store.get("alice-1", "alice") is not None
    assert store.tenant_bytes("bob") <= store.max_bytes


def test_size_counts_what_is_stored():
    """An entry is its JSON bytes, and its size is what they take in memory: a field the
    server ignores is not kept, so it cannot make the entry larger than counted."""
    items = [{"id": "msg_1", "type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "hi " * 1000}]}]
    entry = _entry("answer", items)
    held = [entry.response, *entry.messages, *entry.input_items, *entry.item_ids]
    assert all(isinstance(x, (bytes, str)) for x in held)
    assert entry.size >= sum(sys.getsizeof(x) for x in held)
    assert entry.size < sum(sys.getsizeof(x) for x in held) + 1024
    assert msgspec.json.decode(entry.input_items[0]) == items[0]
