"""Through ``radixlm serve``, once per grammar backend: a JSON schema with no finite
instance (self and mutual ``$ref`` recursion through required properties) and a regex that
matches nothing are 400s on /generate and /v1/chat/completions, and the server's memory
stays bounded; a ``stop_regex`` beyond its limits is a 400 while /health keeps answering."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from radixlm.runtime.config import GRAMMAR_BACKENDS
from radixlm.runtime.constrained.compile_worker import rss_bytes
from radixlm.runtime.entrypoints.server_process import ServerProcess, child_pids

SELF_REF = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                            "required": ["c"]}}, "$ref": "#/$defs/n"}
MUTUAL = {"$defs": {
    "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
    "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
    "$ref": "#/$defs/a"}
EMPTY_REGEX = "[^\\x00-\\U0010FFFF]"
FLAGS = ["--max-total-tokens", "4096", "--context-length", "512", "--random-seed", "0",
         "--grammar-compile-memory-mb", "512", "--log-level", "warning"]


@pytest.fixture(scope="module", params=GRAMMAR_BACKENDS)
def server(request, tmp_path_factory):
    name = request.param
    srv = ServerProcess([*FLAGS, "--grammar-backend", name],
                        tmp_path_factory.mktemp(name) / "server.log")
    try:
        srv.wait_healthy()
        srv.grammar_backend = name  # type: ignore[attr-defined]
        warm = _generate(srv, regex="[0-9]{3}")  # the compile worker has started
        assert warm.status_code == 200, warm.text
        yield srv
    finally:
        srv.stop()


def _tree_rss(srv: ServerProcess) -> int:
    return sum(rss_bytes(p) for p in [srv.proc.pid, *child_pids(srv.proc.pid)])


def _error(resp: httpx.Response, status: int = 400) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err["message"]


def _generate(srv: ServerProcess, **sp) -> httpx.Response:
    return httpx.post(srv.url + "/generate", timeout=120, json={
        "text": "x", "sampling_params": {"max_new_tokens": 8, **sp}})


def _chat(srv: ServerProcess, **extra) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
        **extra})


@pytest.mark.parametrize("schema", [SELF_REF, MUTUAL], ids=["self", "mutual"])
def test_schema_without_a_finite_instance_is_400_and_memory_stays_bounded(server, schema):
    before = _tree_rss(server)
    message = _error(_generate(server, json_schema=json.dumps(schema)))
    assert "admits no finite instance" in message and "cycle" in message
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    assert "no finite instance" in _error(_chat(server, response_format=response_format))
    assert _tree_rss(server) - before < 300 << 20
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_regex_that_matches_nothing_is_400(server):
    needle = "regex" if server.grammar_backend == "outlines" else "matches no string"
    assert needle in _error(_generate(server, regex=EMPTY_REGEX))
    assert needle in _error(_chat(server, regex=EMPTY_REGEX))
    # a JSON schema that matches nothing: a required property with no allowed value
    schema = {"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    assert "no finite instance" in _error(_chat(server, response_format=response_format))
    ok = _generate(server, regex="[0-9]{3}", temperature=0)
    assert ok.status_code == 200, ok.text


def test_stop_regex_beyond_its_limit_is_400_while_health_answers(server):
    if server.grammar_backend != "xgrammar":
        pytest.skip("stop_regex does not depend on the grammar backend")
    results: list[int] = []

    def send() -> None:
        for _ in range(5):
            results.append(_generate(server, stop_regex="(a{1000}){1000}").status_code)

    senders = [threading.Thread(target=send) for _ in range(4)]
    for t in senders:
        t.start()
    health = [httpx.get(server.url + "/health", timeout=30).status_code for _ in range(5)]
    for t in senders:
        t.join(timeout=120)
    assert health == [200] * 5 and results == [400] * 20
    message = _error(_generate(server, stop_regex="(a{1000}){1000}"))
    assert "stop_regex" in message and "256" in message
    ok = _generate(server, stop_regex="zz+", temperature=0)
    assert ok.status_code == 200, ok.text


def test_stop_regex_past_the_state_limit_is_400(server):
    """Small to parse but exponential to determinise: the automaton stops at its state
    limit, built on the tokenizer manager's worker thread, and the request is a 400."""
    if server.grammar_backend != "xgrammar":
        pytest.skip("stop_regex does not depend on the grammar backend")
    message = _error(_generate(server, stop_regex="(a|b)*a(a|b){20}"))
    assert "stop_regex" in message and "2000 states" in message
