"""Load reports: SGLang's ``/get_load`` (what sglang-router polls) and ``/v1/loads``.

Both come from each live replica's ``Scheduler.get_info()``. ``/v1/loads`` is SGLang 0.5's
``LoadSnapshot`` per data-parallel rank: the core scalars, then the sections radixlm has
something to say in (``memory``, ``disaggregation``, ``queues``); ``speculative`` and
``lora`` are left out, as SGLang leaves out a section it lacks. Where SGLang's numbers
depend on a mechanism radixlm does not have, the value is what that mechanism would report
here: nothing is ever paused (``paused`` 0), and a decode server's requests move from
``prealloc`` to ``transfer`` as soon as their pages are reserved (``prealloc_ready`` 0).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping
from typing import Any

from fastapi import Response

from radixlm.runtime.entrypoints.http_utils import json_response
from radixlm.runtime.managers.api_error import ApiError

SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
# a section's name in the JSON (and in ``include``), and its metrics' prefix in Prometheus
_SECTION_NAMES = {"memory": "memory", "disaggregation": "disagg", "queues": "queues"}
GIB = float(1 << 30)


def legacy_load(info: dict[str, Any]) -> dict[str, Any]:
    """One replica's ``/get_load`` entry; ``num_tokens`` (what sglang-router balances on)
    is the KV tokens in use plus the tokens of waiting requests."""
    return {
        "dp_rank": info.get("dp_rank", 0),
        "num_reqs": info["num_running_reqs"] + info["num_waiting_reqs"],
        "num_waiting_reqs": info["num_waiting_reqs"],
        "num_tokens": info["used_tokens"] + info["num_waiting_tokens"],
        "num_pending_tokens": info["num_waiting_tokens"],
        "ts_tic": time.perf_counter(),
    }


def core_load(info: dict[str, Any]) -> dict[str, Any]:
    """SGLang's core scalars of one replica. In prefill/decode mode the transfer queues
    count as waiting, and a decode server's tokens whose KV has not arrived count in
    ``num_total_tokens`` but not in ``num_active_tokens``."""
    awaiting = info.get("num_decode_awaiting_tokens", 0)
    pending = info["num_waiting_tokens"] + awaiting + info.get("num_prefill_bootstrap_tokens", 0)
    total = info["used_tokens"] + pending
    waiting = info["num_waiting_reqs"] + sum(info.get(k, 0) for k in (
        "num_prefill_prealloc_queue_reqs", "num_decode_prealloc_queue_reqs",
        "num_decode_transfer_queue_reqs"))
    moments = info.get("decode_moments") or [0.0]
    return {
        "timestamp": time.time(), "dp_rank": info.get("dp_rank", 0),
        "num_running_reqs": info["num_running_reqs"], "num_waiting_reqs": waiting,
        "num_waiting_uncached_tokens": info.get("num_waiting_uncached_tokens", 0),
        "num_used_tokens": info["used_tokens"], "num_total_tokens": total,
        "num_active_tokens": max(total - awaiting - info.get("num_decode_transfer_tokens", 0),
                                 0),
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": info["max_total_num_tokens"],
        "max_running_requests": info["max_running_requests"],
        "token_usage": round(info["token_usage"], 4),
        "gen_throughput": round(info.get("gen_throughput", 0.0), 2),
        "cache_hit_rate": round(info["cache_hit_rate"], 4),
        "utilization": _utilization(info),
        "total_prefill_uncached_tokens": info.get("total_prefill_uncached_tokens", 0),
        "total_prefill_busy_us": info.get("total_prefill_busy_us", 0),
        "decode_moments": list(moments) if moments[0] > 0 else None,
    }


def _utilization(info: dict[str, Any]) -> float:
    """SGLang's definition: the larger of the running share and token usage over 0.9
    (-1 on a prefill server, whose load is its queue)."""
    if info.get("disaggregation_mode") == "prefill":
        return -1
    running = info["num_running_reqs"] / max(info["max_running_requests"], 1)
    return round(max(running, info["token_usage"] / 0.9), 4)


def load_sections(info: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The optional sections of one replica's snapshot."""
    seconds, transfers = info.get("kv_transfer_seconds", 0.0), info.get("kv_transfers", 0)
    sent = info.get("kv_transfer_sent_tokens", 0) * info.get("kv_transfer_bytes_per_token", 0)
    return {
        "memory": {
            "weight_gb": round(info.get("weight_bytes", 0) / GIB, 3),
            "kv_cache_gb": round(info.get("kv_cache_bytes", 0) / GIB, 3),
            "graph_gb": round(info.get("graph_bytes", 0) / GIB, 3),
            "token_capacity": info["max_total_num_tokens"],
        },
        "disaggregation": {
            "mode": info.get("disaggregation_mode", "null"),
            "prefill_bootstrap_queue_reqs": info.get("num_prefill_prealloc_queue_reqs", 0),
            "prefill_inflight_queue_reqs": info.get("num_prefill_inflight_queue_reqs", 0),
            "decode_prealloc_queue_reqs": info.get("num_decode_prealloc_queue_reqs", 0),
            "decode_transfer_queue_reqs": info.get("num_decode_transfer_queue_reqs", 0),
            "decode_retracted_queue_reqs": 0,  # a retracted request waits in the queue
            "kv_transfer_speed_gb_s": sent / GIB / seconds if seconds else 0.0,
            "kv_transfer_latency_ms": 1e3 * seconds / transfers if transfers else 0.0,
        },
        "queues": {
            "waiting": info.get("num_queue_reqs", info["num_waiting_reqs"]),
            "grammar": info.get("num_grammar_queue_reqs", 0),
            "paused": 0,
            "retracted": info.get("num_retracted_reqs", 0),
            "prealloc_ready": 0,
        },
    }


def v1_loads_response(infos: list[dict[str, Any]], query: Mapping[str, str], dp_size: int,
                      version: str, accelerator: str | None, num_accelerators: int
                      ) -> Response:
    """SGLang 0.5's ``/v1/loads`` (query: ``dp_rank``, ``include``, ``format=json|
    prometheus``) over the live replicas' infos (each with its ``dp_rank``)."""
    include, fmt = query.get("include"), query.get("format")
    sections = {s.strip() for s in include.split(",")} if include else {"all"}
    if not sections <= SECTIONS:
        raise ApiError(400, f"Invalid include sections: {sorted(sections - SECTIONS)}. "
                       f"Valid options: {sorted(SECTIONS)}", param="include")
    if fmt not in (None, "json", "prometheus"):
        raise ApiError(400, f"format must be json or prometheus, got {fmt!r}", param="format")
    rank = _dp_rank(query.get("dp_rank"), dp_size)
    loads = [_snapshot(info, sections) for info in infos
             if rank is None or info.get("dp_rank", 0) == rank]
    if fmt == "prometheus":
        return Response(_prometheus(loads), media_type="text/plain; version=0.0.4; charset=utf-8")
    return json_response({
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "version": version, "accelerator": accelerator, "num_accelerators": num_accelerators,
        "loads": loads,
    })


def _dp_rank(raw: str | None, dp_size: int) -> int | None:
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) >= dp_size:
        raise ApiError(400, f"dp_rank must be an integer in [0, {dp_size}) (--dp-size), "
                       f"got {raw!r}", param="dp_rank")
    return int(raw)


def _snapshot(info: dict[str, Any], include: set[str]) -> dict[str, Any]:
    load = core_load(info)
    if include == {"core"}:
        return load
    for key, section in load_sections(info).items():
        if "all" in include or _SECTION_NAMES[key] in include:
            load[key] = section
    return load


def _prometheus(loads: list[dict[str, Any]]) -> str:
    """One gauge per numeric field (a section's as ``sglang_<prefix>_<field>``), one sample
    per rank, as SGLang renders it."""
    samples: dict[str, list[tuple[int, float]]] = {}
    for load in loads:
        rank = load["dp_rank"]
        for key, value in load.items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        samples.setdefault(f"sglang_{_SECTION_NAMES[key]}_{sub}", []).append(
                            (rank, v))
            elif key != "dp_rank" and isinstance(value, (int, float)) \
                    and not isinstance(value, bool):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{dp_rank="{rank}"}} {v}' for rank, v in values]
    return "\n".join(lines) + "\n"
