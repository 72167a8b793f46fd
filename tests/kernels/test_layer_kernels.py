"""store_kv, RMSNorm and rotary: Triton against the torch reference, and the reference
against plain float64 formulas. Triton runs in the interpreter without CUDA."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from radixlm import kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# the interpreter rounds float32 -> bfloat16 differently from torch: a few ulps of slack
ULPS = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}
BACKENDS = ["torch", "triton"]


def _needs_triton(backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def _close(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = ((x.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < ULPS[dtype], err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_store_kv_writes_exactly_the_given_slots(backend, dtype, index_dtype) -> None:
    _needs_triton(backend)
    # float32 rows into a float16 pool also cast; bfloat16 rows are stored as they are (the
    # interpreter rounds float32 -> bfloat16 differently from torch)
    src_dtype = torch.float32 if dtype == torch.float16 else dtype
    slots, hkv, d, n = 40, 2, 24, 9
    k_buf = torch.full((slots, hkv, d), float("nan"), device=DEVICE, dtype=dtype)
    v_buf = k_buf.clone()
    loc = torch.randperm(slots, generator=torch.Generator().manual_seed(1))[:n]
    loc = loc.to(DEVICE, index_dtype)
    k, v = _randn(n, hkv, d, dtype=src_dtype, seed=2), _randn(n, hkv, d, dtype=src_dtype, seed=3)
    kernels.store_kv(k_buf, v_buf, loc, k, v, backend=backend)
    assert torch.equal(k_buf[loc.long()], k.to(dtype))
    assert torch.equal(v_buf[loc.long()], v.to(dtype))
    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[loc.long()] = False
    assert torch.isnan(k_buf[untouched]).all() and torch.isnan(v_buf[untouched]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_kv_rejects_bad_shapes(backend) -> None:
    _needs_triton(backend)
    k_buf = torch.zeros(10, 2, 16, device=DEVICE)
    k = _randn(3, 2, 16)
    with pytest.raises(ValueError, match="len\\(loc\\)"):
        kernels.store_kv(
            k_buf, k_buf.clone(), torch.arange(2, device=DEVICE), k, k, backend=backend
        )


def _rms_norm_f64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm(backend, dtype, hidden) -> None:
    _needs_triton(backend)
    x, w = _randn(7, hidden, dtype=dtype), _randn(hidden, dtype=dtype, seed=1)
    out = kernels.rms_norm(x, w, 1e-6, backend=backend)
    assert out.dtype == dtype and out.shape == x.shape
    _close(out, _rms_norm_f64(x, w, 1e-6), dtype)
    if backend == "triton":
        _close(out, kernels.rms_norm(x, w, 1e-6, backend="torch"), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual(backend, dtype) -> None:
    _needs_triton(backend)
    x, res = _randn(5, 64, dtype=dtype), _randn(5, 64, dtype=dtype, seed=2)
    w = _randn(64, dtype=dtype, seed=1)
    x_before, res_before = x.clone(), res.clone()
    out, new_res = kernels.rms_norm(x, w, 1e-5, residual=res, backend=backend)
    assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs modified"
    _close(new_res, x.double() + res.double(), dtype)
    _close(out, _rms_norm_f64(new_res, w, 1e-5), dtype)
    if backend == "triton":
        ref_out, ref_res = kernels.rms_norm(x, w, 1e-5, residual=res, backend="torch")
        _close(new_res, ref_res, dtype)
        _close(out, ref_out, dtype)


def _cos_sin_cache(max_pos: int, d: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq  # [P, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), -1)  # float64: the oracle's copy


def _rotary_f64(x: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Hugging Face Llama's rotate-half formula, in float64."""
    half = x.shape[-1] // 2
    cos = cache[pos, :half].repeat(1, 2)[:, None]  # [N, 1, D]
    sin = cache[pos, half:].repeat(1, 2)[:, None]
    x = x.double()
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 64])
def test_apply_rotary(backend, dtype, d) -> None:
    _needs_triton(backend)
    n = 6
    cache = _cos_sin_cache(50, d).to(DEVICE)
    pos = torch.tensor([0, 1, 7, 49, 3, 3], device=DEVICE)
    q, k = _randn(n, 4, d, dtype=dtype), _randn(n, 2, d, dtype=dtype, seed=1)
    q_out, k_out = kernels.apply_rotary(q, k, cache.float(), pos, backend=backend)
    assert q_out.dtype == dtype and k_out.shape == k.shape
    _close(q_out, _rotary_f64(q, cache, pos), dtype)
    _close(k_out, _rotary_f64(k, cache, pos), dtype)
    if backend == "triton":
        q_ref, k_ref = kernels.apply_rotary(q, k, cache.float(), pos, backend="torch")
        _close(q_out, q_ref, dtype)
        _close(k_out, k_ref, dtype)


def test_cpu_default_backend_needs_no_triton() -> None:
    """``backend=None`` on CPU tensors is the torch path."""
    x = torch.randn(2, 16)
    torch.testing.assert_close(
        kernels.rms_norm(x, torch.ones(16), 1e-6),
        kernels.rms_norm(x, torch.ones(16), 1e-6, backend="torch"),
    )
