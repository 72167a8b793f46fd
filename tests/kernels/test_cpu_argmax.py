"""The greedy pick on the CPU (``csrc/argmax.cpp``, ``sampling.argmax``) against torch's
``max(dim=-1).indices``: the first maximal index, a NaN counting as the maximum (the first
NaN), ties, rows of -inf, signed zeros, widths off the vector lengths, strided rows, empty
batches, one and two threads."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels import cpu_paged
from radixlm.runtime.executor import sampling

pytestmark = pytest.mark.skipif(not cpu_paged.available(), reason="CPU kernels not built")


def _rows(b: int, v: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, v, generator=g)
    if b and v > 3:  # rows with ties, a NaN, -inf everywhere, signed zeros, a late max
        x[0, v // 3] = x[0, v - 1] = x[0].max() + 1
        if b > 1:
            x[1, v // 2] = float("nan")
            x[1, v - 1] = float("nan")
        if b > 2:
            x[2] = float("-inf")
        if b > 3:
            x[3] = 0.0
            x[3, 1::2] = -0.0
        if b > 4:
            x[4, v - 1] = float("inf")
    return x


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("v", [1, 5, 16, 17, 63, 64, 65, 1000, 32000, 32003])
def test_the_first_maximal_index_as_torch_picks_it(threads, v) -> None:
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (1, 6, 40):
            x = _rows(b, v, seed=v + b)
            want = x.max(dim=-1).indices
            assert torch.equal(torch.ops.radixlm_cpu.argmax_rows(x), want), (b, v)
            assert torch.equal(sampling.argmax(x), want)
            wide = torch.cat([x, torch.randn(b, 7)], dim=1)[:, :v]  # rows 7 apart
            assert torch.equal(sampling.argmax(wide), want)
    finally:
        torch.set_num_threads(prev)


def test_other_inputs_keep_torch_and_bad_ones_are_refused() -> None:
    x = _rows(6, 100, seed=3)
    assert torch.equal(sampling.argmax(x.t().contiguous().t()), x.max(dim=-1).indices)
    assert torch.equal(sampling.argmax(x.double()), x.double().max(dim=-1).indices)
    assert sampling.argmax(x[:0]).shape == (0,)
    with pytest.raises(RuntimeError, match="argmax_rows"):
        torch.ops.radixlm_cpu.argmax_rows(x.double())
    with pytest.raises(RuntimeError, match="argmax_rows"):
        torch.ops.radixlm_cpu.argmax_rows(torch.zeros(3, 0))
