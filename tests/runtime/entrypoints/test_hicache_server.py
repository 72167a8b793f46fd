"""Two ``radixlm serve`` processes on one --hicache-storage-dir, with tenants from an API-key
file and 640-token pools: a page one server wrote is read by the other (the same tenant
only), both write the same pages at once without harm, and the tier shows in meta_info,
the OpenAI usage, /get_server_info and /metrics."""

from __future__ import annotations

import random
import re
import threading
import time

import httpx
import openai
import pytest

from radixlm.runtime.entrypoints.server_process import ServerProcess

KEYS = {"alice": "sk-alice-1", "bob": "sk-bob-2", "admin": "sk-admin-3"}
PAGES = 256  # 300 tokens hold four 64-token storage pages


def _doc(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 400) for _ in range(300)]


def _auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    d = tmp_path_factory.mktemp("hicache")
    (d / "keys.txt").write_text(f"{KEYS['alice']} alice\n{KEYS['bob']} bob\n")
    flags = ["--api-key", str(d / "keys.txt"), "--admin-api-key", KEYS["admin"],
             "--max-total-tokens", "640", "--dtype", "float32", "--enable-metrics",
             "--log-level", "warning", "--cpu-threads", "1", "--enable-hierarchical-cache",
             "--hicache-storage-backend", "file", "--hicache-storage-dir", str(d / "kv"),
             "--hicache-storage-prefetch-policy", "wait_complete"]
    started = [ServerProcess(flags, d / f"server{i}.log") for i in range(2)]
    try:
        for srv in started:
            srv.wait_healthy(headers=_auth("alice"))
        yield started
    finally:
        for srv in started:
            srv.stop()


def _generate(srv: ServerProcess, who: str, ids: list[int]) -> tuple[list[int], dict]:
    resp = httpx.post(srv.url + "/generate", headers=_auth(who), timeout=120, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return body["output_ids"], body["meta_info"]


def _info(srv: ServerProcess) -> dict:
    return httpx.get(srv.url + "/get_server_info", headers=_auth("admin"), timeout=30).json()


def _written(srv: ServerProcess) -> None:
    """Until the server's writer has nothing queued."""
    deadline = time.monotonic() + 60
    while _info(srv).get("hicache_storage_pending_write_bytes", 1) > 0:
        assert time.monotonic() < deadline, "pages still queued after 60 s"
        time.sleep(0.05)


def test_a_page_written_by_one_server_is_read_by_the_other_same_tenant_only(servers):
    a, b = servers
    doc = _doc(0)
    want, meta = _generate(a, "alice", doc)
    assert meta["cached_tokens_details"] == {"device": 0, "storage": 0}
    _written(a)
    out, meta = _generate(b, "bob", doc)  # another tenant: nothing to read
    assert meta["cached_tokens_details"]["storage"] == 0
    out, meta = _generate(b, "alice", doc)
    assert out == want and meta["cached_tokens_details"] == {"device": 0, "storage": PAGES}
    info = _info(b)
    assert info["hierarchical_cache"]["storage"]["backend"] == "file"
    assert info["hicache_storage_hit_tokens"] == PAGES


def test_both_servers_writing_the_same_pages_at_once(servers):
    a, b = servers
    doc = _doc(1)
    outs: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i, s=s: outs.__setitem__(
        i, _generate(s, "alice", doc)[0])) for i, s in enumerate(servers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert outs[0] == outs[1]
    _written(a)
    _written(b)
    for other in (2, 3, 4):  # push doc out of a's pool
        _generate(a, "alice", _doc(other))
    out, meta = _generate(a, "alice", doc)
    assert out == outs[0] and meta["cached_tokens_details"]["storage"] == PAGES
    assert _info(a)["hicache_storage_pages_corrupt"] == 0


def test_openai_usage_and_metrics_count_storage_hits(servers):
    a, _ = servers
    doc = _doc(5)
    client = openai.OpenAI(base_url=a.url + "/v1", api_key=KEYS["alice"])
    first = client.completions.create(model="default", prompt=doc, max_tokens=2,
                                      temperature=0)
    _written(a)
    for other in (6, 7, 8):
        _generate(a, "alice", _doc(other))
    again = client.completions.create(model="default", prompt=doc, max_tokens=2,
                                      temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == PAGES
    text = httpx.get(a.url + "/metrics", headers=_auth("admin"), timeout=30).text

    def value(pattern: str) -> float:
        m = re.search(rf"^radixlm:{pattern} (\S+)$", text, re.M)
        assert m, pattern
        return float(m.group(1))

    assert value(r'cache_tier_hit_tokens_total\{tier="storage"\}') >= PAGES
    assert value(r'cache_tier_bytes_total\{direction="read",tier="storage"\}') > 0
    assert value(r'cache_tier_bytes_total\{direction="write",tier="storage"\}') > 0
    assert value(r'cache_tier_storage_pages_total\{outcome="written"\}') > 0
