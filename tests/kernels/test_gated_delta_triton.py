"""The Triton fused recurrent gated delta rule against the torch step in float64.

Without CUDA the kernel runs on CPU tensors in the interpreter: TRITON_INTERPRET must be set
before the kernel is defined (before ``radixlm.kernels.gated_delta_triton`` is imported).
The oracle: ``recurrent_gated_delta_rule_step`` in float64, token by token from the same
pool states; the pool's other slots must stay bit for bit, the outputs start as NaN.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need triton")

from radixlm.kernels import gated_delta_triton as gdt  # noqa: E402
from radixlm.runtime.executor.layers import gated_delta as gd  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_SLOTS = 7


def _snapshots(pairs: list[tuple[int, int]], slots: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence, tokens) pairs and their pool slots as the kernel takes them."""
    seqs, lens = zip(*pairs, strict=True)
    return (torch.tensor(seqs, device=DEVICE), torch.tensor(lens, device=DEVICE),
            torch.tensor(slots, device=DEVICE))


def _inputs(seed: int, lens: list[int], hk: int, hv: int, dk: int, dv: int,
            dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    a = torch.randn(t, hv, generator=gen)
    b = torch.randn(t, hv, generator=gen)
    a_log, dt_bias = torch.rand(hv, generator=gen), torch.randn(hv, generator=gen)
    g, beta = gd.gated_delta_gates(a, b, a_log, dt_bias)
    return {"q": torch.randn(t, hk, dk, generator=gen).to(dtype),
            "k": torch.randn(t, hk, dk, generator=gen).to(dtype),
            "v": torch.randn(t, hv, dv, generator=gen).to(dtype), "g": g, "beta": beta,
            "pool": torch.randn(NUM_SLOTS, hv, dk, dv, generator=gen)}


def _oracle(inp: dict[str, torch.Tensor], lens: list[int], slots: list[int],
            fresh: list[bool], l2norm: bool) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Outputs [T, Hv, Dv] and each sequence's states after each of its tokens, float64."""
    outs, states, start = [], [], 0
    for n, slot, new in zip(lens, slots, fresh, strict=True):
        s = inp["pool"][slot : slot + 1].double()
        if new:
            s = torch.zeros_like(s)
        seq_states = []
        for t in range(start, start + n):
            o, s = gd.recurrent_gated_delta_rule_step(
                *(inp[x][t : t + 1].double() for x in ("q", "k", "v", "g", "beta")), s,
                use_qk_l2norm=l2norm)
            outs.append(o)
            seq_states.append(s[0])
        states.append(seq_states)
        start += n
    return torch.cat(outs), states


def _run(inp, lens, slots, l2norm=True, fresh=None, snapshots=None):
    pool = inp["pool"].clone().to(DEVICE)
    args = [inp[x].to(DEVICE) for x in ("q", "k", "v", "g", "beta")]
    out = gdt.fused_recurrent_gated_delta_rule(
        *args, pool, torch.tensor(slots, device=DEVICE), lens, use_qk_l2norm=l2norm,
        fresh=None if fresh is None else torch.tensor(fresh, device=DEVICE),
        snapshots=snapshots, block_v=16)
    return out.cpu(), pool.cpu()


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    return bool(((got.double() - want).abs() <= rel * (1 + want.abs())).all())


@pytest.mark.parametrize("shape", [(2, 4, 16, 32), (1, 1, 32, 16), (2, 2, 16, 24)])  # Hk Hv Dk Dv
@pytest.mark.parametrize("l2norm", [True, False])
def test_packed_sequences_match_float64_steps(shape, l2norm):
    hk, hv, dk, dv = shape
    lens, slots = [1, 5, 3], [4, 0, 2]  # a decode token beside two prefills
    inp = _inputs(dk + dv + hv, lens, hk, hv, dk, dv, torch.float32)
    out, pool = _run(inp, lens, slots, l2norm)
    want, states = _oracle(inp, lens, slots, [False] * 3, l2norm)
    assert out.shape == want.shape and out.dtype == torch.float32
    assert _close(out, want, 2e-5)
    for slot, seq_states in zip(slots, states, strict=True):
        assert _close(pool[slot], seq_states[-1], 2e-5)
    others = [i for i in range(NUM_SLOTS) if i not in slots]
    assert torch.equal(pool[others], inp["pool"][others])


def test_bfloat16_inputs_fresh_states_and_snapshots():
    """bf16 activations (out rounded once), a fresh sequence whose slot holds NaN (zeros
    used instead), and snapshots written to their own slots in any order."""
    hk, hv, dk, dv = 1, 2, 16, 16
    lens, slots, fresh = [4, 1, 6], [1, 5, 3], [False, True, False]
    inp = _inputs(5, lens, hk, hv, dk, dv, torch.bfloat16)
    inp["pool"][5] = float("nan")
    pairs, snap_slots = [(2, 5), (0, 2), (2, 1), (1, 1)], [0, 2, 4, 6]
    out, pool = _run(inp, lens, slots, fresh=fresh, snapshots=_snapshots(pairs, snap_slots))
    want, states = _oracle(inp, lens, slots, fresh, True)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert _close(out, want, 2.0**-7)
    for slot, seq_states in zip(slots, states, strict=True):
        assert _close(pool[slot], seq_states[-1], 2e-5)
    for (seq, n), slot in zip(pairs, snap_slots, strict=True):
        assert _close(pool[slot], states[seq][n - 1], 2e-5)


def test_same_snapshot_twice_is_refused():
    inp = _inputs(1, [3], 1, 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="same length"):
        _run(inp, [3], [0], snapshots=_snapshots([(0, 2), (0, 2)], [1, 2]))


def test_snapshot_outside_its_sequence_is_refused():
    inp = _inputs(2, [3, 2], 1, 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="outside"):
        _run(inp, [3, 2], [0, 1], snapshots=_snapshots([(1, 3)], [2]))
