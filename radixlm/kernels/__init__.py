"""Attention and layer kernels over the paged KV pool, dispatched by device.

``backend=None`` picks Triton for CUDA tensors and the torch reference otherwise, except
that the layer kernels (``rms_norm``, ``apply_rotary``, ``silu_and_mul``) and the KV pool's
write (``store_kv``) take the C++ kernels of ``cpu_fused`` for float32 / bfloat16 CPU
tensors when they are built (RMSNorm: bfloat16 only);
Attention with a sliding window or logit soft-capping (``sliding_window`` /
``logit_cap``) runs in the Triton kernels on the Triton path (both features compiled in
when set); on the torch path in the compiled CPU kernel when the plan has it
(``AttentionPlan.masked_passes``: a CPU with the kernel built, at any number of rows), else
in ``masked_attention`` (the padded passes have neither feature). Attention sinks
(``sinks``, gpt-oss) run everywhere: in the Triton kernels, in ``masked_attention``, and
along a plan (planned passes and the compiled CPU kernel) from each row's log-sum-exp;
only the plain reference without a plan sends them to ``masked_attention``.
``"torch"`` / ``"triton"`` force one (``"torch"``: always the pure torch reference; Triton
on CPU tensors needs ``TRITON_INTERPRET=1`` set before the first Triton call). Both
attention backends check the layout with the same helpers (``reference.check_*_layout``)
and raise the same ``ValueError`` for a bad batch.

The Triton modules are imported on first use: importing them defines the kernels, which
is when Triton reads ``TRITON_INTERPRET``, and a CPU-only engine never pays for it.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable

import torch

from radixlm.kernels import cpu_fused, masked_attention, reference
from radixlm.kernels.reference import Layout
from radixlm.kernels.shared_prefix import AttentionPlan, planned_attention

__all__ = ["decode_attention", "extend_attention", "store_kv", "rms_norm", "apply_rotary",
           "silu_and_mul", "fused_experts"]


def _use_triton(backend: str | None, t: torch.Tensor) -> bool:
    if backend is None:
        return t.is_cuda
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be None, 'torch' or 'triton', got {backend!r}")
    return backend == "triton"


def use_triton(backend: str | None, t: torch.Tensor) -> bool:
    """Whether ``backend`` (None: by ``t``'s device) runs the Triton kernels."""
    return _use_triton(backend, t)


def _use_fused(backend: str | None, *tensors: torch.Tensor) -> bool:
    """backend None on CPU tensors the fused C++ kernels take (after ``_use_triton``)."""
    return backend is None and cpu_fused.supports(*tensors)


def _kernel_takes(plan: AttentionPlan | None, sliding_window: int | None) -> bool:
    """Whether a windowed / capped layer runs in the compiled CPU kernel along ``plan``."""
    return plan is not None and plan.masked_passes(sliding_window) is not None


def _triton(module: str) -> types.ModuleType:
    return importlib.import_module(f"{__name__}.{module}")


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    kv_indptr: torch.Tensor,  # [B+1]
    kv_indices: torch.Tensor,  # [nnz]: each sequence's whole KV, new token included
    sm_scale: float,
    backend: str | None = None,
    out: torch.Tensor | None = None,  # [B, Hq, D], written in place when given
    plan: AttentionPlan | None = None,  # torch path: this forward's precomputed indices
    layout: Layout | None = None,  # Triton path: host-side extents (no device read-back)
    sliding_window: int | None = None,  # keys within this many positions of the query
    logit_cap: float | None = None,  # scores soft-capped to cap * tanh(s / cap)
    sinks: torch.Tensor | None = None,  # [Hq]: a logit per head in the softmax, no value
) -> torch.Tensor:  # [B, Hq, D]
    """One query token per sequence attends to its whole KV, gathered via ``kv_indices``.

    ``plan`` (``shared_prefix.AttentionPlan``, built once per forward for this layout) lets
    the torch path skip per-layer index work and read K/V that several sequences share
    once per group; the Triton path ignores it. With ``sliding_window`` or ``logit_cap``:
    the Triton kernel, or on the torch path the compiled CPU kernel along ``plan`` when it
    has one, else ``masked_attention`` (see the module doc)."""
    masked = sliding_window is not None or logit_cap is not None
    if masked:
        masked_attention.check_options(sliding_window, logit_cap)
    masked_attention.check_sinks(sinks, q.shape[1])
    if _use_triton(backend, q):
        return _triton("decode_attention").decode_attention_triton(
            q, k_buf, v_buf, kv_indptr, kv_indices, sm_scale, out=out, layout=layout,
            sliding_window=sliding_window, logit_cap=logit_cap, sinks=sinks,
        )
    if masked and _kernel_takes(plan, sliding_window):
        return planned_attention(plan, q, None, None, k_buf, v_buf, sm_scale, out, sinks,
                                 sliding_window, logit_cap)
    if masked or (sinks is not None and plan is None):
        return masked_attention.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices,
                                                 sm_scale, sliding_window, logit_cap, out,
                                                 sinks)
    if plan is not None:
        return planned_attention(plan, q, None, None, k_buf, v_buf, sm_scale, out, sinks)
    return reference.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, sm_scale, out)


def extend_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    qo_indptr: torch.Tensor,  # [B+1]: new-token ranges
    kv_indptr: torch.Tensor,  # [B+1]: cached-prefix ranges into kv_indices
    kv_indices: torch.Tensor,  # [nnz_prefix]
    sm_scale: float,
    backend: str | None = None,
    out: torch.Tensor | None = None,  # [N, Hq, D], written in place when given
    plan: AttentionPlan | None = None,  # torch path: see decode_attention
    layout: Layout | None = None,  # Triton path: see decode_attention
    sliding_window: int | None = None,  # see decode_attention
    logit_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # see decode_attention
) -> torch.Tensor:  # [N, Hq, D]
    """New tokens attend to their cached prefix and, causally, to each other."""
    masked = sliding_window is not None or logit_cap is not None
    if masked:
        masked_attention.check_options(sliding_window, logit_cap)
    masked_attention.check_sinks(sinks, q.shape[1])
    if _use_triton(backend, q):
        return _triton("extend_attention").extend_attention_triton(
            q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, sm_scale, out=out,
            layout=layout, sliding_window=sliding_window, logit_cap=logit_cap, sinks=sinks,
        )
    if masked and _kernel_takes(plan, sliding_window):
        return planned_attention(plan, q, k, v, k_buf, v_buf, sm_scale, out, sinks,
                                 sliding_window, logit_cap)
    if masked or (sinks is not None and plan is None):
        return masked_attention.extend_attention(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr,
                                                 kv_indices, sm_scale, sliding_window,
                                                 logit_cap, out, sinks)
    if plan is not None:
        return planned_attention(plan, q, k, v, k_buf, v_buf, sm_scale, out, sinks)
    return reference.extend_attention(
        q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, sm_scale, out
    )


def store_kv(
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    loc: torch.Tensor,  # [N]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    backend: str | None = None,
) -> None:
    """Write the new tokens' K/V rows into their slots ``loc`` of the pool."""
    if _use_triton(backend, k):
        _triton("store_kv").store_kv_triton(k_buf, v_buf, loc, k, v)
        return
    if _use_fused(backend, k_buf, k, v) and cpu_fused.stores(k_buf, k, v):
        cpu_fused.store_kv(k_buf, v_buf, loc, k, v)
        return
    reference.store_kv(k_buf, v_buf, loc, k, v)


def rms_norm(
    x: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [N, H]
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with ``residual`` returns ``(norm(x + residual) * weight, x + residual)``."""
    if _use_triton(backend, x):
        return _triton("norm_rope").rms_norm_triton(x, weight, eps, residual)
    # float32 rows take the kernel only where it gives the reference's bits (torch's own
    # order of the sum of squares: the engine's float32 logits must stay within 1e-4 of
    # transformers', and a 16-lane sum's ulps reached 1.4e-4 over 12+ layers)
    if x.dim() == 2 and _use_fused(backend, x) and (
            x.dtype != torch.float32 or cpu_fused.exact_float32_norm(x.shape[1])):
        return cpu_fused.rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def apply_rotary(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32: cat(cos[:, :D/2], sin[:, :D/2])
    positions: torch.Tensor,  # [N]
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding of q and k; returns new tensors."""
    if _use_triton(backend, q):
        return _triton("norm_rope").apply_rotary_triton(q, k, cos_sin_cache, positions)
    if q.dtype == k.dtype and _use_fused(backend, q, k):
        return cpu_fused.apply_rotary(q, k, cos_sin_cache, positions)
    return reference.apply_rotary(q, k, cos_sin_cache, positions)


def silu_and_mul(
    x: torch.Tensor,  # [N, 2I]: cat(gate, up)
    backend: str | None = None,
) -> torch.Tensor:  # [N, I]
    """The gated MLP's activation ``silu(gate) * up``. Triton has no kernel for it: on CUDA
    (and with ``"triton"``) it is the torch expression, which fuses nothing there either."""
    if backend not in (None, "torch", "triton"):
        raise ValueError(f"backend must be None, 'torch' or 'triton', got {backend!r}")
    if x.dim() == 2 and _use_fused(backend, x):
        return cpu_fused.silu_and_mul(x)
    return reference.silu_and_mul(x)


def fused_experts(
    x: torch.Tensor,  # [N, H]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [N, K]
    topk_ids: torch.Tensor,  # [N, K]
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],  # [M, 2I] -> [M, I]
    backend: str | None = None,
    b13: torch.Tensor | None = None,  # [E, 2I]: each expert's gate_up bias (gpt-oss)
    b2: torch.Tensor | None = None,  # [E, H]: each expert's down bias
) -> torch.Tensor:  # [N, H]
    """Each token's top-k experts' gated MLPs, weighted and summed, in the Triton fused-MoE
    kernel (``fused_moe``: no host sync, CUDA-graph capturable); ``"torch"``: its twin, one
    pair at a time (tests; the engine's CPU path is ``layers/moe.py``'s grouped one)."""
    module = _triton("fused_moe")
    fn = module.fused_experts_triton if _use_triton(backend, x) else \
        module.fused_experts_reference
    return fn(x, w13, w2, topk_weights, topk_ids, act_and_mul, b13, b2)


class _KernelsPackage(types.ModuleType):
    """Importing submodule ``radixlm.kernels.decode_attention`` would bind the name
    ``decode_attention`` on this package to the module, hiding the function of the same
    name; the public functions keep their names here."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in __all__ and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _KernelsPackage
