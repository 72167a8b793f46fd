"""The fused-MoE kernel (``kernels/fused_moe.py``) against a float64 per-token loop, its
alignment step's invariants, and the MoE layer through it against the layer's CPU grouped
path. Without CUDA the kernel runs on CPU tensors in Triton's interpreter (small shapes).
Nothing may be read back to the host (``.tolist()`` / ``.item()`` refused), as a CUDA graph
requires."""

import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from radixlm import kernels  # noqa: E402
from radixlm.kernels import reference  # noqa: E402
from radixlm.runtime.executor.layers.moe import MoESpec, SparseMoeBlock, route  # noqa: E402

pytest.importorskip("triton")
from radixlm.kernels import fused_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _refuse(*args, **kwargs):
    raise AssertionError("a value was read back to the host")


@contextlib.contextmanager
def no_readback():
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.Tensor, "tolist", _refuse)
        m.setattr(torch.Tensor, "item", _refuse)
        yield


def _weights(e: int, h: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) * h**-0.5
    w2 = torch.randn(e, h, inter, generator=gen) * inter**-0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def moe_f64(x, w13, w2, weights, ids) -> torch.Tensor:
    """sum_k weights[t, k] * down(silu(gate x) * up x), token by token, in float64."""
    x, w13, w2, weights = (t.double().cpu() for t in (x, w13, w2, weights))
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k, e in enumerate(ids[t].tolist()):
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            out[t] += weights[t, k] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def _routing(case: str, n: int, e: int, k: int, gen: torch.Generator):
    """(ids, weights) of a routing case; weights float32 as ``route`` gives them."""
    logits = torch.randn(n, e, generator=gen) * 2
    if case == "one_expert":  # every token's first choice is expert 3
        logits[:, 3] += 100
    if case == "empty_experts":  # experts 0 and 5 never chosen
        logits[:, [0, 5]] -= 100
    weights, ids = route(logits, k, renormalize=case != "unnormalized")
    if case == "one_expert" and k == 1:
        assert bool((ids == 3).all())
    return ids.to(DEVICE), weights.to(DEVICE)


@pytest.mark.parametrize(("case", "n", "e", "k"), [
    ("renormalized", 5, 8, 2), ("unnormalized", 5, 8, 2), ("empty_experts", 7, 8, 2),
    ("one_expert", 6, 4, 2), ("one_expert", 20, 4, 1), ("renormalized", 1, 8, 2),
    ("renormalized", 40, 4, 2)])  # 40: an expert's run spans several blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_match_float64(case, n, e, k, dtype):
    h, inter = 32, 48
    gen = torch.Generator().manual_seed(n * 10 + e)
    x = torch.randn(n, h, generator=gen).to(DEVICE, dtype)
    w13, w2 = _weights(e, h, inter, dtype, seed=e)
    ids, weights = _routing(case, n, e, k, gen)
    want = moe_f64(x, w13, w2, weights, ids)
    with no_readback():
        got = kernels.fused_experts(x, w13, w2, weights, ids, reference.silu_and_mul,
                                    backend="triton")
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.isfinite(got).all()
    tol = TOL[dtype] * max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=0)
    twin = kernels.fused_experts(x, w13, w2, weights, ids, reference.silu_and_mul,
                                 backend="torch")
    torch.testing.assert_close(twin.double().cpu(), want, atol=tol, rtol=0)


@pytest.mark.parametrize(("n", "e", "k", "block_m"), [(5, 8, 2, 16), (40, 4, 2, 16),
                                                      (3, 8, 1, 4), (1, 8, 2, 16)])
def test_align_pads_each_expert_to_whole_blocks(n, e, k, block_m):
    gen = torch.Generator().manual_seed(n)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    ids[: n // 2, 0] = 1  # a crowded expert; some experts usually empty
    with no_readback():
        aligned = fused_moe.moe_align_block_size(ids.to(DEVICE), e, block_m)
    sorted_ids, expert_ids, num_padded = (t.cpu() for t in aligned)
    flat, pairs, total = ids.reshape(-1), n * k, int(num_padded[0])
    counts = torch.bincount(flat, minlength=e)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.numel() % block_m == 0 and sorted_ids.numel() >= total
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    assert bool((sorted_ids[total:] == pairs).all())  # past the end: padding only
    for b in range(total // block_m):  # each block: one expert's pairs, in order
        block = sorted_ids[b * block_m:(b + 1) * block_m]
        mine = block[block < pairs]
        assert mine.numel() > 0 and bool((flat[mine] == expert_ids[b]).all())
        assert mine.tolist() == sorted(mine.tolist())


GPT_OSS = {"scoring": "topk_softmax", "router_bias": True, "activation": "gpt_oss_swiglu",
           "activation_params": (("alpha", 1.702), ("limit", 0.5)), "expert_bias": True}


@pytest.mark.parametrize(("family", "norm", "in_dtype"), [("mixtral", True, False),
                                                          ("qwen3_moe", False, True),
                                                          ("gpt_oss", True, False)])
def test_moe_layer_through_the_kernel_equals_the_grouped_path(family, norm, in_dtype):
    """``SparseMoeBlock`` on the Triton path (the fused kernel) against its CPU grouped path
    (``backend="torch"``: one matmul pair per active expert) on the same weights; gpt-oss:
    biased experts, its router and its clamped SwiGLU (limit 0.5, so the clamp bites)."""
    hidden, inter, experts = 64, 32, 8
    spec = MoESpec(experts, 2, inter, renormalize=norm, weights_in_dtype=in_dtype,
                   **(GPT_OSS if family == "gpt_oss" else {}))
    block = SparseMoeBlock(hidden, spec, "silu")
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    block = block.to(DEVICE)
    x = torch.randn(9, hidden, generator=gen).to(DEVICE)
    with torch.no_grad():
        grouped = block(x, backend="torch")
        with no_readback():  # the fused path reads nothing back
            fused = block(x, backend="triton")
    torch.testing.assert_close(fused, grouped, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_with_biases_match_float64(dtype):
    """gate_up's bias before the activation, down's weighted with the output, per expert."""
    n, e, k, h, inter = 7, 8, 2, 32, 48
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, h, generator=gen).to(DEVICE, dtype)
    w13, w2 = _weights(e, h, inter, dtype, seed=5)
    b13 = torch.randn(e, 2 * inter, generator=gen).to(DEVICE, dtype)
    b2 = torch.randn(e, h, generator=gen).to(DEVICE, dtype)
    ids, weights = _routing("renormalized", n, e, k, gen)
    xd, w13d, w2d, b13d, b2d = (t.double().cpu() for t in (x, w13, w2, b13, b2))
    want = torch.zeros_like(xd)
    for t in range(n):
        for j, ex in enumerate(ids[t].cpu().tolist()):
            gu = w13d[ex] @ xd[t] + b13d[ex]
            act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            want[t] += float(weights[t, j]) * (w2d[ex] @ act + b2d[ex])
    tol = TOL[dtype] * max(1.0, float(want.abs().max()))
    for backend in ("triton", "torch"):
        with no_readback():
            got = kernels.fused_experts(x, w13, w2, weights, ids, reference.silu_and_mul,
                                        backend, b13, b2)
        torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=0, msg=backend)


def test_launcher_asserts_the_layout():
    w13, w2 = _weights(4, 32, 16, torch.float32, seed=0)
    x = torch.randn(3, 32).to(DEVICE)
    ids = torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(AssertionError, match="w2"):
        fused_moe.fused_experts_triton(x, w13, w2[:, :, :8], torch.ones(3, 2, device=DEVICE),
                                       ids, reference.silu_and_mul)
    with pytest.raises(AssertionError, match="topk_weights"):
        fused_moe.fused_experts_triton(x, w13, w2, torch.ones(3, 1, device=DEVICE), ids,
                                       reference.silu_and_mul)
