"""Weight-only int8 linear: ``y = x @ (q * scales[:, None]).T (+ bias)``.

    quantize_per_channel(w [N, K] float) -> (q [N, K] int8, scales [N] in w's dtype)
    pack(q, scales) -> QuantPacked | None     the weight-only kernel's layout (bf16, CPU)
    int8_linear(x [M, K], q, scales, bias [N] | None, packed | None) -> y [M, N] in x's dtype
    int8_linear_reference(...)  the same in float64 (the tests' oracle)

Symmetric, one scale per output row (torchao's ``int8_weight_only``, which SGLang's
``--torchao-config int8wo`` applies): ``scale = max|w_row| / 127``, ``q = round(w / scale)``
in [-127, 127]. A tensor-parallel shard of rows quantizes on its own; a shard of columns
needs the whole rows' maxima (``row_max``, one all-reduce), so every rank holds exactly
its slice of the single-rank int8 weights.

A bfloat16 weight on a CPU with AVX512-BF16 is packed at quantize time for
``quant_linear``'s weight-only w8 kernel (kind ``w8wo``): the codes widened exactly to bf16
in registers and ``vdpbf16ps`` with x in bf16 (x is not rounded to int8: weight-only, as
torchao's), the row's scale applied to y, 1.06 bytes a weight read. Then the row-major int8
weight is not kept (the layer holds a ``meta`` placeholder and the packing), and every
product takes ``quant_linear.linear`` (its kernel up to 128 rows, bf16 tiles of the
weight for torch's matmul beyond). Measured on one Zen 4 thread (a busy host), CPU time, the
small preset's four projections of one layer (``benchmarks/quant_linear.py --threads 1
--cpu-time``), w8wo kernel / torch's int8 kernel / oneDNN-prepacked bf16: 1 row 0.42 / 0.99
/ 1.05 ms; 8 rows 1.09 / 2.05 / 1.17; 16 rows 1.84 / 3.72 / 1.68; past 16 rows the kernel
falls behind bf16 (32: 3.0 against 2.6; 128: 10.9 against 8.3) but not as far as the
widened int8 weight did.

Otherwise, in bfloat16 and float16, up to ``PACKED_MAX_ROWS`` rows (decode steps) and for
in-features a multiple of 16, torch's packed
int8 CPU kernel (``aten._weight_int8pack_mm``: the int8 weight widened in registers, the
scales applied to the output, scales in x's dtype). It reads half of a bf16 weight's
bytes, which is what a step of a row or two is bound by, but has no blocking along the
rows: its cost grows with every row. Beyond ``PACKED_MAX_ROWS`` rows, in float32 (where
torch 2.13's kernel has no vector path and is slower than widening) and off the CPU, the
weight is widened to x's dtype for that one call and multiplied densely; the widened copy
is freed after it. Measured on the small preset's four projections of one layer, one
thread, CPU time (bf16): 1 row 0.47 ms packed int8 / 0.76 ms oneDNN-prepacked bf16 / 1.16 ms dense
bf16; 16 rows 2.6 / 0.81 / 1.25; 32 rows 5.2 (widening: 3.4) / 1.17 / 1.73.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.kernels import quant_linear
from radixlm.kernels.qweight import QuantWeight

# most rows for the packed kernel: the widened dense matmul overtakes it between 16 and 32
# (small preset's shapes, bf16; docs/benchmarks.md "Weight-only int8")
PACKED_MAX_ROWS = 16
PACKED_DTYPES = (torch.bfloat16, torch.float16)
# its vector loop steps 16 columns at a time with no tail: other widths read past the rows
# (garbage or a segfault in torch 2.13, measured), so they take the widened path
PACKED_K_MULTIPLE = 16
QMAX = 127


def quantize_per_channel(w: torch.Tensor,
                         row_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] -> (int8 [N, K], scales [N] in ``w``'s dtype). ``row_max`` [N]: the
    rows' largest magnitudes when ``w`` holds only some of each row's columns (a
    tensor-parallel shard; default: ``w``'s own). The int8 values are rounded against the
    stored (dtype-rounded) scales, so ``q * scales`` is the weight the kernel multiplies
    by; an all-zero row (or one whose scale underflows the dtype) gets scale 1 and zeros."""
    assert w.dim() == 2 and w.is_floating_point(), f"need a 2-D float weight, got {w.shape} " \
        f"{w.dtype}"
    amax = w.detach().abs().amax(dim=1).float() if row_max is None else row_max.float()
    scales = (amax / QMAX).to(w.dtype)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # zero (or underflowed)
    q = torch.round(w.detach().float() / scales.float()[:, None]).clamp_(-QMAX, QMAX)
    return q.to(torch.int8).contiguous(), scales.contiguous()


def pack(q: torch.Tensor, scales: torch.Tensor) -> quant_linear.QuantPacked | None:
    """``q * scales`` in the weight-only kernel's layout (kind w8wo), for a bfloat16 weight
    on a CPU whose kernel multiplies it by ``vdpbf16ps``; None elsewhere (float32 keeps the
    widened path, which transformers' float32 matches token for token)."""
    if not (q.device.type == "cpu" and scales.dtype == torch.bfloat16
            and quant_linear.fp8_isa() == 2):
        return None
    qw = QuantWeight("w8", q.shape[0], q.shape[1], q.shape[1], q, scales.float()[:, None])
    return quant_linear.pack(qw, weight_only=True) if quant_linear.supports(qw) else None


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None,
                packed: quant_linear.QuantPacked | None = None) -> torch.Tensor:
    """``x [..., K] @ (q * scales).T + bias`` in ``x``'s dtype (see the module docstring
    for which path runs); ``packed``: ``pack(q, scales)``, after which ``q`` may be a
    ``meta`` placeholder."""
    assert q.dtype == torch.int8 and q.dim() == 2 and x.shape[-1] == q.shape[1], \
        f"x {tuple(x.shape)} against int8 weight {tuple(q.shape)} {q.dtype}"
    if packed is not None:
        assert x.dtype in quant_linear.X_DTYPES, f"a packed int8 weight multiplies {x.dtype}"
        return quant_linear.linear(x, packed, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, q.shape[1])
    s = scales if scales.dtype == x.dtype else scales.to(x.dtype)
    if (x2.device.type == "cpu" and x.dtype in PACKED_DTYPES
            and x2.shape[0] <= PACKED_MAX_ROWS and q.shape[1] % PACKED_K_MULTIPLE == 0):
        y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), q, s)
    else:
        y = F.linear(x2, q.to(x.dtype)) * s
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, q.shape[0])


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``x @ (q * scales).T + bias``."""
    w = q.double() * scales.double()[:, None]
    return F.linear(x.double(), w, None if bias is None else bias.double())
