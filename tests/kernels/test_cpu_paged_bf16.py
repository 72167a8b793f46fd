"""A bfloat16 model's attention on the CPU (``planned_attention``): q, k, v in bf16 and a
bf16 pool; the compiled kernel (q widened to float32 for it) in decode and short extend
chunks, torch's fused attention in bf16 for the long ones and for shared-prefix groups.
Float64 oracles over the very values the model holds (q, K/V already rounded to bf16);
outputs NaN-poisoned so a skipped row cannot pass."""

from __future__ import annotations

import pytest
import torch

from radixlm import kernels
from radixlm.kernels import cpu_paged, reference, shared_prefix
from radixlm.kernels.shared_prefix import AttentionPlan
from radixlm.runtime.model_config import cpu_has_bf16

needs_kernel = pytest.mark.skipif(not cpu_paged.available(), reason="kernel not built")
BF16 = torch.bfloat16


def _pool(seed: int, lens: list[int], hkv: int, d: int):
    """Sequences of ``lens`` tokens at shuffled slots of a bf16 pool."""
    g = torch.Generator().manual_seed(seed)
    size = sum(lens) + 9
    slots = torch.randperm(size, generator=g)[: sum(lens)]
    kb = (torch.randn(size, hkv, d, generator=g) * 0.5).to(BF16)
    vb = torch.randn(size, hkv, d, generator=g).to(BF16)
    return kb, vb, slots, torch.tensor([0] + lens).cumsum(0), g


def _close_to_rounded(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The kernel computes in float32 and rounds once: each element within one bf16 step
    (2^-8 relative) of the float64 result."""
    assert out.dtype == BF16 and not torch.isnan(out).any(), "rows left unwritten"
    err = (out.double() - ref).abs()
    assert bool((err <= ref.abs() * 2**-8 + 1e-4).all()), f"max error {err.max().item():.2e}"


@needs_kernel
@pytest.mark.parametrize("heads", [(12, 4), (8, 1), (4, 4)])
@pytest.mark.parametrize("use_groups", [False, True])
def test_bf16_decode_in_the_kernel_matches_f64(heads, use_groups):
    hq, hkv = heads
    lens = [45, 41, 63, 1, 130]
    kb, vb, kvi, kvp, g = _pool(hq + hkv, lens, hkv, 64)
    seqs = list(kvi.split(lens))
    for b in (1, 2):  # sequences 0-2 share their first 40 slots
        seqs[b][:40] = seqs[0][:40]
    kvi = torch.cat(seqs)
    q = torch.randn(len(lens), hq, 64, generator=g).to(BF16)
    plan = AttentionPlan.build(torch.arange(len(lens) + 1), kvp, kvi, hkv * 64, extend=False,
                               paged_kernel=True, dtype=BF16,
                               prefix_groups=[(40, [0, 1, 2])] if use_groups else None)
    assert plan.paged is not None and not plan.padded and plan.shared is None
    out = torch.full_like(q, float("nan"))
    kernels.decode_attention(q, kb, vb, kvp, kvi, 0.125, backend="torch", out=out, plan=plan)
    ref = reference.decode_attention(q.double(), kb.double(), vb.double(), kvp, kvi, 0.125)
    _close_to_rounded(out, ref)


def _extend(seed: int, prefix_lens: list[int], q_lens: list[int], hq: int, hkv: int, d: int):
    """Prefixes in the pool, then the new tokens, whose K/V are stored before attention."""
    kb, vb, slots, _, g = _pool(seed, [p + n for p, n in zip(prefix_lens, q_lens)], hkv, d)
    seqs = slots.split([p + n for p, n in zip(prefix_lens, q_lens)])
    kvi = torch.cat([s[:p] for s, p in zip(seqs, prefix_lens)])
    new_slots = torch.cat([s[p:] for s, p in zip(seqs, prefix_lens)])
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(BF16)
    kvp = torch.tensor([0] + prefix_lens).cumsum(0)
    qo = torch.tensor([0] + q_lens).cumsum(0)
    return q, kb[new_slots], vb[new_slots], kb, vb, qo, kvp, kvi, new_slots


def test_bf16_extend_rows_limit_is_float32s_without_bf16_instructions():
    # with bf16 matmuls (AMX / AVX512-BF16) torch's fused attention in bf16 wins past 16
    # rows; without them it converts element by element and float32's limit holds
    assert shared_prefix.KERNEL_MAX_EXTEND_ROWS_BF16 == (
        16 if cpu_has_bf16() else shared_prefix.KERNEL_MAX_EXTEND_ROWS)


@pytest.fixture
def bf16_limit_16(monkeypatch):
    """The bf16 limit of a CPU with bf16 matmuls, on every CPU: both extend paths run."""
    monkeypatch.setattr(shared_prefix, "KERNEL_MAX_EXTEND_ROWS_BF16", 16)


@needs_kernel
@pytest.mark.parametrize("heads", [(12, 4), (8, 1)])
def test_bf16_extend_short_chunks_in_the_kernel_long_ones_padded(heads, bf16_limit_16):
    hq, hkv = heads
    most = shared_prefix.KERNEL_MAX_EXTEND_ROWS_BF16
    prefix_lens, q_lens = [0, 5, 70, 0, 130, 1], [1, 3, most, most + 1, 2, 65]
    q, k, v, kb, vb, qo, kvp, kvi, new_slots = _extend(5, prefix_lens, q_lens, hq, hkv, 64)
    plan = AttentionPlan.build(qo, kvp, kvi, hkv * 64, extend=True, paged_kernel=True,
                               new_slots=new_slots, dtype=BF16)
    in_kernel = [b for b, n in enumerate(q_lens) if n <= most]
    assert len(plan.paged[0].q_indptr) - 1 == len(in_kernel) and plan.padded
    out = torch.full_like(q, float("nan"))
    kernels.extend_attention(q, k, v, kb, vb, qo, kvp, kvi, 0.125, backend="torch", out=out,
                             plan=plan)
    assert not torch.isnan(out).any(), "rows left unwritten"
    ref = reference.extend_attention(q.double(), k.double(), v.double(), kb.double(),
                                     vb.double(), qo, kvp, kvi, 0.125)
    rows = torch.cat([torch.arange(qo[b], qo[b + 1]) for b in in_kernel])
    _close_to_rounded(out[rows], ref[rows])
    # the padded passes: torch's fused attention in bf16 (rounding alone: 1.5e-3 here)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 4e-3


@needs_kernel
def test_bf16_extend_with_groups_takes_the_fused_passes_with_lse(bf16_limit_16):
    q, k, v, kb, vb, qo, kvp, kvi, new_slots = _extend(6, [40, 40, 40], [3, 20, 7], 12, 4, 64)
    kvi[40:80] = kvi[:40]
    kvi[80:] = kvi[:40]
    plan = AttentionPlan.build(qo, kvp, kvi, 4 * 64, extend=True, paged_kernel=True,
                               new_slots=new_slots, dtype=BF16, prefix_groups=[(40, [0, 1, 2])])
    assert plan.paged is None and plan.shared is not None
    out = torch.full_like(q, float("nan"))
    kernels.extend_attention(q, k, v, kb, vb, qo, kvp, kvi, 0.125, backend="torch", out=out,
                             plan=plan)
    assert not torch.isnan(out).any(), "rows left unwritten"
    ref = reference.extend_attention(q.double(), k.double(), v.double(), kb.double(),
                                     vb.double(), qo, kvp, kvi, 0.125)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 4e-3
