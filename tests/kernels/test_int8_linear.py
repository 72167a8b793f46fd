"""Weight-only int8 (``kernels/int8_linear.py``): per-channel quantization error within half
a step, and ``int8_linear`` against a float64 ``(q * scales) @ x`` on both paths (the
packed int8 kernel and the widened weight: rows either side of PACKED_MAX_ROWS, in-features
a multiple of 16 or not), every dtype, with and without bias."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.int8_linear import (
    PACKED_MAX_ROWS,
    QMAX,
    int8_linear,
    int8_linear_reference,
    quantize_per_channel,
)

# relative error of one product in each dtype's output (the sum is accumulated in float32)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _weight(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of many scales
    w[3] = 0.0  # an all-zero row
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantization_error_is_within_half_a_step(dtype):
    w = _weight(40, 96, dtype)
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and s.dtype == dtype
    assert s.shape == (40,) and int(q.abs().max()) <= QMAX
    err = (q.double() * s.double()[:, None] - w.double()).abs()
    step = s.double()[:, None]
    assert bool((err <= step / 2 + 1e-6 * step).all()), float((err / step).max())
    assert torch.equal(q[3], torch.zeros(96, dtype=torch.int8)) and float(s[3]) == 1.0
    # each row's largest weight lands on (or next to) +-127: the scale is the row's own
    assert int(q.abs().amax(dim=1)[torch.arange(40) != 3].min()) >= QMAX - 1


def test_row_max_from_a_wider_row_is_the_shard_of_the_whole():
    """A shard of columns quantized with the whole rows' maxima is the same slice of the
    whole weight's quantization (what a row-parallel rank does)."""
    w = _weight(24, 64, torch.float32)
    q, s = quantize_per_channel(w)
    row_max = w.abs().amax(dim=1)
    for cols in (slice(0, 32), slice(32, 64)):
        qs, ss = quantize_per_channel(w[:, cols].contiguous(), row_max)
        assert torch.equal(qs, q[:, cols]) and torch.equal(ss, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 5, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 70])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [144, 136])  # 136: not a multiple of 16, the widened path
def test_matches_float64_reference(dtype, rows, bias, k):
    n = 47
    q, s = quantize_per_channel(_weight(n, k, dtype))
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = torch.full((rows, n), float("nan"), dtype=dtype)  # a skipped row stays NaN
    out.copy_(int8_linear(x, q, s, b))
    ref = int8_linear_reference(x, q, s, b)
    assert out.dtype == dtype and out.shape == (rows, n)
    scale = ref.abs().max().item() if rows else 1.0
    torch.testing.assert_close(out.double(), ref, rtol=TOL[dtype], atol=TOL[dtype] * scale)


def test_leading_dimensions_and_a_non_contiguous_input():
    q, s = quantize_per_channel(_weight(32, 64, torch.bfloat16))
    x = torch.randn(64, 6).to(torch.bfloat16).T  # [6, 64], last dim not contiguous
    y = int8_linear(x, q, s)
    torch.testing.assert_close(y.double(), int8_linear_reference(x, q, s), rtol=1e-2,
                               atol=1e-2 * float(y.abs().max()))
    x3 = torch.randn(2, 3, 64).to(torch.bfloat16)
    assert int8_linear(x3, q, s).shape == (2, 3, 32)
    torch.testing.assert_close(int8_linear(x3, q, s), int8_linear(x3.reshape(6, 64), q, s)
                               .reshape(2, 3, 32))
