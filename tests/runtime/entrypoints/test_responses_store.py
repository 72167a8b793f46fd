"""The stored responses (``responses_store.py``): least recently used out, within both the
count and the byte bound; a tenant sees only its own; an entry over the byte bound alone is
not stored."""

from __future__ import annotations

from radixlm.runtime.entrypoints.openai.responses_store import ResponseStore


def _put(store: ResponseStore, rid: str, tenant: str | None = None, text: str = "x") -> bool:
    return store.put({"id": rid, "output": text}, [{"role": "user", "content": text}], [],
                     tenant)


def test_least_recently_used_goes_first():
    store = ResponseStore(max_entries=2, max_bytes=1 << 20)
    _put(store, "a"), _put(store, "b")
    assert store.get("a", None) is not None  # a is now the most recently used
    _put(store, "c")
    assert store.get("b", None) is None and store.get("a", None) is not None
    assert len(store) == 2


def test_byte_bound_evicts_and_an_oversized_entry_is_not_stored():
    store = ResponseStore(max_entries=100, max_bytes=400)
    for i in range(4):
        assert _put(store, f"r{i}", text="y" * 60)
    assert store.total_bytes <= 400 and store.get("r3", None) is not None
    assert store.get("r0", None) is None
    assert not _put(store, "huge", text="z" * 500)
    assert store.get("huge", None) is None and store.get("r3", None) is not None
    assert not ResponseStore(0, 1 << 20).put({"id": "a"}, [], [], None)


def test_tenants_see_only_their_own():
    store = ResponseStore(max_entries=10, max_bytes=1 << 20)
    _put(store, "a", tenant="alice")
    assert store.get("a", "bob") is None and store.get("a", None) is None
    assert not store.delete("a", "bob")
    assert store.get("a", "alice") is not None
    assert store.delete("a", "alice") and store.get("a", "alice") is None
    assert store.total_bytes == 0
