"""A prefill scheduler and a decode scheduler in one process, KV over zmq on loopback:
greedy output ids equal a monolithic scheduler's; faults free every page on both sides."""

from __future__ import annotations

import random

import msgspec
import pytest

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.server_process import free_port
from radixlm.runtime.managers.messages import AbortReq, GenerateReqInput
from radixlm.runtime.managers.scheduler.scheduler import Scheduler
from radixlm.runtime.tokenizer import load_tokenizer
from tests.runtime.disaggregation.pd_client import secret_flags
from tests.runtime.disaggregation.pd_sides import Side, assert_clean, drive

COMMON = dict(max_total_tokens=4096, cpu_threads=1, random_seed=0, page_size=4,
              chunked_prefill_size=64)
COMMON_PD: dict = {}  # the shared secret's file, once ``sides`` made it
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def sides(tiny_llama_dir, tmp_path_factory):
    path = str(tiny_llama_dir)
    COMMON_PD["disaggregation_secret_file"] = secret_flags(tmp_path_factory.mktemp("key"))[1]
    tok = load_tokenizer(path)
    port = free_port()
    timeouts = dict(disaggregation_bootstrap_timeout=3.0, disaggregation_waiting_timeout=3.0)
    mono = Side(Scheduler(ServerArgs(**COMMON), path, tok))
    prefill = Side(Scheduler(ServerArgs(**COMMON, **COMMON_PD, **timeouts,
                                        disaggregation_mode="prefill",
                                        host="127.0.0.1", disaggregation_bootstrap_port=port),
                             path, tok))
    # the decode waits longer for KV than the prefill keeps an early claim: the prefill's
    # answer (no such request) comes first
    dec = Side(Scheduler(ServerArgs(**COMMON, **COMMON_PD,
                                    disaggregation_bootstrap_timeout=3.0,
                                    disaggregation_waiting_timeout=6.0,
                                    disaggregation_mode="decode"), path, tok))
    for s in (prefill, dec):  # as a server's scheduler does at start: the grammar tests'
        s.sched.grammar_compiler.warm_up(wait=True)  # rooms must not wait for the worker
    yield mono, prefill, dec, port
    for s in (mono, prefill, dec):
        s.close()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1900) for _ in range(n)]


def req(rid: str, ids: list[int], room: int | None, port: int, params=None) -> GenerateReqInput:
    return GenerateReqInput(rid, ids, dict(params or GREEDY), bootstrap_host=None if room is None
                            else "127.0.0.1", bootstrap_port=port, bootstrap_room=room)


def run_mono(mono: Side, rid: str, ids: list[int], params=None) -> list[int]:
    mono.inbox.append(req(rid, ids, None, 0, params))
    drive(mono, until=lambda: mono.finished(rid))
    return mono.ids(rid)


@pytest.mark.parametrize("n_tokens", [10, 301])  # 301: five chunks of 64
def test_greedy_matches_monolithic(sides, n_tokens):
    mono, prefill, dec, port = sides
    ids = prompt(n_tokens, n_tokens)
    want = run_mono(mono, f"mono-{n_tokens}", ids)
    room = 1000 + n_tokens
    rid = f"pd-{n_tokens}"
    dec.inbox.append(req(rid, ids, room, port))  # the router sends both at once
    prefill.inbox.append(req(rid, ids, room, port))
    drive(prefill, dec, until=lambda: dec.finished(rid) and prefill.finished(rid))
    assert dec.ids(rid) == want
    p = prefill.finished(rid)
    assert p.finish_reason == {"type": "length", "length": 0}
    assert prefill.ids(rid) == want[:1]
    assert_clean(prefill, dec)


def test_samples_with_their_own_rooms_and_decode_cache(sides):
    """n = 3 as rooms r, r+1, r+2; the decode server's radix cache holds the prompt after the
    first, so later claims ask for fewer tokens and the output stays the same."""
    mono, prefill, dec, port = sides
    ids = prompt(90, 7)
    want = run_mono(mono, "mono-n", ids)
    received0 = dec.sched.get_info()["kv_transfer_received_tokens"]
    rids = [f"n-{j}" for j in range(3)]
    for j, rid in enumerate(rids):
        prefill.inbox.append(req(rid, ids, 500 + j, port))
        dec.inbox.append(req(rid, ids, 500 + j, port))
        drive(prefill, dec, until=lambda r=rid: dec.finished(r) and prefill.finished(r))
        assert dec.ids(rid) == want
    received = dec.sched.get_info()["kv_transfer_received_tokens"] - received0
    assert received < 3 * 92, received  # the 2nd and 3rd sent only the uncached tail
    assert dec.finished(rids[2]).cached_tokens >= 88
    assert_clean(prefill, dec)


def test_room_never_claimed(sides):
    _, prefill, dec, port = sides
    prefill.inbox.append(req("lonely", prompt(20, 1), 42, port))
    drive(prefill, until=lambda: prefill.finished("lonely"))
    reason = prefill.finished("lonely").finish_reason
    assert reason["status_code"] == 503 and "no decode server claimed" in reason["message"]
    assert_clean(prefill, dec)


def test_prefill_unreachable(sides):
    _, prefill, dec, _ = sides
    dec.inbox.append(req("orphan", prompt(20, 2), 43, free_port()))
    drive(dec, until=lambda: dec.finished("orphan"))
    reason = dec.finished("orphan").finish_reason
    assert reason["status_code"] == 503 and "bootstrap" in reason["message"]
    assert_clean(prefill, dec)


def test_prefill_never_gets_the_request(sides):
    """The decode claims a room the prefill never hears of: the prefill aborts the claim."""
    _, prefill, dec, port = sides
    dec.inbox.append(req("half", prompt(20, 3), 44, port))
    drive(prefill, dec, until=lambda: dec.finished("half"))
    assert "no request with this bootstrap_room" in dec.finished("half").finish_reason["message"]
    assert_clean(prefill, dec)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_abort_on_either_side(sides, side):
    _, prefill, dec, port = sides
    rid = f"abort-{side}"
    ids = prompt(200, 4)
    dec.inbox.append(req(rid, ids, 45 if side == "prefill" else 46, port))
    prefill.inbox.append(req(rid, ids, 45 if side == "prefill" else 46, port))
    target = prefill if side == "prefill" else dec
    drive(prefill, dec, until=lambda: dec.sched.pd.transferring)  # claimed: pages reserved
    target.inbox.append(AbortReq(rid))
    drive(prefill, dec, until=lambda: dec.finished(rid) and prefill.finished(rid))
    other = dec if side == "prefill" else prefill
    assert target.finished(rid).finish_reason["type"] == "abort"
    assert other.finished(rid).finish_reason["status_code"] == 503
    assert_clean(prefill, dec)


def test_decode_dies_mid_transfer(tiny_llama_dir, sides):
    """A decode server that claimed a room and then vanished: the prefill's send fails or
    its ack never comes (waiting timeout); the prefill frees everything."""
    _, prefill, _, port = sides
    path = str(tiny_llama_dir)
    doomed = Side(Scheduler(ServerArgs(**COMMON, **COMMON_PD, disaggregation_mode="decode"),
                            path,
                            load_tokenizer(path)))
    ids = prompt(200, 5)
    doomed.inbox.append(req("doomed", ids, 47, port))
    drive(doomed, until=lambda: doomed.sched.pd.transferring)
    doomed.close()  # its sockets are gone, its claim stands
    prefill.inbox.append(req("doomed", ids, 47, port))
    drive(prefill, until=lambda: prefill.finished("doomed"))
    reason = prefill.finished("doomed").finish_reason
    assert reason["status_code"] == 503 and "decode" in reason["message"]
    assert_clean(prefill)


GRAMMARS = {
    # literal text the grammar forces after the first token: jump-forward on the decode side
    "regex-forced": {"regex": r'\{"id": [0-9]{2,4}, "tag": "[a-z]{1,6}"\}'},
    "json_schema": {"json_schema": '{"type": "object", "properties": {"n": {"type": '
                                   '"integer"}}, "required": ["n"]}'},
    "ends-at-first-token": {"regex": "[0-9]"},
}


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_grammar_matches_monolithic(sides, name):
    """Both servers compile the grammar: the prefill masks the first token, the decode
    advances its matcher over it and goes on; ids and finish reason equal one server's."""
    mono, prefill, dec, port = sides
    params = {"max_new_tokens": 40, "temperature": 0.0, **GRAMMARS[name]}
    ids = prompt(30, 11)
    want = run_mono(mono, f"mono-g-{name}", ids, params)
    want_reason = mono.finished(f"mono-g-{name}").finish_reason
    rid, room = f"pd-g-{name}", 700 + len(name)
    prefill.inbox.append(req(rid, ids, room, port, params))
    dec.inbox.append(req(rid, ids, room, port, params))
    drive(prefill, dec, until=lambda: dec.finished(rid) and prefill.finished(rid))
    assert dec.ids(rid) == want
    assert dec.finished(rid).finish_reason == want_reason
    assert prefill.ids(rid) == want[:1]
    if name == "ends-at-first-token":
        assert len(want) == 1 and want_reason["type"] == "stop"
    assert_clean(prefill, dec)


def test_bad_grammar_ends_the_room(sides):
    """A grammar that does not compile: a 400 on the decode server, which never claims the
    room and aborts it, so the prefill ends too; no page stays reserved on either side."""
    _, prefill, dec, port = sides
    params = {"max_new_tokens": 8, "regex": "(unclosed"}
    ids = prompt(20, 12)
    prefill.inbox.append(req("bad-g", ids, 750, port, params))
    dec.inbox.append(req("bad-g", ids, 750, port, params))
    drive(prefill, dec, until=lambda: dec.finished("bad-g") and prefill.finished("bad-g"))
    assert dec.finished("bad-g").finish_reason["status_code"] == 400
    assert prefill.finished("bad-g").finish_reason["type"] == "abort"
    assert_clean(prefill, dec)


def test_output_logprobs_match_monolithic(sides):
    """return_logprob on the decode server: the first token's logprob, top logprobs and
    asked ids' logprobs come with the KV; every output token's equal one server's. The
    prompt's logprobs stay on the prefill server (the router merges them)."""
    mono, prefill, dec, port = sides
    ids = prompt(40, 13)
    asks = dict(return_logprob=True, top_logprobs_num=3, token_ids_logprob=[5, 77],
                logprob_start_len=30)

    def logprob_req(rid: str, room: int | None) -> GenerateReqInput:
        r = req(rid, ids, room, port, {**GREEDY, "max_new_tokens": 6})
        return msgspec.structs.replace(r, **asks)

    mono.inbox.append(logprob_req("mono-lp", None))
    drive(mono, until=lambda: mono.finished("mono-lp"))
    prefill.inbox.append(logprob_req("pd-lp", 800))
    dec.inbox.append(logprob_req("pd-lp", 800))
    drive(prefill, dec, until=lambda: dec.finished("pd-lp") and prefill.finished("pd-lp"))

    def joined(side: Side, rid: str, field: str) -> list:
        return [x for o in side.outs[rid] for x in (getattr(o, field) or [])]

    assert dec.ids("pd-lp") == mono.ids("mono-lp")
    for field in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
        want = joined(mono, "mono-lp", field)
        assert len(want) == 6 and joined(dec, "pd-lp", field) == want, field
    # the prefill's own answer holds the prompt's logprobs, as one server's does
    assert joined(prefill, "pd-lp", "input_token_logprobs") == joined(
        mono, "mono-lp", "input_token_logprobs")
    assert len(joined(mono, "mono-lp", "input_token_logprobs")) == 10
    assert_clean(prefill, dec)
