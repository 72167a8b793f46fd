"""The Triton quantized GEMM (``kernels/quant_linear_triton.py``) against
``qweight.reference_linear`` (float64): every kind, with and without offsets, groups
16 / 32 / 64 / 128 / k and one that no K step aligns with (24), odd N and K with a short
last group, 1, 3 and 17 rows, act-order, bias. Outputs are NaN-poisoned first, so a tile
the kernel skips cannot pass. Without CUDA the kernel runs in Triton's interpreter (small
shapes)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from radixlm.kernels.qweight import QuantWeight, reference_linear  # noqa: E402

pytest.importorskip("triton")
from radixlm.kernels import quant_linear_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The output's rounding to x's dtype, relative to |y|: one unit in the last place (Triton's
# interpreter truncates to bfloat16). The float32 accumulation's, plus on a GPU the
# dequantized weight's rounding to x's dtype before a 16-bit dot (the interpreter dots in
# float32), relative to sum |x| |W| + |bias|.
OUT_TOL = {torch.float32: 0.0, torch.bfloat16: 2**-7, torch.float16: 2**-10}
SUM_TOL = 1e-5
WEIGHT_TOL = OUT_TOL if DEVICE == "cuda" else dict.fromkeys(OUT_TOL, 0.0)


def make_weight(kind: str, n: int, k: int, group: int, mins: bool, perm: bool,
                seed: int) -> QuantWeight:
    """Random codes over the kind's whole range, scales of both signs, offsets."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    if kind == "w4":
        data = torch.randint(0, 256, (n, -(-k // 2)), generator=gen, dtype=torch.uint8)
        if k % 2:  # the unused high nibble of a row's last byte must be ignored
            data[:, -1] |= 0xF0
    elif kind == "w8":
        data = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        data = (torch.randn(n, k, generator=gen) * 8).to(torch.float8_e4m3fn)
    scales = torch.randn(n, groups, generator=gen) * 0.05
    offs = torch.randn(n, groups, generator=gen) * 0.1 if mins else None
    order = torch.randperm(k, generator=gen) if perm else None
    qw = QuantWeight(kind, n, k, group, data, scales, offs, order)
    return QuantWeight(kind, n, k, group, *(None if t is None else t.to(DEVICE) for t in
                                            (qw.data, qw.scales, qw.mins, qw.perm)))


def run_and_check(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None) -> None:
    out = torch.full((*x.shape[:-1], qw.n), float("nan"), dtype=x.dtype, device=DEVICE)
    got = quant_linear_triton.linear(x, qw, bias, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == x.dtype
    want = reference_linear(x.cpu(), QuantWeight(qw.kind, qw.n, qw.k, qw.group, *(
        None if t is None else t.cpu() for t in (qw.data, qw.scales, qw.mins, qw.perm))),
        None if bias is None else bias.cpu())
    w_abs = QuantWeight(qw.kind, qw.n, qw.k, qw.group, qw.data.cpu(), qw.scales.cpu(),
                        None if qw.mins is None else qw.mins.cpu(),
                        None if qw.perm is None else qw.perm.cpu()).dequantize().abs()
    bound = x.cpu().double().abs() @ w_abs.double().T  # [..., N]
    if bias is not None:
        bound += bias.cpu().double().abs()
    err = (got.cpu().double() - want).abs()
    assert not got.isnan().any(), "an output element was never written"
    allowed = OUT_TOL[x.dtype] * want.abs() + (SUM_TOL + WEIGHT_TOL[x.dtype]) * bound
    worst = (err / allowed).max().item()
    assert worst <= 1, f"error {worst:.3g} times the allowed (x {x.dtype}, {qw.kind})"


GROUPS = {"16": 16, "32": 32, "64": 64, "128": 128, "k": None, "24": 24}


@pytest.mark.parametrize("group_name", list(GROUPS))
@pytest.mark.parametrize("mins", [False, True])
@pytest.mark.parametrize("kind", ["w4", "w8", "fp8"])
def test_matches_float64(kind, mins, group_name):
    """Rows 1, 3, 17 and 70 (each block size, one and two row blocks), odd N (one and two
    column blocks), odd K with a short last group (5 columns), float32 / bfloat16 / float16
    x, bias on some."""
    group = GROUPS[group_name]
    k = 75 if group is None else 2 * group + 5
    n = 45
    qw = make_weight(kind, n, k, group or k, mins, False, seed=len(group_name) + k)
    gen = torch.Generator().manual_seed(k)
    for rows, dtype in ((1, torch.bfloat16), (3, torch.float32), (17, torch.float16),
                        (70, torch.bfloat16)):
        x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
        bias = torch.randn(n, generator=gen).to(DEVICE) if rows != 1 else None
        run_and_check(x, qw, bias)


@pytest.mark.parametrize("kind", ["w4", "w8", "fp8"])
def test_act_order(kind):
    """GPTQ desc_act: stored column j multiplies input feature perm[j]; leading dims kept."""
    qw = make_weight(kind, 33, 77, 32, kind == "w4", True, seed=7)
    x = torch.randn(2, 3, 77, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    run_and_check(x, qw, None)


def test_row_views_and_empty_batch():
    """``QuantWeight.rows`` views (row strides of the parent) and zero rows."""
    qw = make_weight("w4", 70, 64, 32, True, False, seed=3).rows(13, 50)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    run_and_check(x, qw, None)
    assert quant_linear_triton.linear(x[:0], qw).shape == (0, 37)


def test_launcher_asserts_the_layout():
    qw = make_weight("w8", 16, 32, 16, False, False, seed=4)
    with pytest.raises(AssertionError, match="for a weight of shape"):
        quant_linear_triton.linear(torch.randn(2, 31, device=DEVICE), qw)
    with pytest.raises(AssertionError, match="expected one of"):
        quant_linear_triton.linear(torch.randn(2, 32, device=DEVICE).double(), qw)
    with pytest.raises(AssertionError, match="bias"):
        quant_linear_triton.linear(torch.randn(2, 32, device=DEVICE), qw,
                                   torch.zeros(15, device=DEVICE))
    with pytest.raises(AssertionError, match="out"):
        quant_linear_triton.linear(torch.randn(2, 32, device=DEVICE), qw,
                                   out=torch.empty(2, 16, device=DEVICE).half())
