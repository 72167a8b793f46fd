"""The storage tier's pieces without a model: page keys, the page format, the file backend
(atomic writes, LRU size bound, failures as misses) and the tier's reads of bad pages."""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

import pytest
import torch

from radixlm.radix_cache.storage import file_backend
from radixlm.radix_cache.storage.file_backend import FileStorage
from radixlm.radix_cache.storage.page_format import CorruptPage, decode_page, encode_page
from radixlm.radix_cache.storage.page_keys import model_identity, page_keys
from radixlm.radix_cache.storage.tier import StorageTier

SHAPE = (4, 8, 2, 4)  # [2 * layers, tokens, kv heads, head_dim]
LAYOUT = {"kv_dtype": "torch.float32", "layers": 2}


def _page(seed: int = 0) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(range(seed, seed + 8)), torch.randn(SHAPE, generator=g)


def _model_dir(tmp_path: Path, name: str = "m") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text('{"hidden_size": 8}')
    (d / "model.safetensors").write_bytes(b"weights")
    return d


# --- keys ------------------------------------------------------------------------------------
def test_keys_chain_tokens_model_namespace_and_weight_version(tmp_path):
    d = _model_dir(tmp_path)
    ident = model_identity(str(d), "default", LAYOUT)
    tokens = list(range(40))
    keys = page_keys(ident, None, tokens, 16)
    assert len(keys) == 2 and len(set(keys)) == 2  # 40 tokens: two whole 16-token pages
    assert page_keys(ident, None, tokens[:32] + [99], 16) == keys  # past the pages: same
    # a page's key names its whole prefix: a change in page 0 changes page 1's key
    assert page_keys(ident, None, [7] + tokens[1:], 16)[1] != keys[1]
    others = [
        page_keys(ident, "extra_key=a", tokens, 16),  # another namespace
        page_keys(model_identity(str(d), "v2", LAYOUT), None, tokens, 16),  # weight version
        page_keys(model_identity(str(d), "default", {**LAYOUT, "kv_dtype": "bf16"}), None,
                  tokens, 16),  # another KV layout
        page_keys(model_identity(str(_model_dir(tmp_path, "other")), "default", LAYOUT),
                  None, tokens, 16),  # another checkpoint directory
    ]
    for other in others:
        assert not set(other) & set(keys)
    (d / "model.safetensors").write_bytes(b"new weights")  # rewritten in place
    assert model_identity(str(d), "default", LAYOUT) != ident


# --- the page format -------------------------------------------------------------------------
def test_page_round_trip_and_every_mismatch_is_refused():
    tokens, kv = _page()
    data = encode_page("a" * 32, tokens, kv)
    assert torch.equal(decode_page(data, "a" * 32, tokens, torch.float32, SHAPE), kv)
    bad = [
        (data[:-1], "a" * 32, tokens, torch.float32, SHAPE),  # truncated
        (data[:40], "a" * 32, tokens, torch.float32, SHAPE),
        (b"", "a" * 32, tokens, torch.float32, SHAPE),
        (data[:100] + bytes([data[100] ^ 1]) + data[101:], "a" * 32, tokens, torch.float32,
         SHAPE),  # one bit flipped
        (data, "b" * 32, tokens, torch.float32, SHAPE),  # a page renamed to another key
        (data, "a" * 32, tokens[::-1], torch.float32, SHAPE),  # other tokens
        (data, "a" * 32, tokens, torch.bfloat16, SHAPE),  # another dtype
        (data, "a" * 32, tokens, torch.float32, (2, 8, 4, 4)),  # another layout
    ]
    for args in bad:
        with pytest.raises(CorruptPage):
            decode_page(*args)


# --- the file backend ------------------------------------------------------------------------
def test_file_storage_put_get_delete_and_private_modes(tmp_path):
    fs = FileStorage(str(tmp_path / "s"), 1 << 20)
    key = "ab" + "0" * 30
    assert fs.get(key, 5) is None and not fs.exists(key)
    assert fs.put(key, b"hello")
    assert fs.get(key, 5) == b"hello" and fs.exists(key)
    assert fs.path(key).parent.name == "ab"
    assert (fs.root.stat().st_mode & 0o777) == 0o700
    assert (fs.path(key).stat().st_mode & 0o777) == 0o600
    assert not [p for p in fs.path(key).parent.iterdir() if p.name.startswith(".tmp-")]
    fs.delete(key)
    assert fs.get(key, 5) is None


def test_file_storage_stays_under_its_size_deleting_least_recently_used(tmp_path):
    fs = FileStorage(str(tmp_path), 10_000)
    keys = [f"{i:032x}" for i in range(12)]
    for i, key in enumerate(keys):
        assert fs.put(key, bytes(1000))
        os.utime(fs.path(key), (1000 + i, 1000 + i))  # written in order, one second apart
        if i == 3:
            fs.get(keys[0], 1000)  # read: the most recently used now
            assert os.stat(fs.path(keys[0])).st_mtime > 2000
    total = sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))
    assert total <= 10_000
    assert fs.exists(keys[0]) and fs.exists(keys[-1])  # recently read, just written
    assert not fs.exists(keys[1])  # the oldest unread one went first
    assert fs.trimmed_files >= 2


@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC])
def test_a_read_only_or_full_directory_is_a_failed_write_not_an_error(tmp_path, monkeypatch,
                                                                      err, caplog):
    fs = FileStorage(str(tmp_path), 1 << 20)

    def fail(*a, **k):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(file_backend.os, "replace", fail)
    assert not fs.put("cd" + "0" * 30, b"x")
    assert not fs.put("cd" + "1" * 30, b"y")
    assert fs.write_errors == 2 and not fs.exists("cd" + "0" * 30)
    assert not list(tmp_path.rglob(".tmp-*"))  # the temporary files were removed
    assert sum("cannot write" in r.message for r in caplog.records) == 1  # warned once


def test_concurrent_writers_of_one_page_leave_a_whole_page(tmp_path):
    """Threads with their own backends (like servers sharing the directory) write the same
    key over and over while a reader checks every read decodes."""
    tokens, kv = _page(1)
    key = "ef" + "2" * 30
    data = encode_page(key, tokens, kv)
    stop, errors = threading.Event(), []

    def writer():
        fs = FileStorage(str(tmp_path), 1 << 30)
        while not stop.is_set():
            fs.put(key, data)

    def reader():
        fs = FileStorage(str(tmp_path), 1 << 30)
        for _ in range(300):
            got = fs.get(key, len(data))
            if got is not None:
                try:
                    decode_page(got, key, tokens, torch.float32, SHAPE)
                except CorruptPage as e:
                    errors.append(e)
        stop.set()

    threads = [threading.Thread(target=writer) for _ in range(3)] + [threading.Thread(
        target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert decode_page(FileStorage(str(tmp_path), 1 << 30).get(key, len(data)), key, tokens,
                       torch.float32, SHAPE).equal(kv)


def test_a_directory_group_or_others_can_reach_is_made_private_with_a_warning(tmp_path,
                                                                               caplog):
    d = tmp_path / "kv"
    d.mkdir()
    d.chmod(0o777)  # any local user could plant FIFOs or links to /dev/zero in it
    FileStorage(str(d), 1 << 20)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert any("was mode 0777" in r.message and r.levelname == "WARNING"
               for r in caplog.records)


def test_a_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    uid = d.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)  # the server runs as another user
    with pytest.raises(ValueError, match=r"--hicache-storage-dir .* belongs to uid"):
        FileStorage(str(d), 1 << 20)


def _plant(fs: FileStorage, key: str, kind: str, size: int, tmp_path: Path) -> None:
    path = fs.path(key)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "link_to_page":  # a whole page of the right size, elsewhere
        (tmp_path / "elsewhere").write_bytes(bytes(size))
        os.symlink(tmp_path / "elsewhere", path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "sparse":
        with open(path, "wb") as f:
            f.truncate(1 << 30)
    elif kind == "short":
        path.write_bytes(bytes(size - 1))
    elif kind == "linked_folder":  # the fan-out folder is a link to a folder of pages
        other = tmp_path / "other"
        other.mkdir()
        (other / path.name).write_bytes(bytes(size))
        path.parent.rmdir()
        os.symlink(other, path.parent)
    elif kind == "open_folder":  # a fan-out folder others can write
        path.write_bytes(bytes(size))
        path.parent.chmod(0o777)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "link_to_page", "directory", "sparse",
                                  "short", "linked_folder", "open_folder"])
def test_an_entry_that_is_not_a_private_page_of_the_right_size_is_refused_unread(tmp_path,
                                                                                  kind):
    """Opened O_NOFOLLOW | O_NONBLOCK (a FIFO's open does not wait for a writer), checked
    with fstat before a byte is read: refused, counted, and deleted where it can be."""
    fs = FileStorage(str(tmp_path / "kv"), 1 << 30)
    key, size = "9a" + "7" * 30, 4096
    _plant(fs, key, kind, size, tmp_path)
    assert fs.get(key, size) is None
    assert fs.refused_files == 1 and fs.bytes_read == 0
    if kind == "open_folder":  # not ours to clean: left, never read or written
        assert not fs.put(key, bytes(size)) and fs.get(key, size) is None
        return
    if kind == "linked_folder":  # the link is removed, what it pointed to left alone
        assert (tmp_path / "other" / fs.path(key).name).stat().st_size == size
    assert not os.path.lexists(fs.path(key)) and fs.size(key) is None
    assert fs.put(key, bytes(size)) and fs.get(key, size) == bytes(size)


# --- the tier ------------------------------------------------------------------------------
def test_tier_writes_in_background_and_a_corrupt_page_is_a_deleted_miss(tmp_path):
    fs = FileStorage(str(tmp_path), 1 << 20)
    tier = StorageTier(fs, torch.float32, SHAPE)
    try:
        pages = [_page(i) for i in range(3)]
        keys = [f"{i:032x}" for i in range(3)]
        for key, (tokens, kv) in zip(keys, pages):
            assert tier.write(key, tokens, kv)
        tier.flush(timeout=30)
        assert tier.stats["pages_written"] == 3 and tier.known(keys[0])
        raw = fs.path(keys[1]).read_bytes()
        fs.path(keys[1]).write_bytes(raw[:-7])  # truncated behind the tier's back
        load = tier.start_load(keys, [p[0] for p in pages], 0)
        assert load.done.wait(30)
        assert len(load.pages) == 1 and load.pages[0].equal(pages[0][1])  # stops at page 1
        # refused by its size before a byte was read, and deleted
        assert fs.refused_files == 1 and tier.stats["pages_missed"] == 1
        assert not fs.exists(keys[1]) and fs.bytes_read == fs.size(keys[0])  # page 0 only
        assert not tier.known(keys[1])  # written again when next cached
        tier.release(load)
    finally:
        tier.close()
