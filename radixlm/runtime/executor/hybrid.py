"""Serving a hybrid model (linear-attention layers beside attention, ``ModelConfig.is_hybrid``):
its state pool, and the features that cannot serve one yet, refused at start-up by name.

The radix cache keeps the linear layers' state after cached prefixes (snapshots, in slots of
the state pool beside the requests' own: ``snapshot_state_slots``; the tree's side is
``radix_cache/snapshot_tree.py``): a request matching a prefix starts from the snapshot.

What does not work yet, and why:

- ``--disaggregation-mode`` with ``--tp-size`` > 1: the state travels with the K/V from and
  to one rank's state pool (``disaggregation/kv_buffers.py``), not a sharded one.
- ``--enable-hierarchical-cache``: the storage tier keeps K/V pages only (and needs the tree).
- ``--enable-hybrid-swa-memory``: no hybrid family has sliding layers.
- ``--is-embedding``: pooling over a hybrid is untested.
Decode CUDA graphs are off for hybrids (the state's gather and scatter are not captured).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from radixlm.radix_cache.state_pool import StatePool, StateSpec
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.model_config import ModelConfig

logger = logging.getLogger(__name__)


def refuse_hybrid_features(args: ServerArgs, config: ModelConfig) -> None:
    """ValueError naming the first flag a hybrid model cannot serve with yet."""
    if not config.is_hybrid:
        return
    model = f"{'/'.join(config.architectures)} (a hybrid of linear-attention layers)"
    refused = [
        (args.disaggregation_mode != "null" and args.tp_size > 1, f"--disaggregation-mode "
         f"{args.disaggregation_mode} and --tp-size {args.tp_size}: its recurrent state "
         "travels from and to one rank's state pool only"),
        (args.enable_hierarchical_cache, "--enable-hierarchical-cache: the storage tier keeps "
         "K/V pages, not its recurrent state"),
        (args.enable_hybrid_swa_memory, "--enable-hybrid-swa-memory: it has no sliding "
         "layers, and the SWA pool does not hold recurrent state"),
        (args.is_embedding, "--is-embedding: pooling a hybrid model is not supported yet"),
    ]
    for bad, why in refused:
        if bad:
            raise ValueError(f"{model} cannot be served with {why}")


def state_pool_slots(rows: int, explicit: bool, kv_pool_bytes: int, per_slot: int) -> int:
    """State slots: one per request row (``rows``: the scheduler's running requests + 1).
    Unless --max-running-requests set them (``explicit``), no more than the KV pool's bytes
    buy: a released hybrid's state is tens of MiB a request (Qwen3.5-9B's 24 linear layers:
    about 50 MiB), so 257 default rows could outgrow the KV pool many times."""
    if explicit:
        return rows
    return max(min(rows, kv_pool_bytes // per_slot + 1), 2)


def snapshot_state_slots(request_slots: int, explicit: bool, kv_pool_bytes: int,
                         per_slot: int, radix_cache: bool) -> int:
    """State slots for the radix tree's snapshots (0 with the radix cache off): as many as
    the requests have, as SGLang gives its Mamba cache about the KV pool's memory, and unless
    --max-running-requests set the rows, no more than the KV pool's bytes buy. A snapshot is
    a cached prefix's whole reusable state, so fewer would leave K/V in the tree that no
    match can use; they are evicted least recently used, apart from the K/V."""
    if not radix_cache:
        return 0
    if explicit:
        return max(request_slots, 2)
    return max(min(request_slots, kv_pool_bytes // per_slot), 2)


def make_state_pool(specs: dict[int, StateSpec], size: int, dtype: torch.dtype,
                    device: torch.device) -> StatePool:
    """``size`` slots of every linear layer's state (conv in ``dtype``, the delta rule's
    matrix in float32)."""
    pool = StatePool(size, specs, dtype, device)
    logger.info("state pool: %d slots of %d linear layers' state, %.1f MiB each, %.2f GiB in "
                "all", size, len(specs), StatePool.bytes_per_slot(specs, dtype) / (1 << 20),
                pool.nbytes / (1 << 30))
    return pool


def is_hybrid_model(model: nn.Module) -> bool:
    return hasattr(model, "state_specs")
