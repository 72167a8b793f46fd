"""``y = x @ W.T + bias`` by a quantized weight (``qweight.QuantWeight``) on the CPU, from
its packed layout (``csrc/quant_linear.cpp``), and the dispatcher the layers call.

    supports(qw) -> bool          the compiled kernel takes it (CPU tensors, group 16k or k)
    pack(qw, weight_only=False)   the kernel's layout (QuantPacked), made once at load
    integer_zeros(qw)             int8 zero points z where every offset is -z * scale, or None
    linear(x [..., k], packed, bias [n] | None) -> [..., n] in x's dtype (f32 or bf16)
    matmul(x, qw, packed, bias)   CUDA: quant_linear_triton; CPU packed: linear; else torch
    reference(x, qw, bias)        float64 (qweight.reference_linear)

A decode step reads every weight once, so its time is the bytes read. The packing keeps
the codes (w4: half a byte, w8 and fp8: one) in panels of 16 output rows, one scale per
block of 32 columns (16 for groups of 16) in fp16 relative to the row's largest (so fp16
keeps 11 bits of each whatever the scales' range; the row's float32 factor is applied to
y), and offsets the same way: Q4_K-like w4 g32 with offsets reads 0.625 bytes a weight,
Q8_0-like w8 g32 1.0625 (bf16: 2). A w8 weight whose codes all fit six bits (-32..31:
GGUF Q6_K's and Q5_K's) packs as w6, w4's nibbles plus two bits a code: w6 g16 reads 0.875
bytes a weight (w8 g16 1.125). Where a row's scales (and offsets) are small integers times
one factor per 256 columns (GGUF's k-quants: Q4_K's 6-bit sc times d, Q6_K's int8 sc), they
pack as int8 codes and one fp16 factor per 256 columns (``QuantPacked.factors``; found
exactly at pack time, else the fp16 layout stays): Q4_K-like w4 g32 then reads 0.578 bytes
a weight, Q6_K-like w6 g16 0.82. Where every offset of a w4 / w8 weight is an integer
zero point, ``mins == -z * scales`` exactly in float32 with z in the codes' range (GGUF
Q4_0's ``-8 d``, AWQ / GPTQ), z is kept instead as one int8 a block and subtracted from the
codes in the integer sums, ``s d (sum(q xq) - z sum(xq))``: fp16's rounding of an offset
that cancels most of the scaled sum is then not magnified (w4 g32 with zero points: 0.59
bytes a weight).

w4 / w6 / w8 quantize x per 32 columns to int8 (d = max|x| / 127, as llama.cpp's Q8_0
activations; with coded scales on AVX512-VNNI per 256 columns, as its Q8_K for k-quants, so
a super-block's blocks add up as integers times their scale codes: ``x_block``) and multiply
in integers (AVX512-VNNI ``vpdpbusd``; AVX2 ``maddubs``); fp8
widens its codes to bf16 exactly and multiplies x rounded to bf16 (``vdpbf16ps``, with
AVX512-BF16 and VBMI), or widens them to float32 through fp16 (F16C) for FMAs with float32
x (AVX2); a CPU without AVX2 runs a plain C++ loop. ``pack(qw, weight_only=True)`` of a w8
per-channel weight with codes in -127..127 (``int8_linear``'s, ``--torchao-config int8wo``)
gives kind ``w8wo``: x is not quantized; the codes are widened exactly to bf16 for
``vdpbf16ps`` with x rounded to bf16 (fp8's kernel with other tables; on AVX2 to float32
for FMAs), the row's scale applied to y. The error this adds to ``y[j]``: at
most ``sum_c |q s|[j, c] * d_b(c) / 2`` (int8 x), or ``2^-8 sum_c |q s x|`` (bf16 x),
beside fp16's ``2^-11`` relative on scales.

Past ``dequant_rows(kind)`` rows (fp8 prefill, and every product on a build whose kernel
is the plain C++ loop) the weight is dequantized ``TILE`` rows at a time
to x's dtype and multiplied by torch's matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from radixlm.kernels import cpu_paged
from radixlm.kernels.qweight import QuantWeight, reference_linear

PANEL = 16  # output rows per panel (one 512-bit register of int32 / float32 lanes)
X_BLOCK = 32  # columns of x per int8 scale; K is padded to it
KIND_CODE = {"w4": 0, "w8": 1, "fp8": 2, "w8wo": 3, "w6": 4}
W6_RANGE = (-32, 31)  # w8 codes that fit six bits: packed as w6 (GGUF Q6_K, Q5_K)
BF16_KINDS = ("fp8", "w8wo")  # x rounded to bf16 (AVX-512) for codes widened to bf16
ZERO_RANGE = {"w4": (0, 15), "w8": (-128, 127)}  # integer zero points in the codes' range
X_DTYPES = (torch.float32, torch.bfloat16)  # what the packed kernel multiplies
# Most rows of x the packed kernel takes, by build; more go tile by tile through torch's
# matmul (one thread, a [4096, 2048] weight, bf16 x on AVX-512, float32 x on the AVX2
# build run on the same Zen 4): VNNI's int8 products keep up with oneDNN's bf16 at 512
# rows (37.6 ms against 38.9; the tiles 48.8) and AVX2's beat the tiles 2x at 128; fp8's
# vdpbf16ps falls behind the tiles between 128 and 512 rows (13.2 / 18.2 ms at 128, 62.3 /
# 51.5 at 512), its AVX2 FMAs between 16 and 32 (4.4 / 8.8 at 8, 15.9 / 13.2 at 32); the
# plain C++ loop (a CPU without AVX2) always does.
KERNEL_MAX_ROWS = {2: 1 << 62, 1: 1 << 62}  # by isa(): w4, w8
FP8_KERNEL_MAX_ROWS = {2: 128, 1: 16}  # by fp8_isa()
TILE = 256  # weight rows dequantized at once (bf16 2048 columns: 1 MiB, in L2)
SUPER = 256  # columns per factor of coded scales (GGUF's super-block)
__all__ = ["QuantPacked", "supports", "pack", "linear", "matmul", "reference"]


@dataclass
class QuantPacked:
    """The kernel's layout of one ``QuantWeight`` (see ``csrc/quant_linear.cpp``)."""

    kind: str  # w4, w6, w8, fp8 or w8wo (w8 weight-only: x in bf16, not int8)
    n: int
    k: int
    block: int  # columns per scale: 32, or 16 for groups of 16
    data: torch.Tensor  # uint8 [panels, blocks, chunks, 64]
    scales: torch.Tensor  # fp16 [panels, blocks, 16], relative to rowf (int8 codes: factors)
    mins: torch.Tensor | None  # fp16 [panels, blocks, 16], relative to rowf (or int8 codes)
    rowf: torch.Tensor  # float32 [panels * 16]
    perm: torch.Tensor | None  # int64 [k]: stored column j multiplies input feature perm[j]
    zeros: torch.Tensor | None = None  # int8 [panels, blocks, 16] (then mins is None)
    # coded scales: scales / mins hold int8 codes, times these fp16 factors (relative to
    # rowf) per 256 columns, [panels, super-blocks, 2 (scale's, offset's), 16]
    factors: torch.Tensor | None = None

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.data, self.scales, self.mins, self.zeros, self.rowf,
                                      self.perm, self.factors) if t is not None)


@cache
def _ready() -> bool:
    return cpu_paged.available() and hasattr(torch.ops.radixlm_cpu, "quant_linear")


def isa() -> int:
    """2: AVX512-VNNI, 1: AVX2, 0: plain C++ (or -1: no library)."""
    return int(torch.ops.radixlm_cpu.quant_linear_isa()) if _ready() else -1


def fp8_isa() -> int:
    """fp8's and w8wo's kernel: 2: vdpbf16ps (x rounded to bf16), 1: FMAs, 0: plain C++
    (-1: none)."""
    return int(torch.ops.radixlm_cpu.quant_linear_fp8_isa()) if _ready() else -1


def x_block(packed: QuantPacked) -> int:
    """Columns of x per int8 scale on the packed kernel of an integer kind: a super-block
    (256) for coded scales on AVX512-VNNI, else 32."""
    return SUPER if packed.factors is not None and isa() == 2 else 32


def block_of(qw: QuantWeight) -> int | None:
    """Columns per packed scale: 32 where a group covers whole blocks of 32 (or the row),
    16 for groups that are multiples of 16 only, None otherwise (then the torch path)."""
    if qw.group >= qw.k or qw.group % 32 == 0:
        return 32
    return 16 if qw.group % 16 == 0 else None


def supports(qw: QuantWeight) -> bool:
    """Whether ``pack``/``linear`` take ``qw``: CPU tensors, a group of 16 * j (or the whole
    row), and the library built."""
    return qw.data.device.type == "cpu" and block_of(qw) is not None and _ready()


def integer_zeros(qw: QuantWeight) -> torch.Tensor | None:
    """int8 z [n, groups] when every offset of a w4 / w8 weight is ``-z * scale`` exactly
    in float32 with z an integer in the codes' range, else None (float offsets kept)."""
    if qw.mins is None or qw.kind not in ZERO_RANGE:
        return None
    lo, hi = ZERO_RANGE[qw.kind]
    z = torch.where(qw.scales != 0, -qw.mins / qw.scales, torch.zeros_like(qw.mins))
    z = z.round().clamp_(lo, hi)  # the candidate, then the exact check
    if not torch.equal(-z * qw.scales, qw.mins):
        return None
    return z.to(torch.int8)


def _codes(qw: QuantWeight, npad: int, kpad: int, kind: str) -> torch.Tensor:
    """The stored codes as bytes [npad, kpad] (w8: q + 128, w8wo: sign and magnitude),
    padding meaning zero."""
    if kind == "w4":
        codes = torch.stack((qw.data & 0x0F, qw.data >> 4), dim=-1).reshape(qw.n, -1)
        codes, fill = codes[:, : qw.k], 0
    elif kind in ("w8", "w6"):
        fill = 128 if kind == "w8" else 32
        codes = (qw.data.to(torch.int16) + fill).to(torch.uint8)
    elif kind == "w8wo":
        q = qw.data.to(torch.int16)
        codes, fill = (q.abs() | torch.where(q < 0, 0x80, 0)).to(torch.uint8), 0
    else:
        codes, fill = qw.data.view(torch.uint8), 0
    out = torch.full((npad, kpad), fill, dtype=torch.uint8)
    out[: qw.n, : qw.k] = codes
    return out


def _fp8_positions() -> torch.Tensor:
    """Where (row r, column c) of a 16 x 4 chunk lands so that unpacklo/hi_epi8 of the
    decoded bytes leave each row's bf16 pairs in its own 32-bit lane."""
    r, c = torch.arange(PANEL).repeat_interleave(4), torch.arange(4).repeat(PANEL)
    return 16 * (r // 4) + (c >= 2) * 8 + (r % 4) * 2 + c % 2


def _panels(codes: torch.Tensor, kind: str, block: int) -> torch.Tensor:
    """[npad, kpad] bytes -> [panels, blocks, chunks, 64] (chunk = 4 columns x 16 rows)."""
    npad, kpad = codes.shape
    p, nb = npad // PANEL, kpad // block
    if kind in ("w4", "w6"):  # a block's first half in the low nibbles, its second the high
        v = codes.view(p, PANEL, nb, 2, block // 8, 4).permute(0, 2, 4, 1, 5, 3)
        low = ((v[..., 0] & 15) | ((v[..., 1] & 15) << 4)).reshape(p, nb, block // 8, 64)
        if kind == "w4":
            return low.contiguous()
        # w6: bits 4-5 of each code in a region after the nibbles, four codes a byte: byte
        # (row, column of 4) of chunk u holds low-nibble chunks 2u and 2u + 1, each its
        # block's first half then its second, two bits each
        high = (v >> 4).view(p, nb, block // 16, 2, PANEL, 4, 2)  # [.., u, j % 2, r, t, half]
        slots = high[..., 0, :, :, 0] | (high[..., 0, :, :, 1] << 2) \
            | (high[..., 1, :, :, 0] << 4) | (high[..., 1, :, :, 1] << 6)
        return torch.cat((low, slots.reshape(p, nb, block // 16, 64)), dim=2).contiguous()
    v = codes.view(p, PANEL, nb, block // 4, 4).permute(0, 2, 3, 1, 4).reshape(
        p, nb, block // 4, 64)
    if kind == "w8":
        return v.contiguous()
    out = torch.empty_like(v)  # fp8, w8wo
    out[..., _fp8_positions()] = v
    return out


def packed_kind(qw: QuantWeight, weight_only: bool = False) -> str:
    """The packing's kind: ``qw.kind``; w6 for a w8 weight whose codes all fit six bits
    (-32..31: GGUF Q6_K's, Q5_K's), 0.75 bytes a code instead of 1; w8wo for a
    weight-only w8 (asserted to be one: codes in -127..127, no offsets)."""
    if not weight_only:
        lo, hi = W6_RANGE
        if qw.kind == "w8" and bool(((qw.data >= lo) & (qw.data <= hi)).all()):
            return "w6"
        return qw.kind
    assert qw.kind == "w8" and qw.mins is None and bool((qw.data != -128).all()), \
        "weight-only packing takes w8 codes in -127..127 without offsets"
    return "w8wo"


def pack(qw: QuantWeight, weight_only: bool = False) -> QuantPacked:
    """``qw`` in the kernel's layout (see the module docstring), in one C++ pass
    (``_pack_torch`` is its torch twin, ~10x slower). ``weight_only``: a w8 weight whose x
    stays in bf16 (kind w8wo)."""
    block = block_of(qw)
    assert block is not None, f"group {qw.group} of k {qw.k}: not a multiple of 16"
    kind = packed_kind(qw, weight_only)
    data = qw.data.view(torch.uint8) if qw.kind == "fp8" else qw.data
    zeros = integer_zeros(qw)
    mins = None if zeros is not None else qw.mins
    packed, scales, mins16, zeros8, rowf, factors = torch.ops.radixlm_cpu.quant_pack(
        data, qw.scales, mins, zeros, KIND_CODE[kind], qw.n, qw.k, qw.group, block)
    return QuantPacked(kind, qw.n, qw.k, block, packed, scales,
                       None if mins is None else mins16, rowf, qw.perm,
                       None if zeros is None else zeros8,
                       factors if factors.numel() else None)


def _pack_torch(qw: QuantWeight, weight_only: bool = False) -> QuantPacked:
    """``pack`` in torch ops (the tests compare the two)."""
    block = block_of(qw)
    assert block is not None, f"group {qw.group} of k {qw.k}: not a multiple of 16"
    kind = packed_kind(qw, weight_only)
    npad, kpad = -(-qw.n // PANEL) * PANEL, -(-qw.k // X_BLOCK) * X_BLOCK
    nb, p = kpad // block, npad // PANEL
    group_of = (torch.arange(nb) * block // qw.group).clamp_(max=qw.groups - 1)
    s = qw.scales[:, group_of]  # [n, nb]
    zeros = integer_zeros(qw)
    m = None if qw.mins is None or zeros is not None else qw.mins[:, group_of]
    rowf = s.abs().amax(1) if m is None else torch.maximum(s.abs().amax(1), m.abs().amax(1))
    rowf = torch.where(rowf > 0, rowf, torch.ones_like(rowf))
    rowf_pad = torch.ones(npad, dtype=torch.float32)
    rowf_pad[: qw.n] = rowf

    def panels(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [n, nb] -> [p, nb, 16]
        out = torch.zeros(npad, nb, dtype=dtype)
        out[: qw.n] = t.to(dtype)
        return out.view(p, PANEL, nb).permute(0, 2, 1).contiguous()

    data = _panels(_codes(qw, npad, kpad, kind), kind, block)
    coded = None if kind in BF16_KINDS or zeros is not None else [
        _scale_codes(t, block) for t in ([s] if m is None else [s, m])]
    if coded is not None and all(c is not None for c in coded):
        fac = torch.zeros(npad, coded[0][1].shape[1], 2, dtype=torch.float16)
        for which, (_, f) in enumerate(coded):
            fac[: qw.n, :, which] = (f / rowf[:, None]).half()
        return QuantPacked(kind, qw.n, qw.k, block, data, panels(coded[0][0], torch.int8),
                           None if m is None else panels(coded[1][0], torch.int8), rowf_pad,
                           qw.perm, None,
                           fac.view(p, PANEL, -1, 2).permute(0, 2, 3, 1).contiguous())
    return QuantPacked(kind, qw.n, qw.k, block, data,
                       panels(s / rowf[:, None], torch.float16),
                       None if m is None else panels(m / rowf[:, None], torch.float16),
                       rowf_pad, qw.perm,
                       None if zeros is None else panels(zeros[:, group_of], torch.int8))


def _scale_codes(v: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Block scales v [n, nb] as int8 codes [n, nb] times a float32 factor [n, super-blocks]
    per SUPER columns, exactly (``quant_pack``'s search: the largest |v| of a super-block
    gets the first code +-1, +-2, ... -128 that works), or None where a super-block has
    none."""
    n, nb = v.shape
    per = SUPER // block
    nsb = -(-nb // per)
    vp = F.pad(v, (0, nsb * per - nb)).view(n, nsb, per)
    amax = vp.abs().amax(-1)
    found = amax == 0
    fac = torch.zeros(n, nsb)
    codes = torch.zeros(n, nsb, per, dtype=torch.int8)
    for top in range(2, 258):  # +f, -f per code; llama.cpp's Q6_K gives its largest -128
        cand = (amax.double() / (top // 2)).float() * (-1 if top % 2 else 1)
        q = torch.round(vp.double() / cand.double()[..., None])
        ok = ((q >= -128) & (q <= 127) & (q.float() * cand[..., None] == vp)).all(-1)
        ok &= (cand != 0) & ~found
        fac = torch.where(ok, cand, fac)
        codes = torch.where(ok[..., None], q.nan_to_num().clamp(-128, 127).to(torch.int8),
                            codes)
        found |= ok
    if not bool(found.all()):
        return None
    return codes.view(n, nsb * per)[:, :nb], fac


@cache
def dequant_rows(kind: str) -> int:
    """Most rows of x the packed kernel takes; more go tile by tile through torch's matmul."""
    if kind in BF16_KINDS:
        return FP8_KERNEL_MAX_ROWS.get(fp8_isa(), 0)
    return KERNEL_MAX_ROWS.get(isa(), 0)


def _dequant(packed: QuantPacked, row0: int, row1: int,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows [row0, row1) of W as [rows, k] in dtype (float32 or bfloat16), stored column
    order."""
    return torch.ops.radixlm_cpu.quant_dequant(
        packed.data, packed.scales, packed.mins, packed.zeros, packed.factors, packed.rowf,
        KIND_CODE[packed.kind], packed.n, packed.k, packed.block, row0, row1, dtype)


def _kernel(x: torch.Tensor, packed: QuantPacked, bias: torch.Tensor | None,
            y: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] (stored column order) @ W.T + bias by the packed kernel, [m, n] in x's dtype
    (``y``: where to write it; the tests pass it NaN-filled)."""
    if y is None:
        y = torch.empty(x.shape[0], packed.n, dtype=x.dtype)
    torch.ops.radixlm_cpu.quant_linear(x, packed.data, packed.scales, packed.mins, packed.zeros,
                                       packed.factors, packed.rowf, KIND_CODE[packed.kind],
                                       packed.n, packed.block, bias, y)
    return y


def _tiled(x: torch.Tensor, packed: QuantPacked, bias: torch.Tensor | None,
           y: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ W.T + bias through torch's matmul, TILE weight rows dequantized to x's
    dtype at a time; [m, n] in x's dtype (``y``: where to write it)."""
    if y is None:
        y = torch.empty(x.shape[0], packed.n, dtype=x.dtype)
    for r0 in range(0, packed.n, TILE):
        r1 = min(r0 + TILE, packed.n)
        torch.matmul(x, _dequant(packed, r0, r1, x.dtype).T, out=y[:, r0:r1])
    return y if bias is None else y.add_(bias.to(x.dtype))


def linear(x: torch.Tensor, packed: QuantPacked,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., k] @ W.T + bias`` in x's dtype (float32 or bfloat16, CPU)."""
    assert x.shape[-1] == packed.k and x.dtype in X_DTYPES, \
        f"x {tuple(x.shape)} {x.dtype} against a [{packed.n}, {packed.k}] quantized weight"
    lead = x.shape[:-1]
    rows = x.reshape(-1, packed.k)
    if packed.perm is not None:  # act-order: stored column j meets input feature perm[j]
        rows = rows.index_select(1, packed.perm)
    if rows.shape[0] > dequant_rows(packed.kind):
        y = _tiled(rows.contiguous(), packed, bias)
    else:
        y = _kernel(rows, packed, bias)
    return y.reshape(*lead, packed.n)


def matmul(x: torch.Tensor, qw: QuantWeight, packed: QuantPacked | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """What a layer calls: the Triton kernel for CUDA tensors, the packed CPU kernel where
    there is a packing (and x is float32 or bfloat16), else ``qw`` dequantized to x's dtype
    for one ``F.linear``."""
    if x.is_cuda:
        from radixlm.kernels import quant_linear_triton  # imports triton: CUDA hosts only

        return quant_linear_triton.linear(x, qw, bias)
    if packed is not None and x.dtype in X_DTYPES:
        return linear(x, packed, bias)
    return F.linear(x, qw.dequantize(x.dtype), None if bias is None else bias.to(x.dtype))


def reference(x: torch.Tensor, qw: QuantWeight,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``x @ W.T + bias`` (the tests' oracle)."""
    return reference_linear(x, qw, bias)
