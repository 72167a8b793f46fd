"""The fused CPU layer kernels (``kernels/cpu_fused``, compiled C++) against float64
formulas: RMSNorm with and without the residual add, neox rotary on strided q/k views, and
SiLU-and-mul, in float32 and bfloat16, over widths on and off the 16-lane vector path and
empty batches; the KV pool's write against torch's indexed assignment; plus the dispatch
(backend None on CPU takes them, "torch" does not); float32 RMSNorm bit-for-bit the
reference's (see ``kernels.rms_norm``)."""

from __future__ import annotations

import pytest
import torch

from radixlm import kernels
from radixlm.kernels import cpu_fused, reference

pytestmark = pytest.mark.skipif(not cpu_fused.supports(torch.zeros(1)),
                                reason="CPU kernels not built")
DTYPES = [torch.float32, torch.bfloat16]
# relative error to float64: float32 rounding, or one bfloat16 rounding of the result
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3}


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _close(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert x.dtype == dtype and x.shape == ref.shape
    if ref.numel() == 0:
        return
    err = ((x.double() - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], err


def _norm_f64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [768, 100, 5])
@pytest.mark.parametrize("rows", [0, 1, 37])
def test_rms_norm(dtype, hidden, rows) -> None:
    x = _randn(rows, hidden, dtype=dtype, seed=0)
    w = _randn(hidden, dtype=dtype, seed=1)
    _close(cpu_fused.rms_norm(x, w, 1e-5), _norm_f64(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [768, 100, 5])
@pytest.mark.parametrize("rows", [0, 1, 37])
def test_fused_add_rms_norm(dtype, hidden, rows) -> None:
    x, r = _randn(rows, hidden, dtype=dtype, seed=2), _randn(rows, hidden, dtype=dtype, seed=3)
    w = _randn(hidden, dtype=dtype, seed=4)
    x0, r0 = x.clone(), r.clone()
    out, s = cpu_fused.rms_norm(x, w, 1e-6, r)
    # the sum is rounded to the dtype first (as torch's x + residual), then normalised
    assert torch.equal(s, x0 + r0)
    _close(out, _norm_f64(s, w, 1e-6), dtype)
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs written"


def test_rms_norm_float32_weight_and_strided_rows() -> None:
    # a bfloat16 activation with a float32 weight; rows of a wider buffer
    buf = _randn(9, 200, dtype=torch.bfloat16, seed=5)
    x, w = buf[:, :96], _randn(96, dtype=torch.float32, seed=6)
    _close(cpu_fused.rms_norm(x, w, 1e-5), _norm_f64(x, w, 1e-5), torch.bfloat16)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_float32_rms_norm_gives_the_reference_bits(threads, rows) -> None:
    # torch's own order of the sum of squares (8-lane vectors in cascade levels), then
    # sum / H, 1 / sqrt(mean + eps), (x * r) * w: bit-for-bit, so a float32 model's logits
    # are the reference's; widths around the vector and cascade boundaries, strided rows
    assert cpu_fused.exact_float32_norm(768)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed, h in enumerate([8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129,
                                  255, 257, 768, 1025, 2047, 4096, 5120]):
            buf = _randn(rows, h + 3, dtype=torch.float32, seed=seed, scale=3.0)
            x, w = buf[:, :h], _randn(h, dtype=torch.float32, seed=100 + seed)
            r = _randn(rows, h, dtype=torch.float32, seed=200 + seed, scale=10.0)
            for eps in (1e-5, 1e-6):
                assert torch.equal(cpu_fused.rms_norm(x, w, eps), reference.rms_norm(x, w, eps))
                out, s = cpu_fused.rms_norm(x, w, eps, r)
                ref, ref_s = reference.rms_norm(x, w, eps, r)
                assert torch.equal(out, ref) and torch.equal(s, ref_s), (h, eps)
    finally:
        torch.set_num_threads(prev)


def test_float32_rms_norm_keeps_the_reference_where_the_bits_would_differ(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(cpu_fused, "rms_norm", lambda *a, **k: calls.append(a[0].shape))
    x, w = torch.randn(3, 7), torch.ones(7)  # under 8 wide: torch sums another way
    kernels.rms_norm(x, w, 1e-5)
    monkeypatch.setattr(cpu_fused, "_float32_norm_matches", lambda: False)  # another torch
    kernels.rms_norm(torch.randn(3, 64), torch.ones(64), 1e-5)
    assert calls == []
    kernels.rms_norm(torch.randn(3, 64).bfloat16(), torch.ones(64).bfloat16(), 1e-5)
    assert calls == [(3, 64)]


def _rotary_f64(x, cs, pos):
    cos, sin = cs.double()[pos].chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 40])
@pytest.mark.parametrize("rows", [0, 1, 33])
def test_rotary_on_strided_views_of_qkv(dtype, d, rows) -> None:
    hq, hkv = 12, 2
    qkv = _randn(rows, (hq + 2 * hkv) * d, dtype=dtype, seed=10)
    q = qkv[:, : hq * d].reshape(rows, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].reshape(rows, hkv, d)
    before = qkv.clone()
    cs = torch.cat([torch.randn(500, d // 2).cos(), torch.randn(500, d // 2).sin()], dim=-1)
    pos = torch.randint(0, 500, (rows,), generator=torch.Generator().manual_seed(11))
    qo, ko = kernels.apply_rotary(q, k, cs, pos)
    _close(qo, _rotary_f64(q, cs, pos), dtype)
    _close(ko, _rotary_f64(k, cs, pos), dtype)
    assert qo.is_contiguous() and ko.is_contiguous()
    assert torch.equal(qkv, before), "inputs written"
    if dtype == torch.float32:  # no FMA contraction: bit-exact against the reference
        rq, rk = reference.apply_rotary(q, k, cs, pos)
        assert torch.equal(qo, rq) and torch.equal(ko, rk)


def test_rotary_rejects_positions_outside_the_table() -> None:
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        kernels.apply_rotary(q, k, torch.randn(10, 64), torch.tensor([3, 10]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [2048, 100, 7])
@pytest.mark.parametrize("rows", [0, 1, 29])
def test_silu_and_mul(dtype, inter, rows) -> None:
    # gates over [-120, 120] reach both ends of exp's clamped range
    x = _randn(rows, 2 * inter, dtype=dtype, seed=12, scale=30.0)
    g, u = x.double().chunk(2, dim=-1)
    _close(kernels.silu_and_mul(x), g / (1 + torch.exp(-g)) * u, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_keeps_nan(dtype) -> None:
    # a NaN gate or up gives NaN (bfloat16: torch's 0x7FC0), on the vector lanes and the
    # row's tail (inter 21: 16 + 5, 8 + 8 + 5)
    x = _randn(3, 42, dtype=dtype, seed=13)
    x[0, 2] = x[1, 21 + 9] = x[2, 5] = x[2, 41] = float("nan")
    ours, ref = kernels.silu_and_mul(x), reference.silu_and_mul(x)
    assert torch.equal(ours.isnan(), ref.isnan()) and ours.isnan().sum() == 4
    if dtype == torch.bfloat16:
        assert (ours[ours.isnan()].view(torch.int16) == 0x7FC0).all()


def test_backend_torch_keeps_the_reference(monkeypatch) -> None:
    calls = []
    for name in ("rms_norm", "apply_rotary", "silu_and_mul", "store_kv"):
        monkeypatch.setattr(cpu_fused, name, lambda *a, _n=name, **k: calls.append(_n))
    x, w = torch.randn(3, 32), torch.ones(32)
    xb, wb = x.bfloat16(), w.bfloat16()
    q, k, cs = torch.randn(3, 2, 32), torch.randn(3, 1, 32), torch.randn(8, 32)
    pos = torch.tensor([0, 1, 2])
    kernels.rms_norm(xb, wb, 1e-5, backend="torch")
    kernels.apply_rotary(q, k, cs, pos, backend="torch")
    kernels.silu_and_mul(x, backend="torch")
    buf, loc = torch.zeros(8, 1, 32), torch.tensor([5, 2, 7])
    kernels.store_kv(buf, buf.clone(), loc, k, k, backend="torch")
    assert calls == []
    kernels.rms_norm(x, w, 1e-5)  # float32 RMSNorm: the kernel, the reference's bits
    kernels.rms_norm(xb, wb, 1e-5)
    kernels.apply_rotary(q, k, cs, pos)
    kernels.silu_and_mul(x)
    kernels.silu_and_mul(x.half())  # float16: not a kernel dtype, the reference
    kernels.store_kv(buf, buf.clone(), loc, k, k)
    kernels.store_kv(buf.half(), buf.half(), loc, k, k)  # float32 into float16: the reference
    assert calls == ["rms_norm", "rms_norm", "apply_rotary", "silu_and_mul", "store_kv"]
    with pytest.raises(ValueError, match="backend"):
        kernels.silu_and_mul(x, backend="cuda")


@pytest.mark.parametrize("pool, src", [(torch.float32, torch.float32),
                                       (torch.bfloat16, torch.bfloat16),
                                       (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("rows", [0, 1, 9, 700])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_store_kv_matches_indexed_assignment(pool, src, rows, index_dtype) -> None:
    """Slots written exactly as ``buf[loc] = k.to(pool)`` (bfloat16 rounding included, NaN
    and inf kept), nothing else touched; v a strided view of a fused qkv row (700 rows: the
    threaded path)."""
    slots, hkv, d = 1024, 2, 24
    k_buf = torch.full((slots, hkv, d), float("nan"), dtype=pool)
    v_buf = k_buf.clone()
    loc = torch.randperm(slots, generator=torch.Generator().manual_seed(1))[:rows]
    qkv = _randn(rows, 4 * hkv * d, dtype=src, seed=2, scale=3.0)
    k = _randn(rows, hkv, d, dtype=src, seed=3, scale=3.0)
    if rows:
        k[0, 0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    v = qkv[:, 3 * hkv * d:].view(rows, hkv, d)
    cpu_fused.store_kv(k_buf, v_buf, loc.to(index_dtype), k, v)
    want_k, want_v = torch.full_like(k_buf, float("nan")), torch.full_like(v_buf, float("nan"))
    want_k[loc], want_v[loc] = k.to(pool), v.to(pool)
    assert torch.allclose(k_buf, want_k, rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(v_buf, want_v, rtol=0, atol=0, equal_nan=True)


def test_store_kv_checks_every_slot_before_writing() -> None:
    k_buf = torch.zeros(10, 2, 16)
    v_buf = k_buf.clone()
    k = torch.ones(3, 2, 16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_fused.store_kv(k_buf, v_buf, torch.tensor([1, 2, 10]), k, k)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_fused.store_kv(k_buf, v_buf, torch.tensor([-1, 2, 3]), k, k)
    assert not k_buf.any() and not v_buf.any()
    with pytest.raises(ValueError, match="len\\(loc\\)"):
        cpu_fused.store_kv(k_buf, v_buf, torch.tensor([1, 2]), k, k)
