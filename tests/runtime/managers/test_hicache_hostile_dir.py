"""A hostile --hicache-storage-dir, fuzzed: each example puts the four stored pages of a
prompt back as they were written, then replaces some by random junk, truncated or
oversized copies, a 1 GiB sparse file, symlinks (to /dev/zero, to another page, dangling),
directories, FIFOs, another key's page, or replaces the fan-out folder itself. Under every
prefetch policy the request answers with the tokens of an Engine without storage, without
hanging and without reading more than the pages it takes; under wait_complete it takes
exactly the intact pages before the first bad one."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm.runtime.config_checks import HICACHE_PREFETCH_POLICIES

from .test_hicache import GREEDY, POOL, plant, run_guarded

BLOCK = 64
KINDS = ("keep", "delete", "junk", "truncated", "oversized", "flipped", "sparse", "dev_zero",
         "link_to_page", "dangling", "directory", "fifo", "other_key", "folder_link",
         "folder_file")


def _doc(seed: int) -> list[int]:
    rng = random.Random(1000 + seed)
    return [rng.randrange(5, 400) for _ in range(300)]


DOCS = [_doc(i) for i in range(3)]


@pytest.fixture(scope="module")
def setup(make_module_engine, tmp_path_factory):
    """(tiered Engine, reference outputs, every page's path and pristine bytes per doc)."""
    plain = make_module_engine(max_total_tokens=4096, dtype="float32")
    want = [plain.generate(input_ids=d, sampling_params=GREEDY)["output_ids"] for d in DOCS]
    directory = tmp_path_factory.mktemp("hostile") / "kv"
    eng = make_module_engine(max_total_tokens=POOL, dtype="float32",
                             enable_hierarchical_cache=True, hicache_storage_backend="file",
                             hicache_storage_dir=str(directory),
                             hicache_storage_prefetch_policy="wait_complete")
    for d in DOCS:
        eng.generate(input_ids=d, sampling_params=GREEDY)
    hicache = eng.scheduler.cache.hicache
    hicache.tier.flush(timeout=60)
    pages = Pristine()
    for d in DOCS:
        paths = [hicache.tier.backend.path(k) for k in hicache.keys(d, None)]
        pages.append([(p, p.read_bytes()) for p in paths])
    return eng, want, pages


class Pristine(list):
    """Every doc's [(page path, bytes as written)] (a short repr in hypothesis' reports)."""

    def __repr__(self) -> str:
        return f"<{sum(map(len, self))} pristine pages>"


def _clear(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def _restore(pages: list[list[tuple[Path, bytes]]]) -> None:
    for doc_pages in pages:
        for path, data in doc_pages:
            if os.path.lexists(path.parent) and (path.parent.is_symlink()
                                                 or not path.parent.is_dir()):
                path.parent.unlink()
            path.parent.mkdir(mode=0o700, exist_ok=True)
            _clear(path)
            path.write_bytes(data)
            path.chmod(0o600)


def _mutate(path: Path, data: bytes, kind: str, rng: random.Random,
            other: tuple[Path, bytes]) -> None:
    """Make ``path`` (whose page is ``data``) hostile in the way ``kind`` says."""
    if kind in ("sparse", "dev_zero", "fifo"):
        plant(path, kind)
    elif kind == "folder_link":  # the fan-out folder: a link to a copy of it
        copy = path.parent.with_name(path.parent.name + ".copy")
        _clear(copy)
        shutil.copytree(path.parent, copy)
        shutil.rmtree(path.parent)
        os.symlink(copy, path.parent)
    elif kind == "folder_file":
        shutil.rmtree(path.parent)
        path.parent.write_bytes(b"not a folder")
    else:
        _clear(path)
        if kind == "junk":
            path.write_bytes(rng.randbytes(rng.randrange(0, 2 * len(data))))
        elif kind == "truncated":
            path.write_bytes(data[:rng.randrange(len(data))])
        elif kind == "oversized":
            path.write_bytes(data + rng.randbytes(rng.randrange(1, 4096)))
        elif kind == "flipped":
            i = rng.randrange(len(data))
            path.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
        elif kind == "link_to_page":
            os.symlink(other[0], path)
        elif kind == "dangling":
            os.symlink(path.with_name("missing"), path)
        elif kind == "directory":
            path.mkdir()
            (path / "x").write_bytes(data)
        elif kind == "other_key":
            path.write_bytes(other[1])


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.integers(0, len(DOCS) - 1),
       kinds=st.lists(st.sampled_from(KINDS), min_size=4, max_size=4),
       policy=st.sampled_from(HICACHE_PREFETCH_POLICIES), seed=st.integers(0, 2 ** 16))
def test_every_request_answers_correctly_over_a_hostile_directory(setup, doc, kinds, policy,
                                                                  seed):
    eng, want, pages = setup
    hicache = eng.scheduler.cache.hicache
    hicache.tier.flush(timeout=60)  # nothing written behind the restore
    _restore(pages)
    rng = random.Random(seed)
    other = pages[(doc + 1) % len(DOCS)][0]  # a page of another prompt, and its bytes
    for (path, data), kind in zip(pages[doc], kinds):
        if kind != "keep" and os.path.lexists(path):  # a folder mutation may have taken it
            _mutate(path, data, kind, rng, other)
    intact = 0
    for (path, _), kind in zip(pages[doc], kinds):
        if kind != "keep" or path.parent.is_symlink() or not path.parent.is_dir():
            break
        intact += 1
    hicache.prefetch_policy = policy
    assert eng.flush_cache()
    backend = hicache.tier.backend
    read_before = backend.bytes_read
    fifos = [p for p, _ in pages[doc]]
    out, meta = run_guarded(eng, DOCS[doc], fifos=fifos)
    assert out == want[doc]
    storage = meta["cached_tokens_details"]["storage"]
    if policy == "wait_complete":
        assert storage == intact * BLOCK
    assert storage <= intact * BLOCK
    largest = max(len(data) for doc_pages in pages for _, data in doc_pages)
    assert backend.bytes_read - read_before <= (intact + 1) * largest  # never unbounded
