"""The CPU kernel's packed float32 path (``csrc/packed_attention.cpp``: a block's keys
transposed once for all of a task's rows, scores as outer products) against a float64
oracle, called as the plan calls the op: segments with rows enough per KV head to take it
(tiles of 3-6 rows, as even as the rows divide, keys past a block's end), every pool dtype
and vector head width, causal or not, sliding windows, soft caps, a pass continued from an
earlier one, rows in no segment. The same segments with ``RADIXLM_CPU_PACKED=0`` (a process
of its own) take the FMA path; both must match the oracle, and each other to float32
rounding."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from radixlm.kernels import cpu_paged

pytestmark = pytest.mark.skipif(not (cpu_paged.available() and cpu_paged.packed()),
                                reason="kernel without the packed path (neither AVX-512 nor AVX2)")
SCALE = 0.3


def oracle(q, k_buf, v_buf, rows, q_indptr, kv_indptr, kv_indices, causal, window, cap,
           o_init, lse_init):
    """float64 (o, lse) of the op's contract (cpu_paged's module doc)."""
    n, hq, d = q.shape
    grp = hq // k_buf.shape[1]
    o = torch.zeros(n, hq, d, dtype=torch.float64) if o_init is None else o_init.double()
    lse = (torch.full((n, hq), float("-inf"), dtype=torch.float64) if lse_init is None
           else lse_init.double())
    o, lse = o.clone(), lse.clone()
    for s in range(len(q_indptr) - 1):
        r = rows[q_indptr[s]: q_indptr[s + 1]]
        slots = kv_indices[kv_indptr[s]: kv_indptr[s + 1]]
        keys = k_buf[slots].double().repeat_interleave(grp, 1)
        vals = v_buf[slots].double().repeat_interleave(grp, 1)
        sc = torch.einsum("nhd,lhd->nhl", q[r].double(), keys) * SCALE
        if cap:
            sc = torch.tanh(sc / cap) * cap
        p = torch.arange(len(r))[:, None] + len(slots) - len(r)
        j = torch.arange(len(slots))[None, :]
        seen = (j <= p if causal else torch.ones_like(j <= p)) & (
            j > p - window if window else True)
        sc = sc.masked_fill(~seen[:, None, :], float("-inf"))
        if lse_init is not None:  # the earlier pass: one more "key" with its o as value
            sc = torch.cat([lse_init[r].double()[..., None], sc], -1)
            vals = torch.cat([o_init[r].double()[:, :, None], vals.permute(1, 0, 2)[None]
                              .expand(len(r), -1, -1, -1)], 2)
        m = torch.logsumexp(sc, -1)
        w = torch.exp(sc - m[..., None]).nan_to_num(0.0)
        out = (torch.einsum("nhl,nhld->nhd", w, vals) if lse_init is not None
               else torch.einsum("nhl,lhd->nhd", w, vals))
        seen_any = torch.isfinite(m)
        o[r] = torch.where(seen_any[..., None], out, o[r])
        lse[r] = torch.where(seen_any, m, lse[r])
    return o, lse


def _case(seed, d, dtype, causal, window, cap, init, hq=6, hkv=2):
    """Three segments of 5-14 query rows (15-42 rows per KV head: tiles of 4-6) over
    50-200 scattered keys (blocks of 64 and a partial one), rows permuted, two rows in none."""
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(5, 15, (3,), generator=g)]
    keys = [n + int(x) for n, x in zip(lens, torch.randint(45, 190, (3,), generator=g))]
    n = sum(lens) + 2
    pool = sum(keys) + 11
    k_buf = (torch.randn(pool, hkv, d, generator=g) * 1.5).to(dtype)
    v_buf = torch.randn(pool, hkv, d, generator=g).to(dtype)
    q = torch.randn(n, hq, d, generator=g) * 1.5
    rows = torch.randperm(n, generator=g)[: n - 2]
    q_indptr = torch.tensor([0, *lens]).cumsum(0)
    kv_indptr = torch.tensor([0, *keys]).cumsum(0)
    kv_indices = torch.randperm(pool, generator=g)[: sum(keys)]
    o_init = torch.randn(n, hq, d, generator=g) if init else None
    lse_init = torch.randn(n, hq, generator=g) if init else None
    return (q, k_buf, v_buf, rows, q_indptr, kv_indptr, kv_indices, causal, window, cap,
            o_init, lse_init)


def _run(args):
    q, k_buf, v_buf, rows, qi, ki, kvi, causal, window, cap, o_init, lse_init = args
    return cpu_paged.paged_attention(q, k_buf, v_buf, rows, qi, ki, kvi, SCALE, causal,
                                     o_init, lse_init, window, cap)


CASES = [(d, dtype, causal) for d in (32, 64, 96, 128, 256) for dtype in cpu_paged.KV_DTYPES
         for causal in (False, True)]


def test_the_cases_take_the_packed_path():
    # every segment of _case has rows and keys enough (the thresholds the kernel reports)
    assert 5 * (6 // 2) >= torch.ops.radixlm_cpu.packed_min_rows()
    assert 50 >= torch.ops.radixlm_cpu.packed_min_keys()


@pytest.mark.parametrize("d,dtype,causal", CASES)
def test_packed_matches_f64(d, dtype, causal):
    for i, (window, cap, init) in enumerate([(None, None, False), (37, None, False),
                                             (None, 4.0, True), (70, 6.0, True)]):
        if window and not causal:
            continue
        args = _case(d + i, d, dtype, causal, window, cap, init)
        o, lse = _run(args)
        ro, rl = oracle(*args)
        assert torch.allclose(o.double(), ro, atol=2e-5, rtol=1e-4), (window, cap, init)
        assert torch.equal(torch.isinf(lse), torch.isinf(rl))
        assert torch.allclose(lse.double().nan_to_num(0.0, neginf=0.0),
                              rl.nan_to_num(0.0, neginf=0.0), atol=2e-5, rtol=1e-5)


def _decode_case(seed, d, grp, init):
    """Decode: four segments of one row each over 1-150 scattered keys, 2 KV heads in
    groups of ``grp``: ``grp`` rows per KV head (where every task takes this path, AVX2
    builds: one tile of 3, padded, up to 3 rows; of 4 or 5; 7 rows as 3 + 4; the FMA path
    on AVX-512)."""
    g = torch.Generator().manual_seed(seed)
    keys = [1, *(int(x) for x in torch.randint(2, 150, (3,), generator=g))]
    hkv, hq, pool = 2, 2 * grp, sum(keys) + 5
    q = torch.randn(5, hq, d, generator=g) * 1.5
    k_buf = (torch.randn(pool, hkv, d, generator=g) * 1.5)
    v_buf = torch.randn(pool, hkv, d, generator=g)
    rows = torch.randperm(5, generator=g)[:4]
    kv_indices = torch.randperm(pool, generator=g)[: sum(keys)]
    o_init = torch.randn(5, hq, d, generator=g) if init else None
    lse_init = torch.randn(5, hq, generator=g) if init else None
    return (q, k_buf, v_buf, rows, torch.arange(5), torch.tensor([0, *keys]).cumsum(0),
            kv_indices, True, None, 5.0 if init else None, o_init, lse_init)


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("grp", [1, 2, 3, 4, 5, 7])
def test_decode_rows_match_f64(d, grp):
    for init in (False, True):
        args = _decode_case(d * grp, d, grp, init)
        o, lse = _run(args)
        ro, rl = oracle(*args)
        assert torch.allclose(o.double(), ro, atol=2e-5, rtol=1e-4), init
        assert torch.allclose(lse.double().nan_to_num(0.0, neginf=0.0),
                              rl.nan_to_num(0.0, neginf=0.0), atol=2e-5, rtol=1e-5)


def _fma_path_results():
    """The same cases with the packed path off, in a process of its own (the switch is read
    once per process)."""
    env = dict(os.environ, RADIXLM_CPU_PACKED="0")
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def _results():
    res = []
    for d in (64, 128):
        for causal in (False, True):
            o, lse = _run(_case(d, d, torch.float32, causal, 37 if causal else None, None, True))
            res.append([o.flatten()[::7].tolist(), lse.flatten().tolist()])
    return res


def test_the_fma_path_agrees():
    assert not json.loads(subprocess.run(
        [sys.executable, "-c", "import json, torch; from radixlm.kernels import cpu_paged; "
         "print(json.dumps(cpu_paged.packed()))"], env=dict(os.environ, RADIXLM_CPU_PACKED="0"),
        capture_output=True, text=True, check=True).stdout)
    for (o, lse), (fo, flse) in zip(_results(), _fma_path_results()):
        assert torch.allclose(torch.tensor(o), torch.tensor(fo), atol=1e-5, rtol=1e-5)
        assert torch.allclose(torch.tensor(lse), torch.tensor(flse), atol=1e-5, rtol=1e-6)


if __name__ == "__main__":  # the FMA path's results for test_the_fma_path_agrees
    print(json.dumps(_results()))
