"""Tenants from an API-key file (``--api-key FILE`` of ``key tenant`` lines): each
tenant's requests live in its own radix-cache namespace, which no ``extra_key`` /
``cache_salt`` leaves, and the cache hit rate is a metric by namespace (never by salt)."""

from __future__ import annotations

import re

import httpx
import pytest

from radixlm.runtime.entrypoints.auth import load_api_keys
from radixlm.runtime.entrypoints.server_process import ServerProcess

KEYS = {"alice": "sk-alice-1", "bob": "sk-bob-2"}
KEY_FILE = f"""# radixlm tenants
{KEYS["alice"]} alice

{KEYS["bob"]}   bob   # a trailing comment
"""
# the tiny model's tokenizer: about one token per short word; 200+ tokens
LONG = " ".join(f"w{i % 37} and the {i}" for i in range(120))
SALT = "very-secret-salt-42"


def _auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tenants")
    (d / "keys.txt").write_text(KEY_FILE)
    srv = ServerProcess(["--api-key", str(d / "keys.txt"), "--log-level", "warning",
                         "--max-total-tokens", "8192"], d / "server.log")
    srv.wait_healthy(headers=_auth("alice"))
    yield srv
    srv.stop()


def _cached(srv: ServerProcess, tenant: str, text: str, **fields) -> int:
    resp = httpx.post(srv.url + "/generate", headers=_auth(tenant), timeout=60, json={
        "text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, **fields})
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]
    assert meta["prompt_tokens"] > 150
    return meta["cached_tokens"]


def test_tenants_do_not_share_kv(server):
    assert _cached(server, "alice", LONG) == 0
    assert _cached(server, "bob", LONG) == 0  # the same prompt, another tenant
    assert _cached(server, "alice", LONG) > 150  # alice's repeat finds her prefix
    assert _cached(server, "bob", LONG) > 150


def test_extra_key_stays_inside_the_tenant(server):
    text = "other " + LONG
    assert _cached(server, "bob", text) == 0
    # whatever alice sends as extra_key / cache_salt, she cannot reach bob's namespace
    for fields in ({"extra_key": "tenant=bob"}, {"cache_salt": "bob"}, {"extra_key": "bob"},
                   {"extra_key": "tenant=bob", "cache_salt": "x"}):
        assert _cached(server, "alice", text, **fields) == 0, fields
    # a salt splits a tenant's own namespace: shared only with the same salt
    assert _cached(server, "alice", text, cache_salt=SALT) == 0
    assert _cached(server, "alice", text, cache_salt=SALT) > 150
    assert _cached(server, "alice", text) == 0
    assert _cached(server, "alice", text, extra_key="tenant=bob") > 150


def test_openai_route_uses_the_tenant(server):
    body = {"prompt": "third " + LONG, "max_tokens": 1, "temperature": 0}

    def cached(tenant: str) -> int:
        resp = httpx.post(server.url + "/v1/completions", headers=_auth(tenant), json=body,
                          timeout=60)
        assert resp.status_code == 200, resp.text
        details = resp.json()["usage"].get("prompt_tokens_details") or {}
        return details.get("cached_tokens", 0)

    assert cached("alice") == 0
    assert cached("bob") == 0
    assert cached("alice") > 150


def test_wrong_key_is_401(server):
    resp = httpx.post(server.url + "/generate", json={"text": "hi"},
                      headers={"Authorization": "Bearer sk-alice-"})
    assert resp.status_code == 401


def test_namespace_metrics(server):
    _cached(server, "bob", "metric " + LONG, extra_key=SALT)
    text = httpx.get(server.url + "/metrics").text
    assert SALT not in text

    def value(name: str, label: str) -> float:
        m = re.search(rf'^radixlm:{name}(?:_total)?{{namespace="{label}"}} (\S+)$', text, re.M)
        assert m, (name, label)
        return float(m.group(1))

    for tenant in ("alice", "bob"):
        cached = value("namespace_cached_prompt_tokens", f"tenant:{tenant}")
        computed = value("namespace_computed_prompt_tokens", f"tenant:{tenant}")
        assert cached > 150 and computed > 150
        rate = value("namespace_cache_hit_rate", f"tenant:{tenant}")
        assert rate == pytest.approx(cached / (cached + computed))
    info = httpx.get(server.url + "/get_server_info", headers=_auth("bob")).json()
    assert set(info["namespace_cache"]) == {"tenant:alice", "tenant:bob"}
    assert "api_key" not in info


def test_key_file_parsing(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(KEY_FILE)
    parsed = load_api_keys(str(keys))
    assert sorted(parsed.values()) == ["alice", "bob"]
    assert load_api_keys("sk-plain") != parsed and list(load_api_keys("sk-plain").values()) == [
        None]
    for bad, why in [("k1 alice extra\n", "want 'key tenant'"), ("k1\n", "want 'key tenant'"),
                     ("k1 a/b\n", "tenant names"), ("k1 a\nk1 b\n", "listed twice"),
                     ("# nothing\n\n", "no 'key tenant' lines")]:
        keys.write_text(bad)
        with pytest.raises(ValueError, match=why):
            load_api_keys(str(keys))
