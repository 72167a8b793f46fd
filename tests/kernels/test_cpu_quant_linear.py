"""CPU products by quantized weights (``kernels/quant_linear.py``, ``csrc/quant_linear.cpp``)
against float64 oracles: every kind (w8wo: ``int8_linear``'s weight-only w8), with float
offsets, integer zero points (``mins = -z * scales``) and none, groups 16 / 32 / 64 / 128 / k,
odd n, a short last group, k not a multiple of 32, 1-200 rows, float32 and bfloat16 x,
bias and act-order permutation. The kernel writes into NaN-filled outputs, so a row or
panel it skips fails. fp8's decoding is checked code by code (zero, denormals, NaN).
Skipped where the library is not built.

Each product is checked twice (``W`` in stored column order, ``x`` permuted to it):
1. against float64 over x as the path rounds it (x quantized to int8 as the kernel does
   for w4 / w6 / w8, per 32 columns or per 256 with coded scales: ``x_block``; integer
   zero points' term included; x rounded to bf16 for fp8's and w8wo's ``vdpbf16ps``;
   float offsets times x's float sums), within the
   roundings left: scales and offsets in fp16 relative to the row's largest (``2^-11`` of
   each, ``2^-25`` of the row's factor below fp16's normal range), float32 sums
   (``k 2^-24``), a bf16 y (``2^-8``), one code of x one off at a float32 tie
   (``d |q s|`` of one column), W in bf16 on the tiled path with bf16 x (``2^-8``);
   tight enough that a block's scale 10% off fails;
2. that product against ``qweight.reference_linear`` (exact x) within what x's rounding
   can move it: ``sum_c |q s|[j, c] * d_b(c) / 2`` with ``d_b = max|x_b| / 127`` for int8,
   ``2^-8 sum_c |q s x|`` for bf16 (8 bits of significand: half an ulp is 2^-8 of x).
"""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels import cpu_paged, quant_linear
from radixlm.kernels.qweight import QuantWeight

pytestmark = pytest.mark.skipif(
    not quant_linear.supports(QuantWeight("w8", 16, 32, 32, torch.zeros(16, 32,
                                                                        dtype=torch.int8),
                                          torch.ones(16, 1))),
    reason="the CPU kernel library is not built here")

# (n, k, group, offsets, act-order); offsets "z": integer zero points (Q4_0, AWQ, GPTQ)
CASES = [(33, 96, 32, True, False),  # odd n, Q4_K-like
         (35, 96, 32, "z", False),  # Q4_0-like
         (21, 300, 64, "z", True),  # GPTQ-like, act-order, a last group of 44
         (20, 100, 16, False, False),  # groups of 16, a last group of 4, k % 32 = 4
         (17, 300, 64, True, False),  # a last group of 44, k % 32 = 12
         (40, 256, 128, False, True),  # FP8-block-like, act-order
         (9, 200, 200, True, False),  # per channel (group = k), k % 32 = 8
         (48, 64, 32, False, True),
         (5, 40, 16, True, True)]
ROWS = [1, 2, 3, 7, 16, 33, 200]
KINDS = ["w4", "w8", "w6", "fp8", "w8wo"]


def make_qweight(kind: str, n: int, k: int, group: int, offsets: bool | str, perm: bool,
                 seed: int = 0) -> QuantWeight:
    """A random weight of ``kind``; w8wo: a w8 one with codes in -127..127 and no offsets,
    w6: a w8 one with codes in -32..31 (pack either with ``packing``)."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    if kind == "w4":
        data = torch.randint(0, 256, (n, -(-k // 2)), dtype=torch.uint8, generator=g)
    elif kind in ("w8", "w8wo"):
        low = -127 if kind == "w8wo" else -128
        data = torch.randint(low, 128, (n, k), dtype=torch.int8, generator=g)
    elif kind == "w6":
        data = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
    else:  # zeros, denormals (|v| < 2^-6) and normals up to 448
        v = torch.randn(n, k, generator=g) * torch.tensor([0.004, 1.0, 60.0])[
            torch.randint(0, 3, (n, k), generator=g)]
        data = v.clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = (torch.rand(n, groups, generator=g) + 0.1) * 0.01
    scales = scales * torch.where(torch.rand(n, groups, generator=g) < 0.2, -1.0, 1.0)
    mins = torch.randn(n, groups, generator=g) * 0.05 if offsets else None
    if offsets == "z" and kind != "fp8":  # fp8 keeps them as float offsets
        lo, hi = quant_linear.ZERO_RANGE["w4" if kind == "w4" else "w8"]
        mins = -torch.randint(lo, hi + 1, (n, groups), generator=g).float() * scales
    if kind == "w8wo":
        mins = None
    order = torch.randperm(k, generator=g) if perm else None
    return QuantWeight("w8" if kind in ("w8wo", "w6") else kind, n, k, group, data, scales,
                       mins, order)


def packing(qw: QuantWeight, kind: str) -> quant_linear.QuantPacked:
    packed = quant_linear.pack(qw, weight_only=kind == "w8wo")
    assert packed.kind == kind, f"a {kind} weight packed as {packed.kind}"
    return packed


def int8_x(xs: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] (stored order) as the kernel quantizes it: d = max|x_b| / 127 per ``block``
    columns (``quant_linear.x_block``), round(x / d) in float32 (half to even, as
    nearbyint); (x_hat float64, d per column)."""
    m, k = xs.shape
    xb = torch.nn.functional.pad(xs.float(), (0, -k % block)).view(m, -1, block)
    amax = xb.abs().amax(2, keepdim=True)
    # a tensor's quotient (torch computes ``127 / amax`` as 127 * (1 / amax): an ulp off)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv).clamp(-127, 127)
    d = (amax / 127).double()
    return ((q.double() * d).view(m, -1)[:, :k],
            d.expand(-1, -1, block).reshape(m, -1)[:, :k])


def expected(x: torch.Tensor, qw: QuantWeight, packed: quant_linear.QuantPacked,
             bias: torch.Tensor | None, mode: str, bf16_y: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 y for x as the path rounds it, the module docstring's bound on |y - it|).
    mode: "int8" (x quantized per 32 columns), "bf16x" (x rounded to bf16), "bf16w" (W
    rounded to bf16) or "exact"; offsets multiply x as rounded on the int8 path (integer
    zero points, ``packed.zeros``, on every path), x's float sums elsewhere."""
    xs = x.double() if qw.perm is None else x.double()[:, qw.perm]  # stored column order
    cols = torch.arange(qw.k) // qw.group
    qs = qw.codes().double() * qw.scales.double()[:, cols]
    mins = torch.zeros_like(qs) if qw.mins is None else qw.mins.double()[:, cols]
    absdot = xs.abs() @ (qs.abs() + mins.abs()).T
    slack = torch.zeros_like(absdot)
    x_hat = xs
    if mode == "int8":  # one code of x one off (a float32 tie): d * |q s| of one column
        x_hat, d = int8_x(xs, quant_linear.x_block(packed))
        slack = (d[:, None, :] * qs.abs()[None]).amax(2)
    elif mode == "bf16x":
        x_hat = xs.bfloat16().double()
    elif mode == "bf16w":
        slack = absdot * 2.0**-8
    x_mins = x_hat if packed.zeros is not None or mode == "int8" else xs
    y = x_hat @ qs.T + x_mins @ mins.T + (0 if bias is None else bias.double())
    rowf = packed.rowf[: qw.n].double()
    out = (absdot * (2.0**-11 + qw.k * 2.0**-24) + slack
           + xs.abs().sum(1, keepdim=True) * rowf * 2.0**-24)
    if bf16_y:
        out += y.abs() * 2.0**-8
    return y, out * 1.01 + 1e-12


def mode_of(kind: str, tiled: bool, dtype: torch.dtype) -> str:
    """How the path taken rounds x or W (see ``expected``)."""
    if tiled:
        return "bf16w" if dtype == torch.bfloat16 else "exact"
    if kind in quant_linear.BF16_KINDS:
        return "bf16x" if quant_linear.fp8_isa() == 2 else "exact"
    return "int8" if quant_linear.isa() > 0 else "exact"


def check(y: torch.Tensor, x: torch.Tensor, qw: QuantWeight,
          packed: quant_linear.QuantPacked, bias: torch.Tensor | None, mode: str) -> None:
    want, bound = expected(x, qw, packed, bias, mode, y.dtype == torch.bfloat16)
    err = (y.double() - want).abs()
    assert (err <= bound).all(), \
        f"{mode}: max error {err.max():.3g}, error / bound {(err / bound).max():.3g}"
    # and that product against the oracle, within what x's rounding can move it
    xs = x.double() if qw.perm is None else x.double()[:, qw.perm]
    cols = torch.arange(qw.k) // qw.group
    qs = qw.codes().double() * qw.scales.double()[:, cols]
    if qw.mins is not None and (packed.zeros is not None or mode == "int8"):
        qs = qs + qw.mins.double()[:, cols]  # q s + min: what x's rounding multiplies
    qs = qs.abs()
    moved = {"int8": (int8_x(xs, quant_linear.x_block(packed))[1] / 2) @ qs.T,
             "bf16x": xs.abs() @ qs.T * 2.0**-8}
    oracle = quant_linear.reference(x, qw, bias)  # W rounded to float32 there: 2^-23
    w32 = xs.abs() @ (qw.dequantize().double().abs() if qw.perm is None else
                      qw.dequantize().double().abs()[:, qw.perm]).T * 2.0**-22
    assert ((want - oracle).abs() <= moved.get(mode, 0) * 1.001 + w32 + 1e-12).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(kind, case, rows, dtype):
    n, k, group, offsets, perm = case
    qw = make_qweight(kind, n, k, group, offsets, perm, seed=rows)
    packed = packing(qw, kind)
    assert (packed.zeros is not None) == (offsets == "z" and kind in ("w4", "w8", "w6"))
    g = torch.Generator().manual_seed(100 + rows)
    x = (torch.randn(rows, k, generator=g) * torch.rand(1, k, generator=g) * 3).to(dtype)
    bias = torch.randn(n, generator=g) if rows % 2 else None
    y = quant_linear.linear(x, packed, bias)
    assert y.dtype == dtype and y.shape == (rows, n)
    check(y, x, qw, packed, bias, mode_of(kind, rows > quant_linear.dequant_rows(kind), dtype))


def test_integer_zero_points_are_exact_in_the_sums():
    """Q4_0's ``-8 d`` cancels most of a block's scaled sum: kept as integers, the zero
    points leave y within fp16's 2^-11 of each ``|(q - z) s x|`` (float offsets would add
    fp16's rounding of ``8 d`` times x's whole block sums)."""
    n, k = 64, 512
    g = torch.Generator().manual_seed(3)
    scales = torch.rand(n, k // 32, generator=g) * 0.01 + 0.005
    data = torch.full((n, k // 2), 0x88, dtype=torch.uint8)  # q = 8 = z: W is zero...
    data[:, :4] = torch.randint(0, 256, (n, 4), dtype=torch.uint8, generator=g)  # ...mostly
    qw = QuantWeight("w4", n, k, 32, data, scales, -8 * scales)
    assert torch.equal(quant_linear.integer_zeros(qw),
                       torch.full((n, k // 32), 8, dtype=torch.int8))
    x = torch.randn(1, k, generator=g) + 3  # large block sums of x
    packed = quant_linear.pack(qw)
    mode = mode_of("w4", False, x.dtype)
    want, _ = expected(x, qw, packed, None, mode, False)
    xs, cols = x.double(), torch.arange(k) // 32
    w_abs = ((qw.codes().double() - 8) * scales.double()[:, cols]).abs()
    x_abs = (int8_x(xs)[0] if mode == "int8" else xs).abs()
    bound = (x_abs @ w_abs.T) * (2.0**-11 + k * 2.0**-24)
    if mode == "int8":  # one code of x one off at a float32 tie
        bound += (int8_x(xs)[1][:, None, :] * w_abs[None]).amax(2)
    err = (quant_linear.linear(x, packed).double() - want).abs()
    assert (err <= bound * 1.01 + 1e-12).all(), f"error / bound {(err / bound).max():.3g}"


@pytest.mark.parametrize("rows", [1, 5, 8, 9, 33, 200])
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_fills_nan_poisoned_rows(kind, rows):
    """The packed kernel at every row count (blocks of 8 / 4 and their tails) and the tiled
    path write every element of y; 3-D x keeps its leading shape."""
    n, k, group, perm = 37, 160, 32, False
    offsets = {"w4": True, "w8": "z", "w6": True}.get(kind, False)
    qw = make_qweight(kind, n, k, group, offsets, perm, seed=rows)
    packed = packing(qw, kind)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n)
    y = torch.full((rows, n), float("nan"))
    quant_linear._kernel(x, packed, bias, y)
    check(y, x, qw, packed, bias, mode_of(kind, False, x.dtype))
    y = torch.full((rows, n), float("nan"))
    quant_linear._tiled(x, packed, bias, y)
    check(y, x, qw, packed, bias, "exact")
    y3 = quant_linear.linear(x.view(1, rows, k), packed, bias)
    assert y3.shape == (1, rows, n)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_pack_matches_torch_twin(kind, case):
    """The C++ packing is ``_pack_torch``'s: the same bytes, factors, zero points and fp16
    scales (a division by the row's factor may round to a neighbouring fp16 under the
    library's -freciprocal-math: one fp16 ulp, 2^-10 relative)."""
    qw = make_qweight(kind, *case)
    wo = kind == "w8wo"
    a, b = packing(qw, kind), quant_linear._pack_torch(qw, weight_only=wo)
    assert a.kind == b.kind == kind
    assert (a.block, a.n, a.k) == (b.block, b.n, b.k) and torch.equal(a.data, b.data)
    assert torch.equal(a.rowf, b.rowf) and (a.mins is None) == (b.mins is None)
    assert (a.zeros is None and b.zeros is None) or torch.equal(a.zeros, b.zeros)
    assert (a.factors is None) == (b.factors is None)
    for x, y in ((a.scales, b.scales), (a.mins, b.mins), (a.factors, b.factors)):
        if x is not None:
            assert x.shape == y.shape
            assert ((x.float() - y.float()).abs() <= y.float().abs() * 2.0**-10 + 2.0**-24).all()


def coded_qweight(kind: str, n: int, k: int, group: int, offsets: bool,
                  seed: int = 0) -> QuantWeight:
    """A weight whose scales (and offsets) are small integers times one float per 256
    columns of a row, as GGUF's k-quants store them (Q4_K: 6-bit sc and m times d and dmin,
    Q6_K: int8 sc times d)."""
    qw = make_qweight(kind, n, k, group, False, False, seed)
    g = torch.Generator().manual_seed(seed + 1)
    supers = torch.arange(qw.groups) * group // 256
    d = (torch.rand(n, int(supers[-1]) + 1, generator=g) * 0.01).half().float()  # fp16: exact
    codes = torch.randint(-63 if kind != "w4" else 0, 64, (n, qw.groups), generator=g)
    if kind == "w6":  # llama.cpp's Q6_K: the largest scale of a super-block is -128 d
        codes[:, 0] = -128
        d[: n // 2] *= -1  # and d takes either sign
    qw.scales = d[:, supers] * codes
    if offsets:
        dmin = (torch.rand(n, int(supers[-1]) + 1, generator=g) * 0.01).half().float()
        qw.mins = -dmin[:, supers] * torch.randint(0, 64, (n, qw.groups), generator=g)
    return qw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 9, 33])
@pytest.mark.parametrize("case", [(33, 600, 32, True), (20, 300, 16, False),
                                  (17, 520, 16, True), (40, 256, 64, True)])
@pytest.mark.parametrize("kind", ["w4", "w6", "w8"])
def test_coded_scales(kind, case, rows, dtype):
    """Scales that are small integers times a factor per 256 columns pack as int8 codes and
    fp16 factors (``packed.factors``; a last super-block cut short, groups of 16, 32, 64)
    and multiply as the fp16 layout does; the torch twin packs the same."""
    n, k, group, offsets = case
    qw = coded_qweight(kind, n, k, group, offsets, seed=rows)
    packed = packing(qw, kind)
    assert packed.factors is not None and packed.scales.dtype == torch.int8
    assert (packed.mins is not None) == offsets and packed.zeros is None
    plain = quant_linear.pack(make_qweight(kind, n, k, group, offsets, False, seed=rows))
    assert plain.factors is None and packed.nbytes() < plain.nbytes()
    twin = quant_linear._pack_torch(qw)
    assert torch.equal(twin.scales, packed.scales) and torch.equal(twin.data, packed.data)
    assert ((twin.factors.float() - packed.factors.float()).abs()
            <= packed.factors.float().abs() * 2.0**-10).all()
    g = torch.Generator().manual_seed(100 + rows)
    x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
    bias = torch.randn(n, generator=g) if rows % 2 else None
    y = torch.full((rows, n), float("nan"), dtype=dtype)
    quant_linear._kernel(x, packed, bias, y)
    check(y, x, qw, packed, bias, mode_of(kind, False, dtype))
    check(quant_linear._tiled(x.float(), packed, bias), x.float(), qw, packed, bias, "exact")


def test_w8wo_every_code():
    """Each weight-only code -127..127 is multiplied exactly (one-hot x, scale 1), and a
    -128 code or offsets are refused by the weight-only packing."""
    codes = torch.arange(-127, 128, dtype=torch.int8).view(1, 255).repeat(3, 1)
    qw = QuantWeight("w8", 3, 255, 255, codes, torch.ones(3, 1))
    y = torch.full((255, 3), float("nan"))
    quant_linear._kernel(torch.eye(255), quant_linear.pack(qw, weight_only=True), None, y)
    assert torch.equal(y, qw.dequantize().T)
    with pytest.raises(AssertionError, match="-127..127"):
        quant_linear.pack(QuantWeight("w8", 1, 32, 32, torch.full((1, 32), -128,
                                                                  dtype=torch.int8),
                                      torch.ones(1, 1)), weight_only=True)


def test_w6_every_code():
    """A w8 weight whose codes all fit six bits packs as w6 (0.75 bytes a code) and each
    code -32..31 is multiplied exactly, in every slot of the high-bits region (columns
    of both halves of a block, both nibble chunks sharing a high-bits byte, groups of 16
    and 32); one code outside -32..31 keeps a weight w8."""
    for group in (16, 32):
        codes = torch.arange(-32, 32, dtype=torch.int8).repeat(2 * 16, 2)  # [32, 128]
        codes = codes[:, torch.randperm(128, generator=torch.Generator().manual_seed(group))]
        qw = QuantWeight("w8", 32, 128, group, codes.contiguous(), torch.ones(32, 128 // group))
        packed = quant_linear.pack(qw)
        assert packed.kind == "w6" and packed.data.numel() == 32 * 128 * 3 // 4
        x = torch.eye(128) * 127  # int8 x: d = 1 exactly
        for path in (quant_linear._kernel, quant_linear._tiled):
            y = torch.full((128, 32), float("nan"))
            path(x, packed, None, y)
            assert torch.equal(y, 127 * qw.dequantize().T)
        assert torch.equal(quant_linear._pack_torch(qw).data, packed.data)
    codes = codes.clone()
    codes[5, 7] = 32
    assert quant_linear.pack(QuantWeight("w8", 32, 128, 32, codes, torch.ones(32, 4))).kind == "w8"


def test_fp8_every_code():
    """Each of the 254 finite e4m3fn codes (zeros, denormals, normals, both signs) decodes to
    its value exactly: one-hot x picks a weight column, scale 1 keeps it."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(2, 127)  # the NaN codes apart
    n, k = 2, 127
    qw = QuantWeight("fp8", n, k, k, codes.view(torch.float8_e4m3fn), torch.ones(n, 1))
    x = torch.eye(k)
    y = torch.full((k, n), float("nan"))
    quant_linear._kernel(x, quant_linear.pack(qw), None, y)
    assert torch.equal(y, qw.dequantize().T)


def test_fp8_nan_code():
    """A NaN code gives NaN in its row's outputs only."""
    data = torch.ones(20, 64).to(torch.float8_e4m3fn)
    data.view(torch.uint8)[3, 10] = 0xFF
    qw = QuantWeight("fp8", 20, 64, 64, data, torch.ones(20, 1))
    y = quant_linear.linear(torch.randn(2, 64), quant_linear.pack(qw))
    assert y[:, 3].isnan().all() and not y[:, [0, 1, 2, 4, 19]].isnan().any()


@pytest.mark.parametrize("offsets", [True, "z"])
@pytest.mark.parametrize("kind", KINDS)
def test_dequant_matches(kind, offsets):
    """The tiles the prefill path multiplies are W (fp16-rounded relative scales aside;
    with integer zero points, of ``(q - z) s``)."""
    qw = make_qweight(kind, 21, 100, 16, offsets, False)
    packed = packing(qw, kind)
    w = qw.dequantize().double()
    rows = quant_linear._dequant(packed, 3, 21).double()
    cols = torch.arange(qw.k) // qw.group
    qs = qw.codes().double() * qw.scales.double()[:, cols]
    mins = torch.zeros_like(qs) if qw.mins is None else qw.mins.double()[:, cols]
    exact = packed.zeros is not None or qw.mins is None
    tol = ((qs + mins).abs() if exact else qs.abs() + mins.abs()) * 2.0**-11 + 1e-9
    assert ((rows - w[3:]).abs() <= tol[3:]).all()


def test_matmul_dispatch_and_unsupported_group():
    """A group of 24 is not packed: ``matmul`` without a packing dequantizes (perm too)."""
    qw = make_qweight("w4", 10, 72, 24, True, True)
    assert not quant_linear.supports(qw) and quant_linear.block_of(qw) is None
    x = torch.randn(3, 72)
    ref = quant_linear.reference(x, qw)
    y = quant_linear.matmul(x, qw, None)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
    qw = make_qweight("w8", 10, 64, 32, False, True)
    y = quant_linear.matmul(x[:, :64], qw, quant_linear.pack(qw), torch.ones(10))
    ref = quant_linear.reference(x[:, :64], qw, torch.ones(10))
    assert (y.double() - ref).abs().max() < 0.05 * ref.abs().max()
    y16 = quant_linear.matmul(x[:, :64].half(), qw, quant_linear.pack(qw))  # not the kernel's
    assert y16.dtype == torch.float16
    assert (y16.double() + 1 - ref).abs().max() < 0.05 * ref.abs().max()


def test_ops_in_the_library():
    """The ops load with the one kernel library (csrc/*.cpp), and pack sizes are as stated:
    w4 g32 with offsets 0.625 bytes a weight (with zero points 0.59375), w8 g32 1.0625,
    w6 g32 0.8125."""
    assert cpu_paged.available() and hasattr(torch.ops.radixlm_cpu, "quant_linear")
    for kind, offsets, per_weight in (("w4", True, 0.625), ("w4", "z", 0.59375),
                                      ("w8", False, 1.0625), ("w6", False, 0.8125)):
        qw = make_qweight(kind, 64, 256, 32, offsets, False)
        packed = packing(qw, kind)
        assert packed.nbytes() - packed.rowf.nbytes == 64 * 256 * per_weight
