"""The mixture-of-experts layer (``layers/moe.py``) against transformers' own MoE blocks on
random weights and hidden states: the routing rule of each family, the grouped experts,
one matmul pair per active expert, and the experts' split over tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from radixlm.runtime.distributed.layers import (
    can_prepack,
    check_tp_split,
    packed_layers,
    prepack_weights,
)
from radixlm.runtime.distributed.parallel_state import TpGroup
from radixlm.runtime.executor.layers import moe
from radixlm.runtime.executor.layers.moe import MoESpec, SparseMoeBlock, route
from radixlm.runtime.executor.models import load_model
from radixlm.runtime.model_config import ModelConfig

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 32, 48, 8, 2, 50


def _hf_block(family: str, norm_topk_prob: bool = True) -> torch.nn.Module:
    sizes = {"hidden_size": HIDDEN, "num_experts_per_tok": TOP_K}
    if family == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(**sizes, intermediate_size=INTER,
                                                    num_local_experts=EXPERTS))
    else:
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**sizes, moe_intermediate_size=INTER,
                                                      num_experts=EXPERTS,
                                                      norm_topk_prob=norm_topk_prob))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return block.eval()


def _ours(hf: torch.nn.Module, renormalize: bool, weights_in_dtype: bool) -> SparseMoeBlock:
    spec = MoESpec(EXPERTS, TOP_K, INTER, renormalize=renormalize,
                   weights_in_dtype=weights_in_dtype)
    block = SparseMoeBlock(HIDDEN, spec, "silu")
    block.load_state_dict({"gate.weight": hf.gate.weight,
                           "experts.gate_up_proj": hf.experts.gate_up_proj,
                           "experts.down_proj": hf.experts.down_proj})
    return block


@pytest.mark.parametrize(("family", "norm"), [("mixtral", True), ("qwen3_moe", True),
                                              ("qwen3_moe", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_matches_transformers(family, norm, dtype):
    """float32 within 1e-5; bfloat16 (the same routing from the same bf16 router logits,
    Mixtral's float32 weights vs Qwen3-MoE's rounded ones) within bf16 rounding."""
    hf = _hf_block(family, norm).to(dtype)
    ours = _ours(hf, renormalize=norm, weights_in_dtype=family == "qwen3_moe").to(dtype)
    x = torch.randn(3, TOKENS // 3 + 1, HIDDEN, generator=torch.Generator().manual_seed(1))
    x = x.to(dtype)
    with torch.no_grad():
        want = hf(x).reshape(-1, HIDDEN)
        got = ours(x.reshape(-1, HIDDEN))
        assert torch.equal(route(ours.gate(x.reshape(-1, HIDDEN)), TOP_K, norm)[1],
                           hf.gate(x)[2])
    assert got.dtype == dtype
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_transformers_router(norm):
    """Our routing rule on random router logits equals transformers' router's (the router
    computes its logits from hidden states: feed it the identity so they are the logits)."""
    hf = _hf_block("qwen3_moe", norm).gate
    logits = torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(2)) * 3
    with torch.no_grad():
        hf.weight.copy_(torch.eye(EXPERTS, HIDDEN))
        padded = F.pad(logits, (0, HIDDEN - EXPERTS))
        _, want_weights, want_ids = hf(padded)
    weights, ids = route(logits, TOP_K, renormalize=norm)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=0)
    if norm:  # renormalized softmax over all == softmax over the top k (gpt-oss's order)
        weights2, ids2 = route(logits, TOP_K, scoring="topk_softmax")
        assert torch.equal(ids2, ids)
        torch.testing.assert_close(weights2, weights, atol=1e-6, rtol=0)


def test_one_matmul_pair_per_active_expert(monkeypatch):
    """Tokens are grouped by expert: 2 linears per active expert, however many tokens."""
    hf = _hf_block("mixtral")
    ours = _ours(hf, renormalize=True, weights_in_dtype=False)
    calls = []
    real_linear = F.linear

    def counting(x, w, b=None):
        calls.append(x.shape[0])
        return real_linear(x, w, b)

    x = torch.randn(200, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, ids = route(ours.gate(x), TOP_K)
        monkeypatch.setattr(moe.F, "linear", counting)  # torch's: the router's call too
        ours(x)
    active = ids.unique().numel()
    assert calls[0] == 200  # the router
    assert len(calls[1:]) == 2 * active and sum(calls[1:]) == 2 * 200 * TOP_K


def test_spec_checks():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoESpec(4, 5, 8)
    with pytest.raises(ValueError, match="scoring"):
        MoESpec(4, 2, 8, scoring="sigmoid")


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_experts_split_over_ranks(family_dirs, arch):
    """Built for each rank of tp 2 (no process group needed to build and load): every
    expert's gate / up rows and down columns are the rank's slice of the checkpoint's
    per-expert tensors, the router is whole, and the ranks' partial outputs (what the
    all-reduce sums) add up to the one-rank output."""
    path = family_dirs[arch]
    cfg = ModelConfig.from_hf(path)
    full = load_file(str(path / "model.safetensors"))
    block, (gate, up, down) = (("block_sparse_moe", ("w1", "w3", "w2")) if arch == "mixtral"
                               else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    expert = f"model.layers.2.{block}.experts.5"
    whole = load_model(cfg, path, "cpu").model.layers[2].mlp
    x = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        weights, ids = route(whole.gate(x), whole.spec.top_k, whole.spec.renormalize)
        want = whole(x)
    parts, rows = [], []
    for rank in range(2):
        mlp = load_model(cfg, path, "cpu", TpGroup(rank, 2)).model.layers[2].mlp
        assert torch.equal(mlp.gate.weight, full[f"model.layers.2.{block}.gate.weight"])
        rows.append(mlp.experts)
        with torch.no_grad():
            parts.append(mlp.experts(x, ids, weights.to(x.dtype) if mlp.spec.weights_in_dtype
                                     else weights))
    half = rows[0].gate_up_proj.shape[1] // 2
    for name, pick in ((gate, slice(0, half)), (up, slice(half, 2 * half))):
        assert torch.equal(torch.cat([r.gate_up_proj[5, pick] for r in rows]),
                           full[f"{expert}.{name}.weight"])
    assert torch.equal(torch.cat([r.down_proj[5] for r in rows], dim=1),
                       full[f"{expert}.{down}.weight"])
    torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-5, rtol=0)


def test_uneven_expert_split_names_the_size(family_dirs):
    cfg = ModelConfig.from_hf(family_dirs["qwen3_moe"])  # moe_intermediate_size 32
    check_tp_split(cfg, 2)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(32\) is not divisible"):
        check_tp_split(cfg, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_experts_equal_the_dense_weights(dtype):
    """``prepack_weights`` gives each expert oneDNN-packed copies (as the dense linears get):
    the block's output is the unpacked one's, the copies are counted, and dropping them
    returns to the stacked parameters."""
    hf = _hf_block("mixtral").to(dtype)
    ours = _ours(hf, renormalize=True, weights_in_dtype=False).to(dtype)
    if not can_prepack(ours.experts.gate_up_proj):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.no_grad():
        want = ours(x)
        assert prepack_weights(ours) == 2  # the router and the experts
        assert ours.experts in packed_layers(ours) and len(ours.experts.packed) == EXPERTS
        assert ours.experts.packed_nbytes() == (ours.experts.gate_up_proj.nbytes
                                                + ours.experts.down_proj.nbytes)
        got = ours(x)
        prepack_weights(ours, on=False)
        assert ours.experts.packed is None and packed_layers(ours) == []
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
