"""--enable-hierarchical-cache with the file backend, on Engines with the tiny model and a
640-token pool that four 300-token prompts overflow: prefixes loaded back from storage are
token-exact (greedy, float32, against an Engine that never evicts); bad pages, a read-only
directory, a restart, a second Engine on the same directory, other namespaces, another
model and a weight update behave as docs/design.md says."""

from __future__ import annotations

import errno
import os
import random
import threading
from pathlib import Path

import pytest

from radixlm.radix_cache.kv_events import MEDIUM_CPU, MEDIUM_DISK, KVEventBatch, KVEventRecorder
from radixlm.radix_cache.prefix_index import PrefixIndex
from radixlm.radix_cache.storage import file_backend

POOL = 640


def _doc(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 400) for _ in range(300)]


DOCS = [_doc(i) for i in range(4)]
GREEDY = {"temperature": 0, "max_new_tokens": 6}
WHOLE_PAGES = 256  # 300 tokens hold four 64-token storage pages


def _tiered(make, directory, **kw):
    return make(max_total_tokens=POOL, dtype="float32", enable_hierarchical_cache=True,
                hicache_storage_backend="file", hicache_storage_dir=str(directory),
                hicache_storage_prefetch_policy="wait_complete", **kw)


def _run(eng, doc, **kw):
    out = eng.generate(input_ids=doc, sampling_params=GREEDY, **kw)
    return out["output_ids"], out["meta_info"]


def _written(eng):
    """Wait for the background writer; the tier's counters."""
    tier = eng.scheduler.cache.hicache.tier
    tier.flush(timeout=60)
    return tier.stats


def plant(path: Path, kind: str) -> None:
    """Put a hostile entry where a page file was: a FIFO (an open without O_NONBLOCK waits
    for a writer), a symlink to /dev/zero (endless) or a 256 MiB sparse file."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    else:
        with open(path, "wb") as f:
            f.truncate(256 << 20)


def run_guarded(eng, doc, fifos=(), **kw):
    """``_run`` on a thread: a request still waiting after 120 s (on a FIFO) is released by
    opening the FIFOs' write ends, and the test fails (a hang guard, not a timing check)."""
    got: list = []
    worker = threading.Thread(target=lambda: got.append(_run(eng, doc, **kw)), daemon=True)
    worker.start()
    worker.join(120)
    hung = worker.is_alive()
    for _ in range(1200 if hung else 0):  # a reader blocked in open() gets EOF
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass  # no reader waits on it (or it is no FIFO now)
        worker.join(0.05)
        if not worker.is_alive():
            break
    assert not hung, "the request hung on a page file"
    return got[0]


@pytest.fixture(scope="module")
def want(make_module_engine):
    """Each doc's greedy output from an Engine whose pool holds them all."""
    eng = make_module_engine(max_total_tokens=4096, dtype="float32")
    return [_run(eng, d)[0] for d in DOCS]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evicted_prefixes_come_back_from_storage_token_exact(make_engine, tmp_path, want,
                                                             policy):
    eng = _tiered(make_engine, tmp_path, hicache_write_policy=policy)
    for doc, w in zip(DOCS, want):
        assert _run(eng, doc)[0] == w
    assert eng.get_server_info()["evicted_tokens"] > 0
    for i in (0, 1):  # both were evicted by the ones after them
        out, meta = _run(eng, DOCS[i])
        assert out == want[i]
        details = meta["cached_tokens_details"]
        assert details["storage"] > 0 and meta["cached_tokens"] == WHOLE_PAGES
        assert details["device"] + details["storage"] == meta["cached_tokens"]
    info = eng.get_server_info()
    assert info["hierarchical_cache"]["write_policy"] == policy
    assert info["hicache_storage_hit_tokens"] > 0
    assert info["hicache_storage_bytes_read"] > 0 and info["hicache_storage_bytes_written"] > 0


def test_bad_pages_and_a_read_only_directory_mean_recompute(make_engine, tmp_path, want,
                                                            monkeypatch):
    eng = _tiered(make_engine, tmp_path)
    for doc in DOCS:
        _run(eng, doc)
    assert _written(eng)["pages_written"] == 4 * len(DOCS)
    hicache = eng.scheduler.cache.hicache
    paths = [hicache.tier.backend.path(k) for k in hicache.keys(DOCS[0], None)]
    raw = bytearray(paths[1].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    paths[1].write_bytes(bytes(raw))  # one flipped byte
    paths[2].write_bytes(paths[2].read_bytes()[:1000])  # truncated
    paths[3].unlink()  # deleted
    out, meta = _run(eng, DOCS[0])
    assert out == want[0]
    assert meta["cached_tokens_details"]["storage"] == 64  # page 0 only
    stats = _written(eng)
    assert stats["pages_corrupt"] == 1  # the truncated one: its tokens are in the checksum
    assert eng.flush_cache()  # write_through wrote the recomputed pages back, whole
    out, meta = _run(eng, DOCS[0])
    assert out == want[0] and meta["cached_tokens_details"]["storage"] == WHOLE_PAGES

    def read_only(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(file_backend.os, "replace", read_only)
    new_doc = _doc(99)
    first = _run(eng, new_doc)[0]  # its pages cannot be written: served all the same
    assert _written(eng)["writes_failed"] >= 4
    assert eng.flush_cache()
    out, meta = _run(eng, new_doc)
    assert out == first and meta["cached_tokens_details"]["storage"] == 0
    out, meta = _run(eng, DOCS[2])  # pages written before still load
    assert out == want[2] and meta["cached_tokens_details"]["storage"] > 0


def test_a_restarted_engine_and_a_second_one_reuse_the_directory(make_engine, tmp_path, want):
    first = _tiered(make_engine, tmp_path)
    assert _run(first, DOCS[0])[0] == want[0]
    first.shutdown()  # writes what is still queued
    restarted, other = _tiered(make_engine, tmp_path), _tiered(make_engine, tmp_path)
    out, meta = _run(restarted, DOCS[0])  # its very first request
    assert out == want[0] and meta["cached_tokens_details"]["storage"] == WHOLE_PAGES
    assert _run(restarted, DOCS[1])[0] == want[1]
    _written(restarted)
    out, meta = _run(other, DOCS[1])  # written by the other Engine, still running
    assert out == want[1] and meta["cached_tokens_details"]["storage"] == WHOLE_PAGES


def test_namespaces_models_and_weight_versions_never_share_pages(make_engine, tmp_path, want,
                                                                 tiny_llama_dir,
                                                                 tiny_qwen2_dir):
    eng = _tiered(make_engine, tmp_path, model_path=str(tiny_llama_dir))
    _run(eng, DOCS[0], extra_key="a")
    _written(eng)

    def storage_tokens(**kw):
        assert eng.flush_cache()  # an empty pool: whatever is cached comes from storage
        out, meta = _run(eng, DOCS[0], **kw)
        assert out == want[0]
        return meta["cached_tokens_details"]["storage"]

    assert storage_tokens(extra_key="b") == 0
    assert storage_tokens() == 0
    assert storage_tokens(cache_salt="a") == 0
    assert storage_tokens(extra_key="a") == WHOLE_PAGES  # the control
    ok, message, _ = eng.update_weights_from_disk(str(tiny_llama_dir), weight_version="v2")
    assert ok, message
    assert storage_tokens(extra_key="a") == 0  # computed by the old weights: not read
    qwen = _tiered(make_engine, tmp_path, model_path=str(tiny_qwen2_dir))
    meta = _run(qwen, DOCS[0], extra_key="a")[1]
    assert meta["cached_tokens_details"]["storage"] == 0


@pytest.mark.parametrize("flags, field", [
    ({"enable_hierarchical_cache": True}, "enable_hierarchical_cache needs"),
    ({"hicache_storage_backend": "file"}, "needs --enable-hierarchical-cache"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake"},
     "hicache_storage_backend must be one of"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "file",
      "hicache_ratio": 2.0}, "hicache_ratio: radixlm has no separate host-memory tier"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "file",
      "hicache_write_policy": "write_through_selective"}, "hicache_write_policy must be"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "file",
      "hicache_storage_prefetch_policy": "eager"}, "hicache_storage_prefetch_policy must be"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "file",
      "disable_radix_cache": True}, "needs the radix cache"),
])
def test_bad_flags_are_refused_naming_them(flags, field):
    from radixlm.runtime.config import ServerArgs

    with pytest.raises(ValueError, match=field):
        ServerArgs(**flags).validate()


def test_pages_written_to_storage_are_kv_events_of_the_trees_chain(make_engine, tmp_path):
    """Each page the tier writes is a BlockStored with medium DISK, hashed with the tree's
    chain: a consumer's index matches the stored prefix of the prompt (for every replica)."""
    eng = _tiered(make_engine, tmp_path, hicache_write_policy="write_through")
    recorder = KVEventRecorder(1, MEDIUM_CPU)
    eng.scheduler.cache.hicache.attach_events(recorder)
    _run(eng, DOCS[0])
    _written(eng)
    disk = [e for e in recorder.take() if e.medium == MEDIUM_DISK]
    assert sum(len(e.token_ids) for e in disk) == WHOLE_PAGES
    index = PrefixIndex(2, 1)
    index.apply(1, KVEventBatch(ts=0.0, events=disk))
    assert index.match_storage(DOCS[0]) == WHOLE_PAGES
    assert index.match_storage(DOCS[1]) == 0 and index.match(DOCS[0]) == [0, 0]


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "sparse"])
def test_fifo_dev_zero_and_sparse_pages_are_refused_unread_under_wait_complete(
        make_engine, tmp_path, want, kind):
    """The README's wait_complete: pages 1-3 of a prompt replaced by hostile files. The
    request answers with page 0 from storage, the first hostile page refused by its type or
    its size before a byte of it is read (so the loader stops there: misses)."""
    eng = _tiered(make_engine, tmp_path)
    for doc in DOCS:
        _run(eng, doc)
    _written(eng)
    assert eng.flush_cache()
    hicache = eng.scheduler.cache.hicache
    backend = hicache.tier.backend
    paths = [backend.path(k) for k in hicache.keys(DOCS[0], None)]
    for path in paths[1:]:
        plant(path, kind)
    read_before, page0 = backend.info().get("bytes_read", 0), paths[0].stat().st_size
    out, meta = run_guarded(eng, DOCS[0], fifos=paths[1:])
    assert out == want[0] and meta["cached_tokens_details"]["storage"] == 64
    info = backend.info()  # /get_server_info's hierarchical_cache.storage
    assert info.get("refused_files") == 1 and info.get("bytes_read", 0) - read_before == page0
    _written(eng)  # deleted, then written again whole from the recomputed tokens
    assert paths[1].is_file() and not paths[1].is_symlink()
    assert paths[1].stat().st_size == page0
    out, meta = run_guarded(eng, _doc(7), fifos=paths[1:])  # a prompt with no stored pages
    assert meta["cached_tokens_details"]["storage"] == 0


def test_the_default_policy_waits_for_pages_that_load_faster_than_they_compute(
        make_engine, tmp_path, want, monkeypatch):
    """An idle server, its prompt's pages evicted to storage. Each page read takes 0.2 s
    (an injected delay) and computing is measured at 10 ms a token (pinned: the tiny model
    computes about as fast as it loads; a real one does not): loading 4 pages (0.8 s) beats
    computing 256 tokens (2.6 s), so the default waits and takes them all; best_effort
    schedules the request before the first page arrives and computes everything."""
    eng = make_engine(max_total_tokens=POOL, dtype="float32", enable_hierarchical_cache=True,
                      hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    hicache = eng.scheduler.cache.hicache
    default = eng.get_server_info()["hierarchical_cache"]["prefetch_policy"]
    for doc in DOCS:
        _run(eng, doc)
    _written(eng)
    assert hicache.compute.seconds_per_token > 0  # the scheduler times its prefills
    backend = hicache.tier.backend
    read = backend.get

    def slow_read(key, *size):
        threading.Event().wait(0.2)
        return read(key, *size)

    class PinnedRate:  # computing measured at 10 ms a token, whatever the steps take
        seconds_per_token = 0.01

        def observe(self, tokens, seconds):
            pass

    monkeypatch.setattr(backend, "get", slow_read)
    monkeypatch.setattr(hicache, "compute", PinnedRate(), raising=False)
    storage = {}
    for policy in (default, "best_effort"):
        hicache.prefetch_policy = policy
        assert eng.flush_cache()
        out, meta = _run(eng, DOCS[0])
        assert out == want[0]
        storage[policy] = meta["cached_tokens_details"]["storage"]
    assert storage[default] == WHOLE_PAGES
    assert hicache.tier.page_seconds >= 0.2  # and the prefetch thread its reads
    assert storage == {"auto": WHOLE_PAGES, "best_effort": 0}
