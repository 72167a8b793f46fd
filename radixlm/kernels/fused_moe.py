"""Triton fused mixture of experts: every (token, expert) pair of a batch through its
expert's gated MLP in two grouped GEMMs, with no host sync (CUDA-graph capturable).

    align    pairs p = t * K + k sorted by expert, each expert's run padded to BLOCK_M
             sorted_ids [max_padded]  a pair, or N * K for padding
             expert_ids [max_blocks]  the expert of each BLOCK_M block of sorted_ids
             num_padded [1]           blocks from here on are empty: their programs return
    GEMM 1   gate_up[p] = x[p // K] @ w13[e].T                    [N * K, 2I]  x's dtype
    act      h = act_and_mul(gate_up)                             [N * K, I]   (torch: any
             activation of layers/activation.py; the hook for other gated activations)
    GEMM 2   y[p] = weight[p] * (h[p] @ w2[e].T)                  [N * K, H]   float32
    reduce   out[t] = sum_k y[t * K + k]                          [N, H]       x's dtype

Every size is a function of N, K, E and BLOCK_M alone (``max_padded = N*K + min(E, N*K) *
(BLOCK_M - 1)``, rounded up to BLOCK_M): the routing only changes values on the device, so
a captured graph replays any routing. Each program of a GEMM computes one BLOCK_M x BLOCK_N
tile of one expert's output rows; a block holds one expert's pairs only, so it reads one
expert's weight tile. Weights are stacked as transformers 5 holds them: ``w13`` [E, 2I, H]
(gate rows, then up rows), ``w2`` [E, H, I].

``fused_experts_reference`` is the torch twin (the same steps, one pair at a time).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from radixlm.kernels.decode_attention import dot_settings


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_ids, expert_ids, num_padded)`` of ``topk_ids`` [N, K] (see the module doc),
    with torch ops on ``topk_ids``' device and sizes known on the host (no sync)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    nk, dev = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in pair order
    # not bincount: on CUDA it reads the largest id back to size its output
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    sorted_expert = flat[order]
    rank = torch.arange(nk, device=dev) - (counts.cumsum(0) - counts)[sorted_expert]
    dest = (padded_end - padded)[sorted_expert] + rank  # [N*K]: slot of each sorted pair
    max_padded = triton.cdiv(nk + min(num_experts, nk) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((max_padded,), nk, dtype=torch.int64, device=dev)
    sorted_ids.scatter_(0, dest, order)
    block_start = torch.arange(0, max_padded, block_m, device=dev)
    # blocks past the last expert's run: clamped to a real expert, never read (num_padded)
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    return sorted_ids, expert_ids.clamp_(max=num_experts - 1), padded_end[-1:]


@triton.jit
def _grouped_gemm(
    a_ptr,  # [rows, K_DIM]: x (GEMM 1, row = pair // ROWS_PER_A) or h (GEMM 2, row = pair)
    b_ptr,  # [E, N_DIM, K_DIM]: each expert's weight, out x in
    c_ptr,  # [pairs, N_DIM]
    weights_ptr,  # [pairs]: routing weights (MUL_WEIGHT)
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    N_DIM,
    K_DIM,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    ROWS_PER_A: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = (N_DIM + BLOCK_N - 1) // BLOCK_N  # not tl.cdiv: a jit function, which fails
    # under the interpreter when Triton was imported before TRITON_INTERPRET was set
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the last expert's run
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    mask_m = pair < num_pairs  # padding rows load zeros and store nothing
    row = pair // ROWS_PER_A
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N_DIM
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K_DIM, BLOCK_K):
        mask_k = offs_k < K_DIM - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BK, BN]
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=mask_m, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _block_sizes(num_pairs: int, num_experts: int, dtype: torch.dtype,
                 on_cuda: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): short blocks when experts get few rows each (decode),
    so padding costs little; long ones when they get many (prefill)."""
    block_m = 16 if num_pairs <= 8 * num_experts or not on_cuda else 64
    block_k = 32 if dtype == torch.float32 and on_cuda else 64
    return block_m, 64, block_k


def _launch(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, weights: torch.Tensor | None,
            align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows_per_a: int,
            blocks: tuple[int, int, int]) -> None:
    """``c[p] = (weights[p] *) a[p // rows_per_a] @ w[e(p)].T`` for every pair p."""
    sorted_ids, expert_ids, num_padded = align
    n_dim, k_dim = w.shape[1], w.shape[2]
    block_m, block_n, block_k = blocks
    precision, dot_fp32 = dot_settings(a, w)
    grid = (expert_ids.numel() * triton.cdiv(n_dim, block_n),)
    _grouped_gemm[grid](
        a, w, c, c if weights is None else weights, sorted_ids, expert_ids, num_padded,
        c.shape[0], n_dim, k_dim,
        a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        ROWS_PER_A=rows_per_a,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=precision, DOT_FP32=dot_fp32,
    )


def check_layout(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Assert the shapes, dtypes and devices the kernel reads (bugs, not user errors)."""
    n, h = x.shape
    e, two_i, h13 = w13.shape
    assert h13 == h and two_i % 2 == 0, f"w13 {tuple(w13.shape)} for x {tuple(x.shape)}"
    assert w2.shape == (e, h, two_i // 2), f"w2 {tuple(w2.shape)}, want {(e, h, two_i // 2)}"
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == n, f"topk_ids {tuple(topk_ids.shape)}"
    assert topk_weights.shape == topk_ids.shape, \
        f"topk_weights {tuple(topk_weights.shape)} != topk_ids {tuple(topk_ids.shape)}"
    assert not topk_ids.is_floating_point(), f"topk_ids must be integer, got {topk_ids.dtype}"
    assert w13.dtype == w2.dtype == x.dtype, f"dtypes {x.dtype} {w13.dtype} {w2.dtype}"
    devices = {t.device for t in (x, w13, w2, topk_weights, topk_ids)}
    assert len(devices) == 1, f"tensors on several devices: {devices}"


def fused_experts_triton(
    x: torch.Tensor,  # [N, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [N, K]: float32 or x's dtype
    topk_ids: torch.Tensor,  # [N, K]: experts in [0, E)
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],  # [M, 2I] -> [M, I]
    b13: torch.Tensor | None = None,  # [E, 2I]: gate_up biases, added before the activation
    b2: torch.Tensor | None = None,  # [E, H]: down biases, weighted like the outputs
) -> torch.Tensor:  # [N, H]
    """``out[t] = sum_k weight[t, k] * expert[ids[t, k]](x[t])``; see the module doc. The
    biases ride on the pair-ordered tensors between the two GEMMs (a gather by expert id:
    nothing read back)."""
    check_layout(x, w13, w2, topk_weights, topk_ids)
    n, k = topk_ids.shape
    if n == 0:
        return torch.empty_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    num_experts, two_i, hidden = w13.shape
    blocks = _block_sizes(n * k, num_experts, x.dtype, x.is_cuda)
    align = moe_align_block_size(topk_ids, num_experts, blocks[0])
    gate_up = torch.empty(n * k, two_i, dtype=x.dtype, device=x.device)
    _launch(x, w13, gate_up, None, align, k, blocks)
    flat = topk_ids.reshape(-1)
    if b13 is not None:  # gate_up rows are in pair order (t * K + k)
        gate_up += b13[flat]
    h = act_and_mul(gate_up).contiguous()  # [N*K, I]
    assert h.shape == (n * k, two_i // 2), f"act_and_mul gave {tuple(h.shape)}"
    y = torch.empty(n * k, hidden, dtype=torch.float32, device=x.device)
    w = topk_weights.reshape(-1).contiguous()
    _launch(h, w2, y, w, align, 1, blocks)
    if b2 is not None:
        y += w[:, None].float() * b2[flat].float()
    return y.view(n, k, hidden).sum(dim=1).to(x.dtype)


def fused_experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, act_and_mul: Callable[[torch.Tensor], torch.Tensor],
    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch twin of ``fused_experts_triton``: each pair through its expert's gathered
    weights (a copy per pair: for tests), the same roundings."""
    check_layout(x, w13, w2, topk_weights, topk_ids)
    n, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    rows = x.repeat_interleave(k, dim=0)[:, :, None]  # [N*K, H, 1]
    gate_up = torch.bmm(w13[flat], rows)[..., 0]  # [N*K, 2I]
    if b13 is not None:
        gate_up = gate_up + b13[flat]
    h = act_and_mul(gate_up)[:, :, None]
    y = torch.bmm(w2[flat], h)[..., 0].float()
    if b2 is not None:
        y = y + b2[flat].float()
    y = y * topk_weights.reshape(-1, 1).float()
    return y.view(n, k, -1).sum(dim=1).to(x.dtype)
