"""``/get_server_info``: the full form for every caller but a tenant, a tenant's own for it.

The full form is SGLang's: the settings (no secret), the info summed over the replicas,
each replica's own (``internal_states``), the processes' pids. A tenant (``auth.py``) sees
an allow-list instead: the limits its requests must respect and its own figures (its cache
namespace's counts, its requests in flight) — no other tenant, no pid, no file path, and
no server-wide count (those are everybody's traffic).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.managers.data_parallel.data_parallel_controller import aggregate_infos
from radixlm.runtime.managers.tokenizer_manager.tenant_rids import rid_tenant
from radixlm.runtime.managers.tokenizer_manager.tokenizer_manager import TokenizerManager
from radixlm.runtime.managers.validation import cache_namespace, namespace_label

SECRETS = ("api_key", "admin_api_key")  # ServerArgs fields never shown in a response
# the settings a tenant sees: what its requests must respect (never a path or an address)
TENANT_SETTINGS = (
    "served_model_name", "max_request_bytes", "request_read_timeout", "max_n",
    "max_stop_sequences", "max_stop_length", "max_logit_bias", "max_top_logprobs_num",
    "grammar_backend", "grammar_compile_timeout", "enable_priority_scheduling",
    "max_queued_requests", "tokenizer_metrics_allowed_custom_labels",
    "tokenizer_metrics_custom_labels_header", "disaggregation_mode",
)
# the scheduler's info a tenant sees: sizes and versions, no counts of anyone's traffic
TENANT_INFO = ("context_length", "max_total_num_tokens", "page_size", "max_running_requests",
               "kv_cache_dtype", "weight_version")
TENANT_MODEL_INFO = ("dtype", "device", "vocab_size")  # not the scheduler's pid


def public_model_name(args: ServerArgs, model_path: str) -> str:
    """The model's name where a tenant may see it: ``--served-model-name``, else the
    checkpoint directory's name, never its path (SGLang's default name is the path)."""
    return args.served_model_name or os.path.basename(os.path.normpath(model_path))


def tenant_model_info(info: dict[str, Any], args: ServerArgs, model_path: str
                      ) -> dict[str, Any]:
    """``/get_model_info`` for a tenant: names where SGLang shows the model's and the
    tokenizer's paths (SGLang's frontend reads ``model_path`` for the name only)."""
    name = public_model_name(args, model_path)
    tokenizer = os.path.basename(os.path.normpath(args.tokenizer_path)) \
        if args.tokenizer_path else name
    return {**info, "model_path": name, "tokenizer_path": tokenizer}


async def full_server_info(tm: TokenizerManager, args: ServerArgs,
                           pids: dict[str, int | None]) -> dict[str, Any]:
    """The server's settings and info summed over its replicas; ``internal_states``
    (SGLang's key) holds each live replica's own, ``dp_replicas`` what the dispatcher
    counts per replica and why a dead one was taken out, ``dp_decisions`` how often
    cache_aware followed the cache, balanced the load or found no cached prefix."""
    replicas = await tm.replica_infos()
    info = aggregate_infos(replicas)
    info.pop("dp_rank", None)
    dead = tm.dp.dead
    return {
        **{k: v for k, v in dataclasses.asdict(args).items() if k not in SECRETS},
        **info,
        "model_path": tm.model_path,
        **tm.model_info,
        "num_inflight_requests": len(tm.states),
        "pids": {"main": os.getpid(), **pids},
        "internal_states": replicas,
        "dp_replicas": [{**load, "dead": dead.get(load["dp_rank"])}
                        for load in tm.dp.balancer.loads()],
        "dp_decisions": dict(tm.dp.balancer.decisions),  # cache_aware: cache / balance / miss
    }


async def tenant_server_info(tm: TokenizerManager, args: ServerArgs, tenant: str
                             ) -> dict[str, Any]:
    """What ``tenant`` may know: the limits of its requests and its own figures."""
    info = await tm.get_info()
    label = namespace_label(cache_namespace(tenant=tenant))  # all its namespaces' label
    own = info.get("namespace_cache", {}).get(label, {"prompt_tokens": 0, "cached_tokens": 0})
    return {
        **{k: getattr(args, k) for k in TENANT_SETTINGS},
        **{k: info[k] for k in TENANT_INFO if k in info},
        **{k: tm.model_info[k] for k in TENANT_MODEL_INFO if k in tm.model_info},
        "tenant": tenant,
        "namespace_cache": {label: own},
        "num_inflight_requests": sum(rid_tenant(r) == tenant for r in tm.states),
    }
