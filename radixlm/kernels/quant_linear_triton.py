"""Triton GEMM by a quantized weight: ``y = x @ W.T + bias`` with ``W`` a ``QuantWeight``
(``kernels/qweight.py``: w4 nibbles, w8 int8 or fp8 codes, float32 group scales, optional
offsets), dequantized tile by tile in registers, never in memory.

    x      [M, K]   x's dtype; act-order (``perm``) applied before the kernel:
                    ``x.index_select(-1, perm)``, so stored column j meets input feature perm[j]
    codes  [N, KC]  w4: uint8, column c in byte c // 2 (low nibble even c, high odd c);
                    w8: int8; fp8: float8_e4m3fn (KC = K)
    scales [N, G]   float32, group g = c // group covers columns [g * group, (g+1) * group)
    mins   [N, G]   float32 offsets (unsigned codes: AWQ, GGUF Q4_1 / Q4_K), optional
    y      [M, N]   x's dtype; float32 accumulation, bias added in float32

Each program computes one BLOCK_M x BLOCK_N tile of ``y``. Per BLOCK_K step it loads the
codes of a [BLOCK_K, BLOCK_N] tile of ``W.T``, its scales (and offsets), forms
``q * s + m`` in float32, casts it to the dot's dtype (x's dtype on a GPU, float32 for
float32 x and under the interpreter) and runs ``tl.dot``. When every K step lies inside one
group (``group`` a multiple of BLOCK_K, or one group per row) a step reads one scale per
output column; otherwise (any other group, e.g. 24) it gathers a scale per element, which
hits the cache. Odd N, K and a short last group are handled by masks.

The reference twin is ``qweight.reference_linear`` (float64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.decode_attention import dot_settings
from radixlm.kernels.qweight import QuantWeight

_KIND_CODE = {"w4": 0, "w8": 1, "fp8": 2}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _dequant_tile(q_ptr, s_ptr, m_ptr, offs_n, mask_n, cols, mask_k, k0, GROUP, stride_qn,
                  stride_sn, stride_mn, KIND: tl.constexpr, HAS_MINS: tl.constexpr,
                  SCALE_PER_STEP: tl.constexpr):
    """``W.T[cols, offs_n]`` = ``q * scale + min`` as float32 [BLOCK_K, BLOCK_N]; masked
    elements are 0 (their x is 0 too)."""
    mask = mask_k[:, None] & mask_n[None, :]
    row = offs_n[None, :] * stride_qn
    if KIND == 0:  # w4: both nibbles of a byte are read by two neighbouring rows of the tile
        byte = tl.load(q_ptr + row + (cols // 2)[:, None], mask=mask, other=0)
        shift = ((cols % 2) * 4).to(tl.uint8)[:, None]
        q = ((byte >> shift) & 0x0F).to(tl.float32)
    elif KIND == 1:
        q = tl.load(q_ptr + row + cols[:, None], mask=mask, other=0).to(tl.float32)
    else:  # fp8: no `other` (the interpreter cannot cast it to fp8); masked lanes are
        # undefined, possibly NaN, and NaN * 0 would poison the dot
        q = tl.where(mask, tl.load(q_ptr + row + cols[:, None], mask=mask).to(tl.float32), 0.0)
    if SCALE_PER_STEP:
        g = k0 // GROUP
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0)[None, :]
        w = q * s
        if HAS_MINS:
            w += tl.load(m_ptr + offs_n * stride_mn + g, mask=mask_n, other=0.0)[None, :]
    else:
        g = (cols // GROUP)[:, None]
        w = q * tl.load(s_ptr + offs_n[None, :] * stride_sn + g, mask=mask, other=0.0)
        if HAS_MINS:
            w += tl.load(m_ptr + offs_n[None, :] * stride_mn + g, mask=mask, other=0.0)
    return w


@triton.jit
def _quant_gemm(
    x_ptr,  # [M, K]
    q_ptr,  # [N, KC]: codes
    s_ptr,  # [N, G]: float32 scales
    m_ptr,  # [N, G]: float32 offsets (HAS_MINS)
    bias_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N]
    M,
    N,
    K,
    GROUP,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_mn,
    stride_ym,
    KIND: tl.constexpr,  # 0 w4, 1 w8, 2 fp8
    HAS_MINS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_PER_STEP: tl.constexpr,  # each K step inside one group
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = (N + BLOCK_N - 1) // BLOCK_N  # not tl.cdiv: see fused_moe._grouped_gemm
    pid_m = pid // num_n
    pid_n = pid % num_n
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M * N may pass 2^31
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k  # [BLOCK_K]: stored columns of this step
        mask_k = cols < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        w = _dequant_tile(q_ptr, s_ptr, m_ptr, offs_n, mask_n, cols, mask_k, k0, GROUP,
                          stride_qn, stride_sn, stride_mn, KIND, HAS_MINS,
                          SCALE_PER_STEP)  # [BK, BN] float32
        if DOT_FP32:
            a = a.to(tl.float32)
        else:
            w = w.to(x_ptr.dtype.element_ty)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def block_sizes(m: int, qw: QuantWeight) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): short row blocks for decode (few rows, so narrower
    column blocks to keep the multiprocessors busy); BLOCK_K the group itself for groups
    16 and 32, so a step never straddles two groups."""
    block_m, block_n = (16, 32) if m <= 16 else ((32, 64) if m <= 64 else (64, 64))
    block_k = 64
    if qw.groups > 1 and qw.group in (16, 32):
        block_k = qw.group
    return block_m, block_n, block_k


def check_layout(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> None:
    """Assert the shapes, dtypes, strides and devices the kernel reads (bugs, not user
    errors)."""
    qw.check()
    assert x.dtype in _FLOAT_DTYPES, f"x {x.dtype}, expected one of {_FLOAT_DTYPES}"
    assert x.shape[-1] == qw.k, f"x {tuple(x.shape)} for a weight of shape {qw.shape}"
    tensors = [x, qw.data, qw.scales]
    for name in ("data", "scales", "mins"):
        t = getattr(qw, name)
        if t is not None:
            assert t.stride(1) == 1, f"{name} stride {t.stride()}: columns must be contiguous"
            tensors.append(t)
    if qw.perm is not None:
        tensors.append(qw.perm)
    if bias is not None:
        assert bias.shape == (qw.n,) and bias.is_floating_point(), \
            f"bias {bias.dtype} {tuple(bias.shape)}, expected a float ({qw.n},)"
        tensors.append(bias)
    if out is not None:
        want = (*x.shape[:-1], qw.n)
        assert out.shape == want and out.dtype == x.dtype and out.is_contiguous(), \
            f"out {out.dtype} {tuple(out.shape)}, expected contiguous {x.dtype} {want}"
        tensors.append(out)
    devices = {t.device for t in tensors}
    assert len(devices) == 1, f"tensors on several devices: {devices}"


def linear(
    x: torch.Tensor,  # [..., K]
    qw: QuantWeight,
    bias: torch.Tensor | None = None,  # [N], any float dtype
    out: torch.Tensor | None = None,  # [..., N] in x's dtype, written in place when given
) -> torch.Tensor:  # [..., N] in x's dtype
    """``x @ qw.dequantize().T + bias`` in one kernel (see the module doc); CPU tensors run
    in Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported)."""
    check_layout(x, qw, bias, out)
    lead = x.shape[:-1]
    if qw.perm is not None:
        x = x.index_select(-1, qw.perm)  # stored column j multiplies feature perm[j]
    x2 = x.reshape(-1, qw.k).contiguous()  # [M, K]
    m = x2.shape[0]
    y = torch.empty(*lead, qw.n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    block_m, block_n, block_k = block_sizes(m, qw)
    precision, dot_fp32 = dot_settings(x2, x2)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(qw.n, block_n),)
    mins = qw.scales if qw.mins is None else qw.mins  # a dummy pointer when absent
    _quant_gemm[grid](
        x2, qw.data, qw.scales, mins, y if bias is None else bias, y,
        m, qw.n, qw.k, qw.group,
        x2.stride(0), qw.data.stride(0), qw.scales.stride(0), mins.stride(0), qw.n,
        KIND=_KIND_CODE[qw.kind],
        HAS_MINS=qw.mins is not None,
        HAS_BIAS=bias is not None,
        SCALE_PER_STEP=qw.groups == 1 or qw.group % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=precision, DOT_FP32=dot_fp32,
    )
    return y
