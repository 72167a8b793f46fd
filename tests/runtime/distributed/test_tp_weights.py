"""Weights under tensor parallelism: each rank's slice of every checkpoint tensor, the
split refused when it does not divide, and a weight update applied on every rank."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from radixlm.runtime.distributed.layers import check_tp_split, qkv_shards
from radixlm.runtime.distributed.parallel_state import TpGroup
from radixlm.runtime.executor.models import load_model
from radixlm.runtime.model_config import ModelConfig

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("tp_size", [2, 4])
def test_each_rank_loads_its_slices(tiny_llama_dir, tp_size):
    """Built for rank r of a group (no process group needed to build and load), every
    parameter is its rows / columns of the checkpoint tensor; ranks together hold all."""
    cfg = ModelConfig.from_hf(tiny_llama_dir, dtype="float32")
    full = load_file(str(tiny_llama_dir / "model.safetensors"))
    layer = "model.layers.1"
    q, k = full[f"{layer}.self_attn.q_proj.weight"], full[f"{layer}.self_attn.k_proj.weight"]
    down = full[f"{layer}.mlp.down_proj.weight"]
    emb = full["model.embed_tokens.weight"]
    qs, ks, downs, embs = [], [], [], []
    for rank in range(tp_size):
        model = load_model(cfg, tiny_llama_dir, "cpu", TpGroup(rank, tp_size))
        attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
        q_rows = cfg.q_size // tp_size
        qs.append(attn.qkv_proj.weight[:q_rows])
        ks.append(attn.qkv_proj.weight[q_rows: q_rows + attn.kv_size])
        downs.append(mlp.down_proj.weight)
        embs.append(model.model.embed_tokens.weight[: model.model.embed_tokens.valid_rows])
    assert torch.equal(torch.cat(qs), q)
    assert torch.equal(torch.cat(downs, dim=1), down)
    assert torch.equal(torch.cat(embs), emb)
    # 2 KV heads: split at tp 2, each replicated on two ranks at tp 4
    assert torch.equal(torch.cat(ks[:: max(tp_size // 2, 1)]), k)


def test_kv_heads_replicated_on_consecutive_ranks(tiny_llama_dir):
    cfg = ModelConfig.from_hf(tiny_llama_dir)  # 4 heads, 2 KV heads of 32
    starts = [qkv_shards(cfg, TpGroup(r, 4))["k_proj"].start for r in range(4)]
    assert starts == [0, 0, 32, 32]


@pytest.mark.parametrize("heads,kv,inter,tp,named", [
    (4, 2, 256, 3, ["num_attention_heads (4)", "num_key_value_heads (2)",
                    "intermediate_size (256)"]),
    (8, 3, 256, 2, ["num_key_value_heads (3)"]),
    (6, 2, 256, 4, ["num_attention_heads (6)"]),
    (8, 8, 100, 8, ["intermediate_size (100)"]),
])
def test_uneven_split_names_the_sizes(tiny_llama_dir, heads, kv, inter, tp, named):
    cfg = dataclasses.replace(ModelConfig.from_hf(tiny_llama_dir), num_attention_heads=heads,
                              num_key_value_heads=kv, intermediate_size=inter)
    with pytest.raises(ValueError, match=f"tp_size {tp} cannot split") as e:
        check_tp_split(cfg, tp)
    for part in named:
        assert part in str(e.value)
    check_tp_split(cfg, 1)


@pytest.fixture(scope="module")
def perturbed_ckpt(tmp_path_factory, tiny_llama_dir):
    out = tmp_path_factory.mktemp("tp") / "perturbed"
    shutil.copytree(tiny_llama_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    for name, t in weights.items():
        if t.std() > 0:
            weights[name] = (t + torch.randn(t.shape, generator=gen) * t.std()).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _hf_greedy(path, ids: list[int], n: int) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def test_weight_update_reaches_every_rank(make_engine, tiny_llama_dir, perturbed_ckpt):
    eng = make_engine(model_path=str(tiny_llama_dir), tp_size=2, dtype="float32")
    ids = [11, 12, 13, 14, 15, 16]
    before = eng.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    assert before == _hf_greedy(tiny_llama_dir, ids, 8)
    ok, message, _ = eng.update_weights_from_disk(str(perturbed_ckpt))
    assert ok, message
    after = eng.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    assert after == _hf_greedy(perturbed_ckpt, ids, 8) != before
