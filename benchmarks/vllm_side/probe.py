"""How fast this machine computes right now: a float32 matmul on the benchmark's threads.

The machines these rounds run on are shared: another tenant's work slows one round and not
the next (on the Zen 3 VM, two cores' FMA loop ran at 48 and at 96 GFLOP/s a core minutes
apart). Taken before and after each system's run, the probe tells a round that ran in a
slow spell from one where a system was slower. It runs in the parent, between the workers,
never beside one.
"""

from __future__ import annotations

import time

# [256, 768] x [768, 768]: the small preset's o_proj on a prefill chunk; ~0.3 GFLOP a call
PROBE_SHAPE = (256, 768, 768)


def machine_probe(threads: int, seconds: float = 0.3) -> float:
    """GFLOP/s of float32 matmuls on ``threads`` threads over about ``seconds`` (after
    one untimed call), the best of three thirds: a spell of the run, not its worst
    moment."""
    if threads < 1 or not seconds > 0:
        raise ValueError("machine_probe: threads >= 1 and seconds > 0")
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m, k, n = PROBE_SHAPE
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        torch.mm(x, w)
        best = 0.0
        for _ in range(3):
            calls, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < seconds / 3:
                torch.mm(x, w)
                calls += 1
            best = max(best, 2 * m * k * n * calls / elapsed / 1e9)
        return best
    finally:
        torch.set_num_threads(before)
