"""gpt-oss beyond the family suite (test_families.py runs its tiny checkpoint through every
engine configuration): its MoE block against transformers' own, the experts' split over
tensor-parallel ranks, MXFP4 dequantization against a float64 packer and transformers',
an MXFP4 checkpoint served token-exact, and the attention sinks switched off changing the
tokens."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from radixlm.kernels import quant_linear
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.distributed.layers import check_tp_split
from radixlm.runtime.distributed.parallel_state import TpGroup
from radixlm.runtime.executor.layers.moe import MoESpec, route
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.executor.models import load_model, mxfp4
from radixlm.runtime.executor.models.gpt_oss import GptOssMoeBlock
from radixlm.runtime.model_config import ModelConfig

HIDDEN, INTER, EXPERTS, TOP_K, LIMIT = 64, 32, 8, 2, 1.5
TEXT = ("To make bread you need flour, water, salt and yeast. First, mix the flour and the "
        "water in a large bowl, then add the salt and the yeast and knead for ten minutes.")
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def _hf_mlp() -> GptOssMLP:
    cfg = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                       num_experts_per_tok=TOP_K, swiglu_limit=LIMIT)
    mlp = GptOssMLP(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return mlp.eval()


def _ours(hf: GptOssMLP) -> GptOssMoeBlock:
    spec = MoESpec(EXPERTS, TOP_K, INTER, scoring="topk_softmax", router_bias=True,
                   activation="gpt_oss_swiglu",
                   activation_params=(("alpha", 1.702), ("limit", LIMIT)), expert_bias=True)
    block = GptOssMoeBlock(HIDDEN, spec, "silu")
    e = hf.experts
    block.load_state_dict({"gate.weight": hf.router.weight, "gate.bias": hf.router.bias,
                           "experts.gate_up_proj": e.gate_up_proj.transpose(1, 2),
                           "experts.gate_up_proj_bias": e.gate_up_proj_bias,
                           "experts.down_proj": e.down_proj.transpose(1, 2),
                           "experts.down_proj_bias": e.down_proj_bias})
    return block


def test_block_matches_transformers():
    """Router bias, top-k then softmax, biased experts, interleaved clamped SwiGLU: within
    1e-5 of transformers' GptOssMLP (float32), and the clamp bites at these sizes."""
    hf = _hf_mlp()
    ours = _ours(hf)
    x = torch.randn(2, 25, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x)[0].reshape(-1, HIDDEN)
        got = ours(x.reshape(-1, HIDDEN))
        _, _, hf_ids = hf.router(x.reshape(-1, HIDDEN))
        assert torch.equal(route(ours.gate(x.reshape(-1, HIDDEN)), TOP_K,
                                 scoring="topk_softmax")[1], hf_ids)
        gate_up = x.reshape(-1, HIDDEN) @ hf.experts.gate_up_proj[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (gate_up[:, ::2] > LIMIT).any() and (gate_up[:, 1::2].abs() > LIMIT).any()


def test_experts_split_over_ranks(family_dirs):
    """Each rank of tp 2 holds its interleaved gate/up pairs and down columns of every
    expert; the ranks' partial outputs (down's bias added by rank 0 only) sum to one rank's."""
    path = family_dirs["gpt_oss"]
    cfg = ModelConfig.from_hf(path)
    full = load_file(str(path / "model.safetensors"))
    whole = load_model(cfg, path, "cpu").model.layers[1].mlp
    x = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        weights, ids = route(whole.gate(x), TOP_K, scoring="topk_softmax")
        want = whole(x)
        parts, experts = [], []
        for rank in range(2):
            mlp = load_model(cfg, path, "cpu", TpGroup(rank, 2)).model.layers[1].mlp
            experts.append(mlp.experts)
            parts.append(mlp.experts(x, ids, weights))
    gate_up = full["model.layers.1.mlp.experts.gate_up_proj"]  # [E, H, 2I]
    half = gate_up.shape[2] // 2
    for rank, e in enumerate(experts):
        assert torch.equal(e.gate_up_proj[3].T, gate_up[3, :, rank * half:(rank + 1) * half])
    torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-5, rtol=0)


def _f64_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The spec, element by element in float64: E2M1 code (sign, exponent 2 bits with bias
    1, mantissa 1 bit) times 2 ** (scale - 127); low nibble first."""
    def e2m1(code: int) -> float:
        sign, exp, man = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
        return sign * (man * 0.5 if exp == 0 else (1 + man * 0.5) * 2.0 ** (exp - 1))

    flat_b, flat_s = blocks.reshape(-1, 16).tolist(), scales.reshape(-1).tolist()
    out = [[e2m1(c) * 2.0 ** (s - 127) for byte in row for c in (byte & 15, byte >> 4)]
           for row, s in zip(flat_b, flat_s)]
    return torch.tensor(out, dtype=torch.float64).reshape(*scales.shape[:-1], -1)


def test_mxfp4_matches_the_spec_and_transformers():
    w = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    w[0, 0, :32] *= 1e-3  # blocks of very different scales
    w[1, 2, 32:64] = 0.0  # an all-zero block
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (3, 5, 3, 16) and scales.shape == (3, 5, 3)
    assert blocks.dtype == scales.dtype == torch.uint8
    ref = _f64_dequantize(blocks, scales)
    got = mxfp4.dequantize(blocks, scales)
    assert torch.equal(got.double(), ref)
    # |w| / scale < 8 in every block: rounding loses at most one scale (half the 4 -> 6
    # gap), the clamp of (6, 8) to 6 at most two
    scale = torch.pow(2.0, scales.double() - 127).repeat_interleave(32, -1)
    assert ((ref - w).abs() <= 2 * scale).all()
    assert ((ref - w).abs() <= scale)[w.abs() <= 6 * scale].all()
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.bfloat16).double(), ref)
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError:  # the spec check above stands alone
        return
    hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 96, 5]
    assert torch.equal(hf.transpose(1, 2).double(), ref)


def _mxfp4_checkpoint(src, dst):
    """The tiny gpt-oss checkpoint with its experts packed to MXFP4 (our [E, out, in]
    layout, as the released checkpoints), and the float checkpoint of what they hold."""
    shutil.copytree(src, dst / "mx")
    shutil.copytree(src, dst / "deq")
    tensors = load_file(str(src / "model.safetensors"))
    packed, dense = {}, dict(tensors)
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4.quantize(t.transpose(1, 2))
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            dense[name] = mxfp4.dequantize(blocks, scales).transpose(1, 2).contiguous()
        else:
            packed[name] = t
    save_file(packed, str(dst / "mx" / "model.safetensors"))
    save_file(dense, str(dst / "deq" / "model.safetensors"))
    cfg = json.loads((dst / "mx" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (dst / "mx" / "config.json").write_text(json.dumps(cfg))
    return dst / "mx", dst / "deq"


def test_mxfp4_checkpoint_serves_as_its_dequantized_weights(family_dirs, make_engine,
                                                            tmp_path, monkeypatch):
    """The float load (load_model) holds the dequantized experts; the engine keeps them
    packed (executor/quant/loader.py), its products here through the packed weights
    dequantized tile by tile (exact: the kernel's int8 rounding of x is checked in
    tests/runtime/test_gpt_oss_packed_experts.py): transformers' tokens."""
    monkeypatch.setattr(quant_linear, "dequant_rows", lambda kind: 0)
    mx, deq = _mxfp4_checkpoint(family_dirs["gpt_oss"], tmp_path)
    cfg = ModelConfig.from_hf(mx)
    ours = load_model(cfg, mx, "cpu").model.layers[2].mlp.experts
    dense = load_file(str(deq / "model.safetensors"))
    assert torch.equal(ours.gate_up_proj, dense["model.layers.2.mlp.experts.gate_up_proj"]
                       .transpose(1, 2))
    for rank in range(2):  # a rank's slice of the blocks: I = 64 splits into whole blocks
        part = load_model(cfg, mx, "cpu", TpGroup(rank, 2)).model.layers[2].mlp.experts
        assert torch.equal(part.down_proj, ours.down_proj[:, :, rank * 32:(rank + 1) * 32])
    ids = AutoTokenizer.from_pretrained(mx).encode(TEXT, add_special_tokens=False)
    prompts = [ids, (ids * 2)[:60]]
    hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    eng = make_engine(model_path=str(mx), chunked_prefill_size=16)
    got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert got == want


def test_other_quantization_is_refused_by_name(family_dirs, tmp_path):
    other = tmp_path / "fp8"
    shutil.copytree(family_dirs["gpt_oss"], other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8"}
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config.quant_method 'fp8'"):
        load_model(ModelConfig.from_hf(other), other, "cpu")


def test_mxfp4_tp_split_is_checked_at_start(family_dirs, tmp_path):
    """A tp size that would cut the experts' MXFP4 blocks is refused by check_tp_split,
    naming the block, before any weight is read (I = 64: tp 2 reads whole blocks, 4 not)."""
    mx = tmp_path / "mx"
    shutil.copytree(family_dirs["gpt_oss"], mx)
    cfg = json.loads((mx / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (mx / "config.json").write_text(json.dumps(cfg))
    check_tp_split(ModelConfig.from_hf(mx), 2)
    with pytest.raises(ValueError, match="MXFP4 block of 32"):
        check_tp_split(ModelConfig.from_hf(mx), 4)
    check_tp_split(ModelConfig.from_hf(family_dirs["gpt_oss"]), 4)  # bf16: any whole split


def test_switching_sinks_off_changes_the_tokens(family_dirs, make_engine):
    """The same engine setup with every layer's sinks removed after loading: its tokens
    differ from transformers' (which the sinks-on engine matches: test_families.py)."""
    path = family_dirs["gpt_oss"]
    ids = AutoTokenizer.from_pretrained(path).encode(TEXT, add_special_tokens=False)
    prompts = [ids, (ids * 2)[:60]]
    runs = []
    for sinks in (True, False):
        eng = make_engine(model_path=str(path))
        if not sinks:
            for layer in eng.scheduler.model_runner.model.model.layers:
                layer.self_attn.attn.sinks = None
        runs.append([o["output_ids"]
                     for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)])
        eng.shutdown()
    assert runs[0] != runs[1]


def test_weight_update_checks_the_format(family_dirs, tmp_path):
    """/update_weights_from_disk: the same gpt-oss checkpoint passes (its options compare
    equal); an MXFP4 one in place of the bf16 one is refused by name."""
    src = family_dirs["gpt_oss"]
    runner = ModelRunner(ServerArgs(model_path=str(src), max_total_tokens=256, device="cpu"),
                         str(src))
    assert runner.check_weights(str(src))
    mx, _ = _mxfp4_checkpoint(src, tmp_path)
    with pytest.raises(ValueError, match="GptOssMxfp4MoeBlock"):
        runner.check_weights(str(mx))
