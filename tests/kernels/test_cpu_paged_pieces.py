"""The CPU attention kernel cuts a call's work into pieces for its threads (a long prompt
beside decode rows: by KV head and, causally, by query rows; costliest pieces first, each
thread taking the next): every thread count gives the same bits as one thread (key blocks
fall on the whole segment's grid in every piece), and the result matches float64, for
mixed batches with and without a sliding window or a soft cap, float32 and bfloat16 (AMX
tiles where the CPU has them), and for a shared-prefix group pass (many rows, not
causal)."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels import cpu_paged

pytestmark = pytest.mark.skipif(not cpu_paged.available(), reason="kernel not built")

HQ, HKV, D = 12, 2, 64


def _mixed(seed: int, dtype: torch.dtype, prompts: list[tuple[int, int]], decode: list[int]):
    """Prompts (cached keys, new rows) first, then decode rows over their keys, as the
    scheduler orders a mixed batch; slots shuffled over the pool."""
    g = torch.Generator().manual_seed(seed)
    q_lens = [n for _, n in prompts] + [1] * len(decode)
    k_lens = [c + n for c, n in prompts] + decode
    n, s = sum(q_lens), sum(k_lens)
    q = torch.randn(n, HQ, D, generator=g).to(dtype)
    kb, vb = (torch.randn(s + 7, HKV, D, generator=g).to(dtype) for _ in range(2))
    slots = torch.randperm(s + 7, generator=g)[:s]
    qi = torch.tensor([0, *q_lens]).cumsum(0)
    ki = torch.tensor([0, *k_lens]).cumsum(0)
    return q, kb, vb, torch.arange(n), qi, ki, slots


def _f64(q, kb, vb, qi, ki, slots, scale, window, cap):
    out = torch.empty(q.shape, dtype=torch.float64)
    grp = HQ // HKV
    for s in range(len(qi) - 1):
        rows = range(int(qi[s]), int(qi[s + 1]))
        idx = slots[int(ki[s]): int(ki[s + 1])]
        keys = kb[idx].double().repeat_interleave(grp, 1)
        vals = vb[idx].double().repeat_interleave(grp, 1)
        qq = q[list(rows)].double()
        sc = torch.einsum("nhd,lhd->hnl", qq, keys) * scale
        if cap:
            sc = cap * torch.tanh(sc / cap)
        n, length = qq.shape[0], keys.shape[0]
        pos = torch.arange(n)[:, None] + (length - n)
        j = torch.arange(length)[None, :]
        seen = (j <= pos) & ((j > pos - window) if window else True)
        out[list(rows)] = torch.einsum("hnl,lhd->nhd", sc.masked_fill(~seen, float("-inf"))
                                       .softmax(-1), vals)
    return out


def _run(threads: int, args, window: int, cap: float):
    q, kb, vb, rows, qi, ki, slots = args
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return cpu_paged.paged_attention(q, kb, vb, rows, qi, ki, slots, D ** -0.5,
                                         causal=True, sliding_window=window or None,
                                         logit_cap=cap or None)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, cap", [(0, 0.0), (48, 0.0), (0, 30.0)])
def test_every_thread_count_gives_one_threads_bits(dtype, window, cap):
    # a long prompt (cut by rows), one continuing a cached prefix, a short one, decode rows
    args = _mixed(0, dtype, [(0, 300), (70, 130), (0, 9)], [200, 45, 1, 333, 64])
    o1, lse1 = _run(1, args, window, cap)
    for threads in (2, 3, 4):
        o, lse = _run(threads, args, window, cap)
        assert torch.equal(o, o1) and torch.equal(lse, lse1), threads
    q, kb, vb, _, qi, ki, slots = args
    ref = _f64(q.float(), kb.float(), vb.float(), qi, ki, slots, D ** -0.5, window, cap)
    err = ((o1.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


def test_a_group_pass_of_many_rows_over_shared_keys():
    """Not causal (a shared prefix's group pass: every member's rows over the prefix):
    rows cut into pieces keep all keys."""
    g = torch.Generator().manual_seed(1)
    n, keys = 400, 256
    q = torch.randn(n, HQ, D, generator=g)
    kb, vb = (torch.randn(keys + 3, HKV, D, generator=g) for _ in range(2))
    slots = torch.randperm(keys + 3, generator=g)[:keys]
    qi, ki = torch.tensor([0, n]), torch.tensor([0, keys])
    before, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(cpu_paged.paged_attention(q, kb, vb, torch.arange(n), qi, ki, slots,
                                                  D ** -0.5))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs)
    ref = torch.softmax(torch.einsum("nhd,lhd->hnl", q.double(),
                                     kb[slots].double().repeat_interleave(6, 1)) * D ** -0.5,
                        -1)
    ref = torch.einsum("hnl,lhd->nhd", ref, vb[slots].double().repeat_interleave(6, 1))
    assert ((outs[0][0].double() - ref).norm() / ref.norm()).item() < 1e-5
