"""A prefill and a decode scheduler in one process, driven by hand (KV over zmq on
loopback): the cheapest faithful PD pair, shared by the scheduler-level PD tests. A side
with ``tp_size`` 2 is rank 0 in this process and a follower rank process, as in the
Engine (one such side at a time: a process joins one torch.distributed group)."""

from __future__ import annotations

import time
from collections.abc import Callable

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.server_process import free_port
from radixlm.runtime.managers.messages import GenerateReqInput, ReqOutput
from radixlm.runtime.managers.scheduler.scheduler import Scheduler
from radixlm.runtime.managers.scheduler.tp_ranks import TpRanks, start_tp_ranks
from radixlm.runtime.tokenizer import load_tokenizer


class Side:
    """One scheduler and what it emitted, per rid."""

    def __init__(self, sched: Scheduler, ranks: TpRanks | None = None) -> None:
        self.sched = sched
        self.ranks = ranks  # its follower ranks (tp_size > 1)
        self.outs: dict[str, list[ReqOutput]] = {}
        self.inbox: list = []

    def send(self, obj) -> None:
        for out in obj if isinstance(obj, list) else []:
            self.outs.setdefault(out.rid, []).append(out)

    def turn(self) -> None:
        msgs, self.inbox = self.inbox, []
        self.sched.run_once(msgs, self.send)

    def finished(self, rid: str) -> ReqOutput | None:
        return next((o for o in self.outs.get(rid, []) if o.finished), None)

    def ids(self, rid: str) -> list[int]:
        return [t for o in self.outs[rid] for t in o.new_token_ids]

    def close(self) -> None:
        self.sched.grammar_compiler.shutdown()
        if self.sched.pd is not None:
            self.sched.pd.close()
        if self.ranks is not None:
            self.ranks.stop(self.sched.model_runner)


def start_side(args: ServerArgs, path: str, tok) -> Side:
    """A Side over ``args`` (its follower ranks started first when tp_size > 1)."""
    args, ranks = start_tp_ranks(args, path)
    try:
        return Side(Scheduler(args, path, tok), ranks)
    except BaseException:
        if ranks is not None:
            ranks.kill()
        raise


def pd_pair(path: str, common: dict, prefill: dict | None = None,
            decode: dict | None = None, decode_path: str | None = None
            ) -> tuple[Side, Side, int]:
    """A prefill and a decode Side over the checkpoint at ``path`` (the decode's at
    ``decode_path`` when given): ``common`` ServerArgs for both (the secret file among
    them), ``prefill`` / ``decode`` for one. Returns (prefill, decode, bootstrap port)."""
    tok = load_tokenizer(path)
    port = free_port()
    p = start_side(ServerArgs(**common, **(prefill or {}), disaggregation_mode="prefill",
                              host="127.0.0.1", disaggregation_bootstrap_port=port), path, tok)
    try:
        d = start_side(ServerArgs(**common, **(decode or {}), disaggregation_mode="decode"),
                       decode_path or path, load_tokenizer(decode_path) if decode_path else tok)
    except BaseException:
        p.close()
        raise
    return p, d, port


def drive(*sides: Side, until: Callable[[], object], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "did not finish"
        for s in sides:
            s.turn()


def pd_generate(prefill: Side, dec: Side, port: int, rid: str, ids: list[int], room: int,
                params: dict) -> list[int]:
    """``ids`` to both sides with ``room`` (as the router does) until both finished; the
    decode's output ids."""
    for s in (dec, prefill):
        s.inbox.append(GenerateReqInput(rid, ids, dict(params), bootstrap_host="127.0.0.1",
                                        bootstrap_port=port, bootstrap_room=room))
    drive(prefill, dec, until=lambda: dec.finished(rid) and prefill.finished(rid))
    return dec.ids(rid)


def assert_clean(*sides: Side) -> None:
    for s in sides:
        for _ in range(3):
            s.turn()
        assert s.sched.is_idle(), s.sched.get_info()
        s.sched.check_idle_invariants()
        assert not (s.sched.pd.manager.senders or s.sched.pd.manager.receivers)
