"""Attention kernels (torch reference and Triton) against a float64 dense attention.

Without CUDA the Triton kernels run on CPU tensors in the interpreter: TRITON_INTERPRET
must be set before the kernels are defined, i.e. before ``radixlm.kernels``' Triton
modules are first imported (the package imports them lazily).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402

import pytest  # noqa: E402

from radixlm import kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
BACKENDS = ["torch", "triton"]


def _needs_triton(backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")


@dataclasses.dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor | None  # new tokens' K (extend only)
    v: torch.Tensor | None
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    sm_scale: float


def _indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens, device=DEVICE).cumsum(0)


def _slots(kv_lens: list[int], page_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Per-token KV slots of each sequence, on pages handed out in random order."""
    pages_per_seq = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_per_seq) + 3  # some slots nobody owns
    page_order = torch.randperm(num_pages, generator=gen)
    indices, next_page = [], 0
    for n, pages in zip(kv_lens, pages_per_seq, strict=True):
        own = page_order[next_page : next_page + pages]
        next_page += pages
        token_slots = (own[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        indices.append(token_slots[:n])
    return torch.cat(indices).to(DEVICE), num_pages * page_size


def make_batch(q_lens, kv_lens, hq, hkv, d, dtype, page_size, seed, extend) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    kv_indices, num_slots = _slots(kv_lens, page_size, gen)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    n = sum(q_lens)
    k_buf, v_buf = randn(num_slots, hkv, d), randn(num_slots, hkv, d)
    k = randn(n, hkv, d) if extend else None
    v = randn(n, hkv, d) if extend else None
    return Batch(
        randn(n, hq, d), k, v, k_buf, v_buf, _indptr(q_lens), _indptr(kv_lens), kv_indices, d**-0.5
    )


def dense_attention_f64(b: Batch) -> torch.Tensor:
    """Plain per-sequence softmax(QK^T)V in float64, causal over the new tokens."""
    outs = []
    group = b.q.shape[1] // b.k_buf.shape[1]
    qo, kv = b.qo_indptr.tolist(), b.kv_indptr.tolist()
    for s in range(len(qo) - 1):
        idx = b.kv_indices[kv[s] : kv[s + 1]]
        keys, values = b.k_buf[idx].double(), b.v_buf[idx].double()  # [L, Hkv, D]
        if b.k is not None:
            keys = torch.cat((keys, b.k[qo[s] : qo[s + 1]].double()))
            values = torch.cat((values, b.v[qo[s] : qo[s + 1]].double()))
        keys = keys.repeat_interleave(group, 1)  # [L, Hq, D]
        values = values.repeat_interleave(group, 1)
        q = b.q[qo[s] : qo[s + 1]].double()  # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", q, keys) * b.sm_scale
        n, length = q.shape[0], keys.shape[0]
        visible = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + (length - n)
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        outs.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), values))
    return torch.cat(outs)


def run(b: Batch, backend: str) -> torch.Tensor:
    out = torch.full_like(b.q, float("nan"))  # every row must be written
    if b.k is None:
        got = kernels.decode_attention(
            b.q, b.k_buf, b.v_buf, b.kv_indptr, b.kv_indices, b.sm_scale, backend=backend, out=out
        )
    else:
        got = kernels.extend_attention(
            b.q,
            b.k,
            b.v,
            b.k_buf,
            b.v_buf,
            b.qo_indptr,
            b.kv_indptr,
            b.kv_indices,
            b.sm_scale,
            backend=backend,
            out=out,
        )
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any(), "rows left unwritten"
    return out


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def check(b: Batch, backend: str) -> None:
    tol = TOL[b.q.dtype]
    out = run(b, backend)
    assert rel_err(out, dense_attention_f64(b)) < tol
    if backend == "triton":
        assert rel_err(out, run(b, "torch")) < 2 * tol


# (kv_lens, Hq, Hkv, D, dtype, page_size): GQA 1/2/4/8, one-token and 100x-ragged batches
DECODE_CASES = [
    ([1, 70, 5], 4, 2, 32, torch.float32, 1),
    ([130, 3], 2, 2, 64, torch.float32, 16),
    ([17, 1, 40], 8, 1, 16, torch.float16, 16),
    ([33, 2], 8, 2, 32, torch.bfloat16, 1),
    ([2, 200], 4, 2, 32, torch.float32, 16),
    ([3, 9], 4, 2, 128, torch.float32, 1),
    ([4, 2], 2, 2, 256, torch.bfloat16, 16),
    ([5, 20], 4, 2, 48, torch.float32, 1),  # head_dim not a power of two
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_decode_attention(case: int, backend: str) -> None:
    _needs_triton(backend)
    kv_lens, hq, hkv, d, dtype, page = DECODE_CASES[case]
    check(make_batch([1] * len(kv_lens), kv_lens, hq, hkv, d, dtype, page, case, False), backend)


# (q_lens, prefix_lens, Hq, Hkv, D, dtype, page_size)
EXTEND_CASES = [
    ([5, 1, 37, 1], [0, 40, 3, 0], 4, 2, 32, torch.float32, 1),
    ([20], [0], 8, 2, 64, torch.float16, 16),
    ([1, 1, 1], [10, 0, 50], 8, 1, 16, torch.bfloat16, 16),  # decode rows in an extend batch
    ([3, 33], [100, 1], 2, 2, 32, torch.float32, 16),  # prefixes 100x apart
    ([4, 2], [3, 0], 4, 2, 128, torch.float32, 1),
    ([3], [2], 2, 2, 256, torch.float16, 16),
    ([2, 0, 3], [1, 4, 0], 4, 2, 32, torch.float32, 1),  # a sequence with no new tokens
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(EXTEND_CASES)))
def test_extend_attention(case: int, backend: str) -> None:
    _needs_triton(backend)
    q_lens, prefix_lens, hq, hkv, d, dtype, page = EXTEND_CASES[case]
    check(make_batch(q_lens, prefix_lens, hq, hkv, d, dtype, page, 100 + case, True), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_matches_extend_of_one_token(backend: str) -> None:
    """A decode step equals an extend of one token whose K/V is passed, not stored."""
    _needs_triton(backend)
    b = make_batch([1, 1], [9, 30], 4, 2, 32, torch.float32, 1, 7, True)
    as_extend = run(b, backend)
    # store the new tokens into free slots and rerun as decode over prefix + new token
    free = torch.tensor([i for i in range(b.k_buf.shape[0]) if i not in b.kv_indices.tolist()])
    loc = free[:2].to(DEVICE)
    kernels.store_kv(b.k_buf, b.v_buf, loc, b.k, b.v, backend=backend)
    kv = b.kv_indptr.tolist()
    indices = torch.cat(
        [torch.cat((b.kv_indices[kv[s] : kv[s + 1]], loc[s : s + 1])) for s in range(2)]
    )
    decode = dataclasses.replace(b, k=None, v=None, kv_indptr=_indptr([10, 31]), kv_indices=indices)
    assert rel_err(run(decode, backend), as_extend) < 1e-5


# --------------------------------------------------------------------------- narrow KV pools
# --kv-cache-dtype: the pool holds a narrower dtype than q; both backends convert what they
# read and round the new tokens to the pool's dtype, as store_kv does.
KV_DTYPES = [torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn]


def _narrow_pool(b: Batch, kv_dtype: torch.dtype) -> tuple[Batch, Batch]:
    """``b`` over a ``kv_dtype`` pool, and its oracle twin: the same rounded values in
    q's dtype (new tokens rounded too)."""
    def rounded(t):
        return None if t is None else t.to(kv_dtype).to(b.q.dtype)

    narrow = dataclasses.replace(b, k_buf=b.k_buf.to(kv_dtype), v_buf=b.v_buf.to(kv_dtype))
    twin = dataclasses.replace(b, k=rounded(b.k), v=rounded(b.v), k_buf=rounded(b.k_buf),
                               v_buf=rounded(b.v_buf))
    return narrow, twin


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("extend", [False, True])
def test_attention_over_a_narrow_pool(kv_dtype, backend, extend) -> None:
    _needs_triton(backend)
    q_lens = [3, 1, 17] if extend else [1, 1, 1]
    b = make_batch(q_lens, [40, 0, 5] if extend else [40, 1, 70], 4, 2, 32, torch.float32,
                   4, 11, extend)
    narrow, twin = _narrow_pool(b, kv_dtype)
    out = run(narrow, backend)
    assert rel_err(out, dense_attention_f64(twin)) < 1e-5  # float32 math on rounded K/V
    assert rel_err(out, run(twin, backend)) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_queries_over_an_fp8_pool(backend) -> None:
    """A bfloat16 model with --kv-cache-dtype fp8_e4m3: the dots run in q's dtype (never
    the pool's) wherever they are not float32."""
    _needs_triton(backend)
    b = make_batch([5, 1], [9, 30], 4, 2, 32, torch.bfloat16, 1, 12, True)
    narrow, twin = _narrow_pool(b, torch.float8_e4m3fn)
    assert rel_err(run(narrow, backend), dense_attention_f64(twin)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_store_kv_rounds_like_torch(kv_dtype, backend) -> None:
    """Both backends store ``k.to(pool dtype)`` bit for bit (round to nearest even)."""
    _needs_triton(backend)
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(9, 2, 16, generator=gen).to(DEVICE) * 3 for _ in range(2))
    k_buf = torch.zeros(32, 2, 16, dtype=kv_dtype, device=DEVICE)
    v_buf = torch.zeros_like(k_buf)
    loc = torch.tensor([30, 2, 7, 8, 9, 0, 15, 16, 21], device=DEVICE)
    kernels.store_kv(k_buf, v_buf, loc, k, v, backend=backend)
    assert k_buf.dtype == kv_dtype
    assert torch.equal(k_buf[loc].view(torch.uint8), k.to(kv_dtype).view(torch.uint8))
    assert torch.equal(v_buf[loc].view(torch.uint8), v.to(kv_dtype).view(torch.uint8))


# --------------------------------------------------------------------------- bad layouts


def _decode_args(b: Batch) -> dict:
    return dict(
        q=b.q,
        k_buf=b.k_buf,
        v_buf=b.v_buf,
        kv_indptr=b.kv_indptr,
        kv_indices=b.kv_indices,
        sm_scale=b.sm_scale,
    )


def _extend_args(b: Batch) -> dict:
    return dict(
        q=b.q,
        k=b.k,
        v=b.v,
        k_buf=b.k_buf,
        v_buf=b.v_buf,
        qo_indptr=b.qo_indptr,
        kv_indptr=b.kv_indptr,
        kv_indices=b.kv_indices,
        sm_scale=b.sm_scale,
    )


def _strided(buf: torch.Tensor) -> torch.Tensor:
    """Same values, but not contiguous in the last two dims."""
    return buf.transpose(1, 2).contiguous().transpose(1, 2)


DECODE_BREAKS = {
    "kv_indptr must run": lambda a: a.update(kv_indices=a["kv_indices"][:-1]),
    "kv_indptr must have batch": lambda a: a.update(kv_indptr=a["kv_indptr"][:-1]),
    "multiple of Hkv": lambda a: a.update(q=a["q"][:, :3]),
    "head_dim": lambda a: a.update(q=a["q"][:, :, :16]),
    "contiguous in its last two dims": lambda a: a.update(k_buf=_strided(a["k_buf"])),
    "kv_indices must lie": lambda a: a.update(kv_indices=a["kv_indices"] + 10_000),
    "int32 or int64": lambda a: a.update(kv_indices=a["kv_indices"].float()),
}

EXTEND_BREAKS = {
    "kv_indptr must run": lambda a: a.update(kv_indptr=a["kv_indptr"] * 2),
    "qo_indptr must run": lambda a: a.update(q=a["q"][:-1], k=a["k"][:-1], v=a["v"][:-1]),
    "both have batch": lambda a: a.update(qo_indptr=a["qo_indptr"][:-1]),
    "multiple of Hkv": lambda a: a.update(q=a["q"][:, :3]),
    "head_dim": lambda a: a.update(q=a["q"][:, :, :16]),
    "contiguous in its last two dims": lambda a: a.update(v_buf=_strided(a["v_buf"])),
    "k and v must be": lambda a: a.update(k=a["k"][:, :1]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("what", sorted(DECODE_BREAKS))
def test_decode_rejects_bad_layout(what: str, backend: str) -> None:
    _needs_triton(backend)
    args = _decode_args(make_batch([1, 1], [5, 9], 4, 2, 32, torch.float32, 1, 0, False))
    DECODE_BREAKS[what](args)
    with pytest.raises(ValueError, match=what):
        kernels.decode_attention(**args, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("what", sorted(EXTEND_BREAKS))
def test_extend_rejects_bad_layout(what: str, backend: str) -> None:
    _needs_triton(backend)
    args = _extend_args(make_batch([3, 2], [5, 0], 4, 2, 32, torch.float32, 1, 0, True))
    EXTEND_BREAKS[what](args)
    with pytest.raises(ValueError, match=what):
        kernels.extend_attention(**args, backend=backend)


def test_unknown_backend_rejected() -> None:
    b = make_batch([1], [3], 2, 2, 16, torch.float32, 1, 0, False)
    with pytest.raises(ValueError, match="backend"):
        kernels.decode_attention(**_decode_args(b), backend="cuda")


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_on_cuda_matches_reference(dtype: torch.dtype) -> None:
    """Serving-sized shapes on the GPU: Triton vs the torch reference, both on CUDA."""
    gen = torch.Generator().manual_seed(0)
    kv_lens = torch.randint(1, 3000, (16,), generator=gen).tolist() + [4096, 1]
    decode = make_batch([1] * len(kv_lens), kv_lens, 32, 4, 128, dtype, 16, 1, False)
    extend = make_batch([300, 1, 64, 513], [0, 2000, 17, 1024], 32, 8, 128, dtype, 16, 2, True)
    for b in (decode, extend):
        ref = run(b, "torch")
        assert rel_err(run(b, "triton"), ref) < TOL[dtype]
