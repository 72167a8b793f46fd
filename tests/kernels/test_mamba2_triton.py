"""The Triton fused recurrent Mamba2 scan against the torch ``ssd_step`` in float64.

Without CUDA the kernel runs on CPU tensors in the interpreter: TRITON_INTERPRET must be set
before the kernel is defined (before ``radixlm.kernels.mamba2_triton`` is imported).
The oracle: ``ssd_step`` in float64, token by token from the same pool states; the pool's
other slots must stay bit for bit.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need triton")

from radixlm.kernels import mamba2_triton as m2t  # noqa: E402
from radixlm.runtime.executor.layers import mamba2 as m2  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_SLOTS = 7
HEAD_PARAMS = ("A_log", "D", "dt_bias")


def _snapshots(pairs: list[tuple[int, int]], slots: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence, tokens) pairs and their pool slots as the kernel takes them."""
    seqs, lens = zip(*pairs, strict=True)
    return (torch.tensor(seqs, device=DEVICE), torch.tensor(lens, device=DEVICE),
            torch.tensor(slots, device=DEVICE))


def _inputs(seed: int, lens: list[int], heads: int, head_dim: int, groups: int, d_state: int,
            dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """dt + dt_bias around -2 (softplus ~ 0.02 .. 0.7), some above 20 (softplus linear)."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    dt = torch.randn(t, heads, generator=gen) - 1
    dt[0, 0] = 25.0
    return {"x": torch.randn(t, heads, head_dim, generator=gen).to(dtype), "dt": dt.to(dtype),
            "B": torch.randn(t, groups, d_state, generator=gen).to(dtype),
            "C": torch.randn(t, groups, d_state, generator=gen).to(dtype),
            "A_log": torch.rand(heads, generator=gen) * 2.5,
            "D": torch.randn(heads, generator=gen),
            "dt_bias": torch.randn(heads, generator=gen) - 1,
            "pool": torch.randn(NUM_SLOTS, heads, head_dim, d_state, generator=gen)}


def _oracle(inp: dict[str, torch.Tensor], lens: list[int], slots: list[int],
            fresh: list[bool], dt_limit: tuple[float, float]
            ) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """y [T, H, P] and each sequence's states after each of its tokens, float64."""
    ys, states, start = [], [], 0
    params = {p: inp[p].double() for p in HEAD_PARAMS}
    for n, slot, new in zip(lens, slots, fresh, strict=True):
        s = inp["pool"][slot : slot + 1].double()
        if new:
            s = torch.zeros_like(s)
        seq_states = []
        for t in range(start, start + n):
            tok = {x: inp[x][t : t + 1].double() for x in ("x", "dt", "B", "C")}
            y, s = m2.ssd_step(**tok, **params, state=s, dt_limit=dt_limit)
            ys.append(y)
            seq_states.append(s[0])
        states.append(seq_states)
        start += n
    return torch.cat(ys), states


def _run(inp, lens, slots, dt_limit=m2.NO_DT_LIMIT, fresh=None, snapshots=None):
    pool = inp["pool"].clone().to(DEVICE)
    args = {x: inp[x].to(DEVICE) for x in ("x", "dt", "B", "C", *HEAD_PARAMS)}
    y = m2t.fused_recurrent_ssd(
        **args, pool=pool, slots=torch.tensor(slots, device=DEVICE), seq_lens=lens,
        dt_limit=dt_limit, fresh=None if fresh is None else torch.tensor(fresh, device=DEVICE),
        snapshots=snapshots, block_p=4)
    return y.cpu(), pool.cpu()


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    return bool(((got.double() - want).abs() <= rel * (1 + want.abs())).all())


@pytest.mark.parametrize("shape", [(4, 8, 2, 16), (3, 6, 3, 16), (2, 8, 1, 9)])  # H P G N
@pytest.mark.parametrize("dt_limit", [m2.NO_DT_LIMIT, (0.05, 0.4)])
def test_packed_sequences_match_float64_steps(shape, dt_limit):
    heads, head_dim, groups, d_state = shape
    lens, slots = [5, 1, 3], [4, 0, 2]  # a decode token among prefills
    inp = _inputs(heads + d_state, lens, heads, head_dim, groups, d_state, torch.float32)
    y, pool = _run(inp, lens, slots, dt_limit)
    want, states = _oracle(inp, lens, slots, [False] * 3, dt_limit)
    assert y.shape == want.shape and y.dtype == torch.float32
    assert _close(y, want, 5e-5)
    for slot, seq_states in zip(slots, states, strict=True):
        assert _close(pool[slot], seq_states[-1], 2e-5)
    others = [i for i in range(NUM_SLOTS) if i not in slots]
    assert torch.equal(pool[others], inp["pool"][others])


def test_bfloat16_inputs_fresh_states_and_snapshots():
    """bf16 activations (y rounded once), a fresh sequence whose slot holds NaN (zeros used
    instead), and snapshots written to their own slots in any order."""
    heads, head_dim, groups, d_state = 4, 8, 2, 16
    lens, slots, fresh = [3, 6, 1], [1, 3, 5], [False, False, True]
    inp = _inputs(9, lens, heads, head_dim, groups, d_state, torch.bfloat16)
    inp["pool"][5] = float("nan")
    pairs, snap_slots = [(1, 4), (0, 1), (1, 2), (2, 1)], [0, 2, 4, 6]
    y, pool = _run(inp, lens, slots, (0.0, 0.6), fresh,
                   _snapshots(pairs, snap_slots))
    want, states = _oracle(inp, lens, slots, fresh, (0.0, 0.6))
    assert y.dtype == torch.bfloat16 and not y.isnan().any()
    assert _close(y, want, 2.0**-7)
    for slot, seq_states in zip(slots, states, strict=True):
        assert _close(pool[slot], seq_states[-1], 2e-5)
    for (seq, n), slot in zip(pairs, snap_slots, strict=True):
        assert _close(pool[slot], states[seq][n - 1], 2e-5)
