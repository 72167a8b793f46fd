"""``radixlm serve --dp-size N``: replicas behind one HTTP server.

Greedy outputs equal one replica's; the cache-aware dispatcher sends a prefix to the
replica that caches it (seen in ``cached_tokens``) and away from a saturated one; a
``routing_key`` sticks to one replica (seen in the replicas' own prompt counters); a
replica that dies or stops turning is taken out with a 503 naming it for its in-flight
requests while the others serve; nothing is left running after a stop.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.engine.engine import Engine
from radixlm.runtime.entrypoints.server_process import ServerProcess, child_pids, pid_alive
from radixlm.runtime.managers.data_parallel.data_parallel_controller import aggregate_infos
from radixlm.runtime.managers.data_parallel.load_balancer import (
    LoadBalancer,
    NoReplica,
    balancer_for,
)
from radixlm.runtime.managers.messages import GenerateReqInput, ReplicaLoad

BASE = ["--max-total-tokens", "4096", "--log-level", "warning"]
PROMPTS = ["The quick brown fox", "Data parallel replicas", "One two three four", "hello"]


def _generate(url: str, text: str | list[int], max_new_tokens: int = 4,
              **extra: object) -> dict:
    body: dict = {"text": text} if isinstance(text, str) else {"input_ids": text}
    body.update(sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0}, **extra)
    resp = httpx.post(url + "/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _prompt_tokens(url: str) -> dict[int, int]:
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    return {s["dp_rank"]: s["prompt_tokens"] for s in info["internal_states"]}


def _stop_and_check(srv: ServerProcess, kids: list[int]) -> None:
    assert srv.stop() == 0, srv.log()
    deadline = time.monotonic() + 10  # a bound for a hang, not a speed check
    while [p for p in kids if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in kids if pid_alive(p)], srv.log()


@pytest.fixture(scope="module")
def dp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Two replicas, cache-aware, balancing as soon as one is 64 tokens busier."""
    srv = ServerProcess(["--dp-size", "2", "--cpu-threads", "2",
                         "--cache-aware-balance-abs-threshold", "64",
                         "--cache-aware-balance-rel-threshold", "1.0", *BASE],
                        tmp_path_factory.mktemp("dp2") / "server.log")
    try:
        srv.wait_healthy()
        kids = child_pids(srv.proc.pid)
        yield srv
    finally:
        if srv.proc.poll() is None:
            _stop_and_check(srv, kids)


def test_replicas_report_themselves(dp2: ServerProcess) -> None:
    info = httpx.get(dp2.url + "/get_server_info").json()
    assert info["dp_size"] == 2
    assert sorted(s["dp_rank"] for s in info["internal_states"]) == [0, 1]
    assert {"scheduler-dp0", "scheduler-dp1", "detokenizer"} <= set(info["pids"])
    assert info["max_total_num_tokens"] == 2 * 4096  # one pool each, summed
    load = httpx.get(dp2.url + "/get_load").json()
    assert [entry["dp_rank"] for entry in load] == [0, 1]


def test_v1_loads_reports_every_replica(dp2: ServerProcess) -> None:
    """SGLang's /v1/loads: one snapshot per replica (core scalars, memory, disaggregation
    and queue sections), filtered by dp_rank and include; Prometheus has a sample per
    rank. After a request its replica counts the prefill and the decode steps."""
    body = {"text": "loads " * 30, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True},
            "routed_dp_rank": 1}
    assert httpx.post(dp2.url + "/generate", json=body, timeout=120).status_code == 200
    v1 = httpx.get(dp2.url + "/v1/loads").json()
    assert v1["num_accelerators"] == 1 and [x["dp_rank"] for x in v1["loads"]] == [0, 1]
    idle, busy = v1["loads"]
    assert busy["total_prefill_uncached_tokens"] >= 30 and busy["total_prefill_busy_us"] > 0
    count, sum_b, sum_t = busy["decode_moments"][:3]
    assert count >= 7 and sum_b == count and sum_t > 0 and busy["decode_moments"][5] == count
    assert idle["total_prefill_uncached_tokens"] == 0 and idle["decode_moments"] is None
    info = httpx.get(dp2.url + "/get_server_info").json()
    per_token = info["internal_states"][0]["kv_cache_bytes"] / 4096
    assert per_token > 0
    for load in v1["loads"]:
        assert load["max_total_num_tokens"] == load["memory"]["token_capacity"] == 4096
        assert load["memory"]["kv_cache_gb"] == round(4096 * per_token / (1 << 30), 3)
        assert load["memory"]["weight_gb"] > 0 and load["memory"]["graph_gb"] == 0
        assert load["disaggregation"]["mode"] == "null"
        assert load["queues"] == {"waiting": 0, "grammar": 0, "paused": 0, "retracted": 0,
                                  "prealloc_ready": 0}
        assert "speculative" not in load and "lora" not in load
    one = httpx.get(dp2.url + "/v1/loads", params={"dp_rank": 1, "include": "core"}).json()
    assert [x["dp_rank"] for x in one["loads"]] == [1] and "memory" not in one["loads"][0]
    mem = httpx.get(dp2.url + "/v1/loads", params={"include": "memory"}).json()["loads"][0]
    assert "memory" in mem and "queues" not in mem
    text = httpx.get(dp2.url + "/v1/loads", params={"format": "prometheus"}).text
    assert 'sglang_num_running_reqs{dp_rank="0"} 0' in text
    assert 'sglang_memory_token_capacity{dp_rank="1"} 4096' in text
    assert 'sglang_disagg_kv_transfer_speed_gb_s{dp_rank="1"}' in text
    for query in ({"dp_rank": "2"}, {"dp_rank": "-1"}, {"dp_rank": "\u00b2"},
                  {"include": "core,bogus"}):
        r = httpx.get(dp2.url + "/v1/loads", params=query)
        assert r.status_code == 400 and next(iter(query)) in r.text, r.text


def test_greedy_outputs_equal_one_replica(dp2: ServerProcess, tmp_path) -> None:
    many = [_generate(dp2.url, p, 8)["text"] for p in PROMPTS]
    one = ServerProcess(["--cpu-threads", "1", *BASE], tmp_path / "dp1.log")
    try:
        one.wait_healthy()
        kids = child_pids(one.proc.pid)
        assert [_generate(one.url, p, 8)["text"] for p in PROMPTS] == many
    finally:
        _stop_and_check(one, kids)


def test_cache_aware_follows_the_cached_prefix(dp2: ServerProcess) -> None:
    rng = random.Random(0)
    prefix = [rng.randrange(100, 1000) for _ in range(48)]
    first = _generate(dp2.url, prefix + [7, 8], 1)
    assert first["meta_info"]["cached_tokens"] == 0
    # each later request with the prefix lands on the replica that cached it, every time
    # (the least loaded one, which round robin would alternate, is the other one half of
    # the time); the replicas are idle, so no load margin is crossed
    for i in range(4):
        out = _generate(dp2.url, prefix + [9, 10 + i], 1)
        assert out["meta_info"]["cached_tokens"] >= len(prefix), (i, out["meta_info"])


def test_cache_aware_spreads_load_off_a_saturated_replica(dp2: ServerProcess) -> None:
    rng = random.Random(1)
    prefix = [rng.randrange(100, 1000) for _ in range(200)]
    _generate(dp2.url, prefix, 1)  # one replica caches the prefix
    body = {"input_ids": prefix + [5], "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with httpx.stream("POST", dp2.url + "/generate", json=body, timeout=120) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # it is running there
        # that replica now holds > 200 tokens more than the other (threshold 64): a request
        # with the same prefix goes to the other replica, which has none of it cached
        out = _generate(dp2.url, prefix + [6], 1)
        assert out["meta_info"]["cached_tokens"] == 0, out["meta_info"]
    # the long request was abandoned (aborted); once it is gone the cache wins again
    deadline = time.monotonic() + 60
    while httpx.get(dp2.url + "/get_server_info").json()["num_running_reqs"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    out = _generate(dp2.url, prefix + [7], 1)
    assert out["meta_info"]["cached_tokens"] >= len(prefix), out["meta_info"]


def test_routing_key_sticks_to_one_replica(dp2: ServerProcess) -> None:
    rng = random.Random(2)
    before = _prompt_tokens(dp2.url)
    prompts = [[rng.randrange(100, 1000) for _ in range(20)] for _ in range(4)]
    for ids in prompts:  # unrelated prompts: alone, they would alternate between replicas
        _generate(dp2.url, ids, 1, routing_key="session-a")
    after = _prompt_tokens(dp2.url)
    grew = {r: after[r] - before[r] for r in after}
    assert sorted(grew.values()) == [0, 80], grew
    again = _prompt_tokens(dp2.url)
    for _ in range(4):  # fresh prompts without the key: never twice in a row on one replica
        _generate(dp2.url, [rng.randrange(100, 1000) for _ in range(20)], 1)
    final = _prompt_tokens(dp2.url)
    assert sorted(final[r] - again[r] for r in final) == [40, 40]


def test_routed_dp_rank_picks_the_replica(dp2: ServerProcess) -> None:
    rng = random.Random(3)
    for name, rank in (("routed_dp_rank", 1), ("data_parallel_rank", 0), ("routed_dp_rank", 1)):
        before = _prompt_tokens(dp2.url)
        _generate(dp2.url, [rng.randrange(100, 1000) for _ in range(20)], 1, **{name: rank})
        after = _prompt_tokens(dp2.url)
        assert {r: after[r] - before[r] for r in after} == {rank: 20, 1 - rank: 0}
    resp = httpx.post(dp2.url + "/generate", json={"text": "x", "routed_dp_rank": 2})
    assert resp.status_code == 400 and "[0, 2)" in resp.text and "routed_dp_rank" in resp.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_routes_take_routed_dp_rank(dp2: ServerProcess, route: str) -> None:
    """SGLang's OpenAI requests carry routed_dp_rank (and data_parallel_rank) too."""
    model = httpx.get(dp2.url + "/v1/models").json()["data"][0]["id"]
    content = {"prompt": "one two three"} if route == "/v1/completions" else {
        "messages": [{"role": "user", "content": "one two three"}]}
    for name, rank in (("routed_dp_rank", 1), ("data_parallel_rank", 0)):
        before = _prompt_tokens(dp2.url)
        r = httpx.post(dp2.url + route, timeout=60, json={
            "model": model, **content, "max_tokens": 1, name: rank})
        assert r.status_code == 200, r.text
        after = _prompt_tokens(dp2.url)
        assert after[1 - rank] == before[1 - rank] and after[rank] > before[rank]
    r = httpx.post(dp2.url + route, json={"model": model, **content, "routed_dp_rank": 5})
    assert r.status_code == 400 and "routed_dp_rank" in r.text


def test_routing_key_is_a_string(dp2: ServerProcess) -> None:
    resp = httpx.post(dp2.url + "/generate", json={"text": "x", "routing_key": 3})
    assert resp.status_code == 400
    assert "routing_key" in resp.text


def _inflight_replica(url: str) -> int:
    """The replica serving the one in-flight request."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        reps = httpx.get(url + "/get_server_info").json()["dp_replicas"]
        busy = [r["dp_rank"] for r in reps if r["inflight"]]
        if busy:
            return busy[0]
        time.sleep(0.05)
    raise TimeoutError("no request in flight")


def _lose_replica(srv: ServerProcess, sig: int) -> tuple[int, httpx.Response]:
    """Start a long request, hit its replica's process with ``sig``, return the rank and
    the request's response."""
    result: dict = {}
    body = {"text": "x", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}

    def client() -> None:
        result["resp"] = httpx.post(srv.url + "/generate", json=body, timeout=120)

    t = threading.Thread(target=client)
    t.start()
    rank = _inflight_replica(srv.url)
    time.sleep(0.2)  # it is decoding
    pid = httpx.get(srv.url + "/get_server_info").json()["pids"][f"scheduler-dp{rank}"]
    os.kill(pid, sig)
    t.join(120)
    return rank, result["resp"]


def test_a_dead_or_stuck_replica_is_taken_out_and_the_rest_serve(tmp_path) -> None:
    srv = ServerProcess(["--dp-size", "3", "--cpu-threads", "3", "--watchdog-timeout", "3",
                         "--load-balance-method", "round_robin", *BASE], tmp_path / "s.log")
    try:
        srv.wait_healthy()
        kids = child_pids(srv.proc.pid)
        killed, resp = _lose_replica(srv, signal.SIGKILL)
        assert resp.status_code == 503, resp.text
        message = resp.json()["error"]["message"]
        assert f"replica {killed}" in message and "exited" in message, message
        stuck, resp = _lose_replica(srv, signal.SIGSTOP)  # found by the watchdog
        assert resp.status_code == 503, resp.text
        message = resp.json()["error"]["message"]
        assert f"replica {stuck}" in message and "no progress" in message, message
        assert httpx.get(srv.url + "/health").status_code == 200
        for p in PROMPTS:  # all served by the one replica left
            _generate(srv.url, p, 2)
        info = httpx.get(srv.url + "/get_server_info").json()
        (left,) = {0, 1, 2} - {killed, stuck}
        assert [s["dp_rank"] for s in info["internal_states"]] == [left]
        dead = {r["dp_rank"]: r["dead"] for r in info["dp_replicas"]}
        assert dead[left] is None and dead[killed] and dead[stuck]
        assert [e["dp_rank"] for e in httpx.get(srv.url + "/get_load").json()] == [left]
    finally:
        if srv.proc.poll() is None:
            _stop_and_check(srv, kids)


def test_engine_with_two_replicas() -> None:
    greedy = {"max_new_tokens": 8, "temperature": 0}
    with Engine(max_total_tokens=4096) as one:
        expected = [out["text"] for out in one.generate(PROMPTS, greedy)]
    with Engine(dp_size=2, max_total_tokens=4096) as two:
        assert [out["text"] for out in two.generate(PROMPTS, greedy)] == expected
        info = two.get_server_info()
        assert [s["prompt_tokens"] > 0 for s in info["internal_states"]] == [True, True]
        assert info["prompt_tokens"] == sum(s["prompt_tokens"] for s in info["internal_states"])
        rng = random.Random(3)
        prefix = [rng.randrange(100, 1000) for _ in range(40)]
        two.generate(input_ids=prefix + [1], sampling_params={"max_new_tokens": 1})
        for i in range(3):  # always to the replica that cached it (the events' index)
            out = two.generate(input_ids=prefix + [2 + i], sampling_params={"max_new_tokens": 1})
            assert out["meta_info"]["cached_tokens"] >= len(prefix), out["meta_info"]
        for name, rank in (("routed_dp_rank", 1), ("data_parallel_rank", 0)):  # SGLang's
            before = [s["prompt_tokens"] for s in two.get_server_info()["internal_states"]]
            two.generate(input_ids=[rng.randrange(100, 1000) for _ in range(9)],
                         sampling_params={"max_new_tokens": 1}, **{name: rank})
            after = [s["prompt_tokens"] for s in two.get_server_info()["internal_states"]]
            assert after[rank] - before[rank] == 9 and after[1 - rank] == before[1 - rank]
        with pytest.raises(ValueError, match=r"routed_dp_rank must be in \[0, 2\)"):
            two.generate("x", routed_dp_rank=2)
        with pytest.raises(ValueError, match="disagg_prefill_dp_rank is not supported"):
            two.generate("x", disagg_prefill_dp_rank=0)
        two.check_invariants()


# --- the dispatch policy alone (no processes) -------------------------------------------------
class FakeIndex:
    """Cached prefix lengths set by hand, per replica."""

    def __init__(self, n: int) -> None:
        self.cached = [0] * n
        self.stored = 0  # leading tokens in the shared storage tier
        self.dropped: list[int] = []

    def apply(self, replica: int, batch: object) -> None:
        raise AssertionError("not used")

    def match_tiers(self, token_ids: list[int], namespace: str | None
                    ) -> tuple[list[int], int]:
        return list(self.cached), self.stored

    def drop_replica(self, replica: int) -> None:
        self.dropped.append(replica)


def _req(rid: str, n: int = 100, key: str | None = None, start: int = 0) -> GenerateReqInput:
    return GenerateReqInput(rid, list(range(start, start + n)), {}, routing_key=key)


def _send(lb: LoadBalancer, msg: GenerateReqInput) -> int:
    rank = lb.select(msg)
    lb.sent(rank, msg)
    return rank


def _report(lb: LoadBalancer, rank: int, tokens: int) -> None:
    """Replica ``rank`` has read everything sent to it and holds ``tokens``."""
    lb.on_load(ReplicaLoad(rank, lb.replicas[rank].n_sent, 1, tokens))


def test_cache_aware_rules() -> None:
    index = FakeIndex(3)
    lb = LoadBalancer(3, "cache_aware", abs_threshold=150, rel_threshold=1.5, index=index,
                      cache_threshold=0.3)
    index.cached = [0, 80, 20]  # distinct prompts below: nothing in flight matches them
    assert _send(lb, _req("a", start=1000)) == 1  # the longest cached prefix
    assert lb.load(1) == 20  # sent, not reported yet: its 100 - 80 uncached tokens
    assert lb.decisions == {"cache": 1}
    assert _send(lb, _req("b", start=2000)) == 1  # 20 tokens more than the others: < 150
    _report(lb, 1, 400)
    assert lb.load(1) == 400 and lb.overloaded(1, 0)
    assert _send(lb, _req("c", start=3000)) in (0, 2)  # past both thresholds: least loaded
    _report(lb, 0, 400)
    _report(lb, 2, 400)
    _report(lb, 1, 600)  # 200 over the others (> 150) but not 1.5 times: the cache wins
    index.cached = [0, 90, 0]
    assert _send(lb, _req("d", start=4000)) == 1
    _report(lb, 1, 601)
    assert _send(lb, _req("e", start=5000)) in (0, 2)  # now past both
    _report(lb, 0, 400)
    _report(lb, 2, 350)
    index.cached = [0, 25, 0]  # 25 of 100 tokens: under cache_threshold, so by load alone
    assert _send(lb, _req("f", start=6000)) == 2
    assert lb.load(2) == 450  # nothing cached where it went: the whole prompt counts
    assert lb.decisions == {"cache": 3, "balance": 2, "miss": 1}


def test_in_flight_prompts_count_as_cached() -> None:
    lb = LoadBalancer(2, "cache_aware", index=FakeIndex(2))
    first = _send(lb, _req("a", 200))
    assert lb.cached_tokens(list(range(150)) + [9999], None)[first] == 150
    assert _send(lb, _req("b", 210)) == first  # a burst of one tenant stays together
    lb.finished("a")
    lb.finished("b")
    assert lb.cached_tokens(list(range(150)), None) == [0, 0]  # now the index's business


def test_storage_hits_pick_no_replica_but_are_not_load() -> None:
    """Pages in the shared storage tier are loaded wherever the request goes: the least
    loaded replica takes it, and only its tokens past them count as its load."""
    index = FakeIndex(2)
    lb = LoadBalancer(2, "cache_aware", index=index)
    _report(lb, 0, 500)
    _report(lb, 1, 100)
    index.stored = 80
    assert _send(lb, _req("a", 100)) == 1
    assert lb.load(1) == 100 + 20
    index.cached = [0, 0]
    index.stored = 0
    assert _send(lb, _req("b", 100, start=500)) == 1 and lb.load(1) == 220


def test_loads_count_requests_the_replica_has_not_reported() -> None:
    lb = LoadBalancer(2, "minimum_tokens")
    first = _send(lb, _req("a", 300))
    assert lb.load(first) == 300
    assert _send(lb, _req("b", 100)) == 1 - first  # the other one is empty
    lb.on_load(ReplicaLoad(first, received=1, num_reqs=1, num_tokens=310))
    assert lb.load(first) == 310  # "a" is in the report now, not counted twice
    lb.finished("a")
    lb.on_load(ReplicaLoad(first, received=1, num_reqs=0, num_tokens=0))
    assert lb.load(first) == 0


def test_round_robin_shortest_queue_and_retire() -> None:
    rr = LoadBalancer(3, "round_robin")
    assert [_send(rr, _req(str(i))) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    sq = LoadBalancer(2, "shortest_queue")
    sq.on_load(ReplicaLoad(0, 0, 3, 10))
    sq.on_load(ReplicaLoad(1, 0, 1, 5000))
    assert _send(sq, _req("x")) == 1  # fewer requests, however long
    index = FakeIndex(2)
    lb = LoadBalancer(2, "cache_aware", index=index)
    _send(lb, _req("p", key="k"))
    owner = lb.owner("p")
    assert lb.retire(owner) == ["p"] and index.dropped == [owner]
    assert _send(lb, _req("q", key="k")) == 1 - owner  # the key moves to a live replica
    lb.retire(1 - owner)
    with pytest.raises(NoReplica):
        lb.select(_req("r"))


def test_prefill_server_places_rooms_by_room_mod_dp_size() -> None:
    """--disaggregation-mode prefill: room r on replica r mod dp_size whatever the loads
    (the decode side claims it there); a dead replica's rooms fail, others still place;
    requests without a room (and a decode server's) are balanced as usual."""
    lb = balancer_for(ServerArgs(dp_size=3, disaggregation_mode="prefill"), 3)
    _report(lb, 1, 10_000)
    rooms = [7, 8, 9, 10, 2**62 + 1]
    placed = [_send(lb, msgspec.structs.replace(_req(str(r)), bootstrap_room=r))
              for r in rooms]
    assert placed == [r % 3 for r in rooms]
    assert _send(lb, _req("no-room")) != 1  # balanced: replica 1 is loaded
    lb.retire(2)
    with pytest.raises(NoReplica, match="bootstrap_room 11 belongs to replica 2"):
        lb.select(msgspec.structs.replace(_req("x"), bootstrap_room=11))
    assert lb.select(msgspec.structs.replace(_req("y"), bootstrap_room=12)) == 0
    dec = balancer_for(ServerArgs(dp_size=2, disaggregation_mode="decode",
                                  load_balance_method="round_robin"), 2)
    assert [_send(dec, msgspec.structs.replace(_req(str(r)), bootstrap_room=1))
            for r in range(4)] == [0, 1, 0, 1]


def test_sglang_05_balance_method_names() -> None:
    """SGLang 0.5's --load-balance-method names work: auto, total_requests, total_tokens,
    and follow_bootstrap_room (PD only: rooms decide, others go round robin)."""
    for name, ours in (("auto", "cache_aware"), ("total_requests", "shortest_queue"),
                       ("total_tokens", "minimum_tokens")):
        assert balancer_for(ServerArgs(dp_size=2, load_balance_method=name), 2).method == ours
    dec = balancer_for(ServerArgs(dp_size=2, disaggregation_mode="decode",
                                  load_balance_method="follow_bootstrap_room"), 2)
    assert [_send(dec, msgspec.structs.replace(_req(str(r)), bootstrap_room=r))
            for r in (5, 7, 8)] == [1, 1, 0]
    assert [_send(dec, _req(f"n{i}")) for i in range(2)] == [0, 1]
    with pytest.raises(ValueError, match="follow_bootstrap_room .* needs --disaggregation"):
        ServerArgs(load_balance_method="follow_bootstrap_room")
    with pytest.raises(ValueError, match="load_balance_method must be one of"):
        ServerArgs(load_balance_method="fastest")


def test_aggregate_infos_sums_and_recomputes_rates() -> None:
    a = {"prompt_tokens": 100, "cached_tokens": 50, "used_tokens": 10,
         "max_total_num_tokens": 100, "page_size": 1, "token_usage": 0.1,
         "cache_hit_rate": 0.5, "namespace_cache": {"t": {"prompt_tokens": 100,
                                                          "cached_tokens": 50}}}
    a["decode_moments"] = [2.0, 3.0, 500.0, 5.0, 800.0, 3.0]
    b = {**a, "prompt_tokens": 300, "cached_tokens": 0, "used_tokens": 30,
         "namespace_cache": {}, "decode_moments": [1.0, 4.0, 300.0, 16.0, 1200.0, 4.0]}
    out = aggregate_infos([a, b])
    assert out["prompt_tokens"] == 400 and out["page_size"] == 1
    assert out["decode_moments"] == [3.0, 7.0, 800.0, 21.0, 2000.0, 7.0]
    assert out["cache_hit_rate"] == 50 / 400 and out["token_usage"] == 40 / 200
    assert out["namespace_cache"] == {"t": {"prompt_tokens": 100, "cached_tokens": 50}}


def test_aggregate_infos_adds_grammar_compile_histograms() -> None:
    base = {"prompt_tokens": 1, "cached_tokens": 0, "used_tokens": 0,
            "max_total_num_tokens": 10}
    a = {**base, "grammar_compile_time": {"buckets": [0.1, 1.0], "counts": [1, 0, 2],
                                          "sum": 5.0}}
    b = {**base, "grammar_compile_time": {"buckets": [0.1, 1.0], "counts": [0, 3, 1],
                                          "sum": 2.5}}
    out = aggregate_infos([a, b])["grammar_compile_time"]
    assert out == {"buckets": [0.1, 1.0], "counts": [1, 3, 3], "sum": 7.5}


def test_replica_devices_leave_room_for_tensor_parallel_ranks() -> None:
    from radixlm.runtime.managers.data_parallel.data_parallel_controller import replica_args

    args = ServerArgs(device="cuda", dp_size=2, tp_size=2, base_gpu_id=1)
    assert [replica_args(args, r).device for r in (0, 1)] == ["cuda:1", "cuda:3"]
    one = ServerArgs(device="cuda", dp_size=3)
    assert [replica_args(one, r).device for r in (0, 1, 2)] == ["cuda:0", "cuda:1", "cuda:2"]
    cpu = ServerArgs(device="cpu", dp_size=2, tp_size=2)
    assert replica_args(cpu, 1) is cpu


def test_replica_groups_meet_at_their_own_port() -> None:
    """--dist-init-addr with --dp-size: replica r's tensor-parallel group meets at port + r
    (one address for all would join them into one group); a port range past 65535 is
    refused with the flag named."""
    from radixlm.runtime.managers.data_parallel.data_parallel_controller import replica_args

    args = ServerArgs(device="cpu", dp_size=3, tp_size=2, dist_init_addr="10.0.0.7:29500")
    assert [replica_args(args, r).dist_init_addr for r in range(3)] == [
        "10.0.0.7:29500", "10.0.0.7:29501", "10.0.0.7:29502"]
    one = ServerArgs(device="cpu", tp_size=2, dist_init_addr="10.0.0.7:29500")
    assert replica_args(one, 0) is one
    with pytest.raises(ValueError, match=r"dist_init_addr's port \+ dp_size - 1"):
        ServerArgs(dp_size=2, tp_size=2, dist_init_addr="h:65535")
