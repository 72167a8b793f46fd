"""Attention and layer kernels over the paged KV pool, dispatched by device.

``backend=None`` picks Triton for CUDA tensors and the torch reference otherwise.
"""

from __future__ import annotations

import torch

from radixlm.kernels import reference

__all__ = ["decode_attention", "extend_attention", "store_kv", "rms_norm", "apply_rotary"]


def _use_triton(backend: str | None, t: torch.Tensor) -> bool:
    if backend is None:
        return t.is_cuda
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be None, 'torch' or 'triton', got {backend!r}")
    return backend == "triton"


def _triton_unavailable(name: str):
    raise NotImplementedError(f"the Triton {name} kernel is not available yet")


def decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, sm_scale, backend=None):
    if _use_triton(backend, q):
        _triton_unavailable("decode_attention")
    return reference.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, sm_scale)


def extend_attention(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, sm_scale,
                     backend=None):
    if _use_triton(backend, q):
        _triton_unavailable("extend_attention")
    return reference.extend_attention(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices,
                                      sm_scale)


def store_kv(k_buf, v_buf, loc, k, v, backend=None):
    if _use_triton(backend, k):
        _triton_unavailable("store_kv")
    return reference.store_kv(k_buf, v_buf, loc, k, v)


def rms_norm(x, weight, eps, residual=None, backend=None):
    if _use_triton(backend, x):
        _triton_unavailable("rms_norm")
    return reference.rms_norm(x, weight, eps, residual)


def apply_rotary(q, k, cos_sin_cache, positions, backend=None):
    if _use_triton(backend, q):
        _triton_unavailable("apply_rotary")
    return reference.apply_rotary(q, k, cos_sin_cache, positions)
