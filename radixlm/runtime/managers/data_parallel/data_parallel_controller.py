"""The replicas of ``--dp-size`` (SGLang's name for the module): the server's
``DataParallelController`` (one PUSH socket per scheduler process, the balancer, and the
dead replicas with why they died; ``Engine(dp_size > 1)`` uses it too), each replica's
settings (``replica_args``) and load report (``replica_load``), and their infos
summed (``aggregate_infos``). Which replica serves a request: ``load_balancer.py``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import zmq

from radixlm.radix_cache.kv_events import decode_batch
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.managers.data_parallel.load_balancer import balancer_for
from radixlm.runtime.managers.messages import (
    AbortReq,
    GenerateReqInput,
    ReplicaKVEvents,
    ReplicaLoad,
    encode,
)

logger = logging.getLogger(__name__)


class DataParallelController:
    """The tokenizer manager's link to the scheduler processes (``addrs``, one per replica):
    requests go to the replica the balancer picks, aborts to the replica serving the rid,
    control messages to every live replica."""

    def __init__(self, args: ServerArgs, addrs: list[str]) -> None:
        self.balancer = balancer_for(args, len(addrs))
        self.dead: dict[int, str] = {}  # rank -> why it was taken out
        self._ctx = zmq.Context()
        self._pushes = []
        for addr in addrs:
            push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.connect(addr)
            self._pushes.append(push)

    @property
    def dp_size(self) -> int:
        return len(self._pushes)

    def live(self) -> list[int]:
        return self.balancer.live()

    def send_req(self, msg: GenerateReqInput, data: bytes) -> int:
        """Send an encoded request to its replica (NoReplica when none lives)."""
        rank = self.balancer.select(msg)
        self._pushes[rank].send(data)
        self.balancer.sent(rank, msg)
        return rank

    def on_kv_events(self, msg: ReplicaKVEvents) -> None:
        self.balancer.on_kv_events(msg.dp_rank, decode_batch(msg.batch))

    def send_to(self, rank: int, data: bytes) -> None:
        self._pushes[rank].send(data)

    def abort(self, rid: str) -> None:
        rank = self.balancer.owner(rid)
        data = encode(AbortReq(rid))
        for r in [rank] if rank is not None else self.live():
            self._pushes[r].send(data)

    def broadcast(self, data: bytes) -> list[int]:
        live = self.live()
        for r in live:
            self._pushes[r].send(data)
        return live

    def retire(self, rank: int, why: str) -> list[str]:
        """Replica ``rank`` is dead; returns the rids it was serving."""
        self.dead[rank] = why
        return self.balancer.retire(rank)

    def close(self) -> None:
        for push in self._pushes:
            push.close(linger=0)
        self._ctx.term()


def replica_args(args: ServerArgs, dp_rank: int) -> ServerArgs:
    """The settings of replica ``dp_rank``: on GPUs its own devices, from ``cuda:(base_gpu_id
    + dp_rank * ranks per machine)`` (its tensor-parallel ranks take the next ones, as in
    SGLang); on a CPU the same settings. With ``--dist-init-addr host:port`` and several
    replicas, replica r's tensor-parallel group meets at ``host:(port + r)``."""
    if args.dp_size > 1 and args.dist_init_addr is not None:
        host, port = args.dist_init_addr.rsplit(":", 1)
        args = dataclasses.replace(args, dist_init_addr=f"{host}:{int(port) + dp_rank}")
    on_cuda = args.device.startswith("cuda") or (args.device == "auto"
                                                 and torch.cuda.is_available())
    if not on_cuda or (args.dp_size == 1 and args.base_gpu_id == 0):
        return args
    first = args.base_gpu_id + dp_rank * (args.tp_size // args.nnodes)
    return dataclasses.replace(args, device=f"cuda:{first}")


def replica_load(scheduler: Any, dp_rank: int, received: int) -> ReplicaLoad:
    """A ``Scheduler``'s load between two steps, with every request it has read so far
    (``received``) in it: running + waiting + held requests, KV tokens in use + tokens the
    waiting ones still have to compute (beyond their cached prefix: a prompt whose prefix
    the replica holds adds little work) + tokens of the held ones."""
    waiting = [*scheduler.waiting, *scheduler.grammar_waiting]
    reqs = (len(scheduler.running) + (scheduler.chunked_req is not None) + len(waiting)
            + len(scheduler.held))
    tokens = (scheduler.cache.used_size() + scheduler.waiting_uncached_tokens()
              + sum(len(m.input_ids) for m in scheduler.held))
    return ReplicaLoad(dp_rank, received, reqs, tokens)


# --- server info over replicas ---------------------------------------------------------------
NOT_SUMMED = ("page_size", "context_length", "weight_version")


def aggregate_infos(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's info from its replicas' ``Scheduler.get_info()``: counts and sizes are
    summed, rates recomputed from the sums, the rest taken from the first replica."""
    if len(infos) == 1:
        return dict(infos[0])
    out = dict(infos[0])
    for key, value in infos[0].items():
        if key in NOT_SUMMED or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[key] = sum(i.get(key, 0) for i in infos)
    spaces: dict[str, dict[str, int]] = {}
    for info in infos:
        for ns, counts in info.get("namespace_cache", {}).items():
            acc = spaces.setdefault(ns, {"prompt_tokens": 0, "cached_tokens": 0})
            for k in acc:
                acc[k] += counts.get(k, 0)
    out["namespace_cache"] = spaces
    snaps = [i["grammar_compile_time"] for i in infos if i.get("grammar_compile_time")]
    if snaps:  # same buckets everywhere: counts and sums add up
        out["grammar_compile_time"] = {
            "buckets": snaps[0]["buckets"], "sum": sum(s["sum"] for s in snaps),
            "counts": [sum(c) for c in zip(*(s["counts"] for s in snaps))]}
    moments = [i["decode_moments"] for i in infos if i.get("decode_moments")]
    if moments:  # sums over steps: they add up over replicas too
        out["decode_moments"] = [sum(m) for m in zip(*moments)]
    out["cache_hit_rate"] = out.get("cached_tokens", 0) / max(out.get("prompt_tokens", 0), 1)
    out["token_usage"] = out["used_tokens"] / max(out["max_total_num_tokens"], 1)
    return out
