"""Tenants from an API-key file (``--api-key FILE`` of ``key tenant`` lines): each
tenant's requests live in its own radix-cache namespace, which no ``extra_key`` /
``cache_salt`` leaves, and the cache hit rate is a metric by namespace (never by salt).
Tenants are not admins (``--admin-api-key``): the admin routes refuse them, their rids and
aborts reach only their own requests, ``/get_server_info`` shows them only their own
figures, and weights load only from under ``--weights-root``."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading

import httpx
import pytest

from radixlm.runtime.entrypoints.auth import load_api_keys
from radixlm.runtime.entrypoints.server_process import ServerProcess

KEYS = {"alice": "sk-alice-1", "bob": "sk-bob-2", "admin": "sk-admin-3"}
KEY_FILE = f"""# radixlm tenants
{KEYS["alice"]} alice

{KEYS["bob"]}   bob   # a trailing comment
"""
# the tiny model's tokenizer: about one token per short word; 200+ tokens
LONG = " ".join(f"w{i % 37} and the {i}" for i in range(120))
SALT = "very-secret-salt-42"
STORE_SIZE = 4  # stored responses per tenant


def _auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def tenants_dir(tmp_path_factory, tiny_llama_dir):
    """The key file, and the tiny model copied under the weights root."""
    d = tmp_path_factory.mktemp("tenants")
    (d / "keys.txt").write_text(KEY_FILE)
    shutil.copytree(tiny_llama_dir, d / "weights" / "tiny")
    return d


@pytest.fixture(scope="module")
def server(tenants_dir):
    d = tenants_dir
    srv = ServerProcess(["--api-key", str(d / "keys.txt"), "--log-level", "warning",
                         "--admin-api-key", KEYS["admin"], "--weights-root", str(d / "weights"),
                         "--model-path", str(d / "weights" / "tiny"),
                         "--max-total-tokens", "8192",
                         "--max-stored-responses", str(STORE_SIZE)], d / "server.log")
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


def test_stored_responses_belong_to_their_tenant(server):
    """A response id of one tenant reads as unknown to another: no GET, continuation,
    input items or DELETE (``responses_store.py``)."""
    url = server.url + "/v1/responses"
    made = httpx.post(url, headers=_auth("alice"), timeout=60, json={
        "input": "hello", "max_output_tokens": 2, "temperature": 0}).json()
    rid = made["id"]
    for method, path, body in (("GET", f"/{rid}", None), ("GET", f"/{rid}/input_items", None),
                               ("POST", "", {"input": "more", "previous_response_id": rid}),
                               ("DELETE", f"/{rid}", None)):
        resp = httpx.request(method, url + path, headers=_auth("bob"), json=body, timeout=60)
        assert resp.status_code == 404, (method, path, resp.text)
        assert "not found" in resp.json()["error"]["message"]
    resp = httpx.get(f"{url}/{rid}", headers=_auth("alice"), timeout=60)
    assert resp.status_code == 200 and resp.json()["output"] == made["output"]


def test_a_tenant_filling_the_store_keeps_anothers_responses(server):
    """Bob storing more responses than the store holds evicts his own, never Alice's: the
    bounds are per tenant (one LRU for all let him turn her response into a 404)."""
    url = server.url + "/v1/responses"
    one_token = {"max_output_tokens": 1, "temperature": 0}
    mine = httpx.post(url, headers=_auth("alice"), timeout=60,
                      json={"input": "keep me", **one_token}).json()["id"]
    bobs = [httpx.post(url, headers=_auth("bob"), timeout=60,
                       json={"input": f"fill {i}", **one_token}).json()["id"]
            for i in range(STORE_SIZE + 3)]
    assert httpx.get(f"{url}/{bobs[0]}", headers=_auth("bob")).status_code == 404
    assert httpx.get(f"{url}/{bobs[-1]}", headers=_auth("bob")).status_code == 200
    assert httpx.get(f"{url}/{mine}", headers=_auth("alice")).status_code == 200
    more = httpx.post(url, headers=_auth("alice"), timeout=60, json={
        "input": "and?", "previous_response_id": mine, **one_token})
    assert more.status_code == 200, more.text


def test_wrong_key_is_401(server):
    resp = httpx.post(server.url + "/generate", json={"text": "hi"},
                      headers={"Authorization": "Bearer sk-alice-"})
    assert resp.status_code == 401


def test_namespace_metrics(server):
    _cached(server, "bob", "metric " + LONG, extra_key=SALT)
    text = httpx.get(server.url + "/metrics", headers=_auth("admin")).text
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
    info = httpx.get(server.url + "/get_server_info", headers=_auth("admin")).json()
    assert set(info["namespace_cache"]) == {"tenant:alice", "tenant:bob"}
    assert "api_key" not in info and "admin_api_key" not in info and "pids" in info


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


# --- tenants are not admins ------------------------------------------------------------------
ADMIN_ROUTES = [("POST", "/flush_cache", None), ("GET", "/flush_cache", None),
                ("POST", "/update_weights_from_disk", {"model_path": "."}),
                ("POST", "/abort_request", {"abort_all": True}),
                ("GET", "/get_load", None), ("GET", "/v1/loads", None), ("GET", "/metrics", None)]


def _call(srv: ServerProcess, who: str, method: str, path: str, body: dict | None = None,
          ) -> httpx.Response:
    return httpx.request(method, srv.url + path, json=body, headers=_auth(who), timeout=60)


def test_tenant_gets_403_on_admin_routes(server):
    for method, path, body in ADMIN_ROUTES:
        resp = _call(server, "alice", method, path, body)
        assert resp.status_code == 403, (path, resp.text)
        err = resp.json()["error"]
        assert "--admin-api-key" in err["message"] and err["type"] == "permission_error", err
    for method, path, body in ADMIN_ROUTES:
        if path not in ("/update_weights_from_disk", "/abort_request"):  # tested below
            assert _call(server, "admin", method, path, body).status_code == 200, path


def test_metrics_need_the_admin_key(server):
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/metrics", headers=_auth("bob")).status_code == 403
    text = httpx.get(server.url + "/metrics", headers=_auth("admin")).text
    assert 'namespace="tenant:alice"' in text and 'namespace="tenant:bob"' in text
    assert httpx.get(server.url + "/health").status_code == 200  # open to all


def _stream(srv: ServerProcess, who: str, rid: str, tokens: int, started: threading.Event,
            out: dict) -> None:
    """A greedy stream of ``tokens`` tokens; ``out`` gets its last chunk's meta_info."""
    body = {"text": "count on", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}}
    with httpx.stream("POST", srv.url + "/generate", json=body, headers=_auth(who),
                      timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                out["meta"] = json.loads(line[6:])["meta_info"]
                started.set()
    started.set()


def _start_stream(srv: ServerProcess, who: str, rid: str, tokens: int = 1500
                  ) -> tuple[threading.Thread, dict]:
    started, out = threading.Event(), {}
    t = threading.Thread(target=_stream, args=(srv, who, rid, tokens, started, out))
    t.start()
    assert started.wait(120) and "meta" in out, "the stream never started"
    return t, out


def test_tenant_cannot_abort_or_probe_another_tenants_stream(server):
    t, out = _start_stream(server, "bob", "bob-1")
    assert _call(server, "alice", "POST", "/abort_request", {"abort_all": True}).status_code \
        == 403
    for prefix in ["bob-1", "bob", "b", *"0123456789abcdef"]:
        assert _call(server, "alice", "POST", "/abort_request", {"rid": prefix}).status_code \
            == 200
    # bob's in-flight rid means nothing to alice: no "rid is already in use"
    mine = _call(server, "alice", "POST", "/generate", {
        "text": "hi", "rid": "bob-1", "sampling_params": {"max_new_tokens": 2}})
    assert mine.status_code == 200, mine.text
    assert mine.json()["meta_info"]["id"] == "bob-1"  # the client's rid, never the scoped one
    again = _call(server, "bob", "POST", "/generate", {"text": "hi", "rid": "bob-1"})
    assert again.status_code == 400 and "already in use" in again.text  # within bob: taken
    alice_view = _call(server, "alice", "GET", "/get_server_info").json()
    assert alice_view["num_inflight_requests"] == 0  # bob's stream is not hers to count
    t.join(300)
    assert out["meta"]["finish_reason"]["type"] == "length", out
    assert out["meta"]["completion_tokens"] == 1500 and out["meta"]["id"] == "bob-1"


def test_own_aborts_and_the_admins_work(server):
    t, out = _start_stream(server, "alice", "alice-long")
    assert _call(server, "alice", "GET", "/get_server_info").json()[
        "num_inflight_requests"] == 1
    assert _call(server, "alice", "POST", "/abort_request", {"rid": "alice-l"}).status_code \
        == 200
    t.join(300)
    assert out["meta"]["finish_reason"]["type"] == "abort", out
    t, out = _start_stream(server, "bob", "bob-2")
    assert _call(server, "admin", "POST", "/abort_request", {"rid": "bob-2"}).status_code == 200
    t.join(300)
    assert out["meta"]["finish_reason"]["type"] == "abort", out
    pair = _call(server, "alice", "POST", "/generate", {
        "text": "two", "rid": "pair", "sampling_params": {"n": 2, "max_new_tokens": 2}})
    assert [r["meta_info"]["id"] for r in pair.json()] == ["pair-0", "pair-1"]
    bad = _call(server, "alice", "POST", "/generate", {"text": "x", "rid": "bob\x1fb"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rid"


def test_server_info_shows_a_tenant_only_its_own(server, tenants_dir):
    _cached(server, "alice", "info " + LONG)
    resp = _call(server, "alice", "GET", "/get_server_info")
    info, text = resp.json(), resp.text
    assert set(info["namespace_cache"]) == {"tenant:alice"}
    assert info["namespace_cache"]["tenant:alice"]["cached_tokens"] > 150
    assert info["tenant"] == "alice" and info["context_length"] > 0
    for hidden in ("bob", "pid", "internal_states", "dp_replicas", "num_running_reqs",
                   "log_requests", str(tenants_dir)):
        assert hidden not in text, hidden
    full = _call(server, "admin", "GET", "/get_server_info").json()
    assert {"tenant:alice", "tenant:bob"} <= set(full["namespace_cache"]) and "pids" in full
    assert KEYS["admin"] not in json.dumps(full)


def test_weights_load_only_from_under_the_root(server, tenants_dir, tiny_llama_dir):
    root = tenants_dir / "weights"
    os.symlink(tiny_llama_dir, root / "link")
    for path in (tiny_llama_dir, root / "link", root / "tiny" / ".." / ".." / "weights" / ".."):
        resp = _call(server, "admin", "POST", "/update_weights_from_disk",
                     {"model_path": str(path)})
        assert resp.status_code == 403 and "--weights-root" in resp.text, (path, resp.text)
    resp = _call(server, "alice", "POST", "/update_weights_from_disk",
                 {"model_path": str(root / "tiny")})
    assert resp.status_code == 403 and "--admin-api-key" in resp.text
    resp = _call(server, "admin", "POST", "/update_weights_from_disk",
                 {"model_path": str(root / "tiny")})
    assert resp.status_code == 200 and resp.json()["success"], resp.text


def test_tenants_see_no_paths(server, tenants_dir):
    """A tenant sees the model's name (the checkpoint directory's, or
    --served-model-name), never its path: model cards, /get_model_info, its server info,
    responses' ``model`` and errors; a path is no name for it either (no oracle). The
    admin keeps SGLang's answers, paths included."""
    path = str(tenants_dir / "weights" / "tiny")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    answers = [_call(server, "alice", "GET", route) for route in (
        "/v1/models", "/v1/models/tiny", "/get_model_info", "/model_info", "/get_server_info")]
    answers += [_call(server, "alice", "POST", "/v1/chat/completions", chat),
                _call(server, "alice", "POST", "/v1/completions", {"prompt": "hi",
                                                                   "max_tokens": 1}),
                _call(server, "alice", "POST", "/v1/responses", {"input": "hi",
                                                                 "max_output_tokens": 1})]
    for resp in answers:
        assert resp.status_code == 200 and str(tenants_dir) not in resp.text, resp.text
    assert answers[0].json()["data"][0]["id"] == "tiny" == answers[2].json()["model_path"]
    assert [a.json()["model"] for a in answers[5:]] == ["tiny"] * 3
    for wrong in (path, "no-such-model"):
        resp = _call(server, "alice", "POST", "/v1/chat/completions", {**chat, "model": wrong})
        assert resp.status_code == 404 and str(tenants_dir) not in resp.json()["error"][
            "message"].replace(wrong, ""), resp.text
        assert _call(server, "alice", "GET", f"/v1/models/{wrong}").status_code == 404
    assert _call(server, "admin", "GET", "/get_model_info").json()["model_path"] == path
    assert _call(server, "admin", "GET", "/v1/models").json()["data"][0]["id"] == path
    resp = _call(server, "admin", "POST", "/v1/chat/completions", {**chat, "model": path})
    assert resp.status_code == 200 and resp.json()["model"] == path  # the name it sent
