"""The engine's Llama/Qwen2 against transformers on the tiny models, through the paged KV
pool: one-shot extend, extend over a cached prefix, decode steps, batches of two."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixlm.radix_cache.kv_pool import KVPool
from radixlm.runtime import model_config
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.executor.models import get_model_class, load_model
from radixlm.runtime.executor.models.llama import LlamaForCausalLM
from radixlm.runtime.executor.models.qwen2 import Qwen2ForCausalLM
from radixlm.runtime.model_config import ModelConfig

ATOL = 1e-4
TEXTS = [
    "The train from Zurich to Milan crosses the Alps through long tunnels and short "
    "bright valleys. Buy a seat on the right side for the lake views.",
    '{"city": "Oslo", "population": 709037} and then some more words',
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def _token_ids(model_dir: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(t) for t in TEXTS]


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


class Seqs:
    """Hand-built batches: every sequence keeps its token ids and KV slots; slots are
    handed out from a counter (no reuse), so any slot mix-up shows in the logits."""

    def __init__(self, config: ModelConfig, size: int = 1024) -> None:
        self.pool = KVPool(
            size, config.num_layers, config.num_key_value_heads, config.head_dim, torch.float32
        )
        self.next_slot = 0
        self.slots: dict[int, list[int]] = {}

    def _alloc(self, n: int) -> list[int]:
        self.next_slot += n
        return list(range(self.next_slot - n, self.next_slot))

    def batch(self, mode: ForwardMode, new: dict[int, list[int]]) -> ForwardBatch:
        """One forward over ``new[seq] = token ids`` appended to each sequence."""
        ids, pos, loc, kv, qo_ptr, kv_ptr = [], [], [], [], [0], [0]
        for seq, toks in new.items():
            prefix = self.slots.setdefault(seq, [])
            slots = self._alloc(len(toks))
            ids += toks
            pos += range(len(prefix), len(prefix) + len(toks))
            loc += slots
            # decode: the whole KV, new token included; extend: only the cached prefix
            seen = prefix + slots if mode.is_decode else prefix
            kv += seen
            qo_ptr.append(qo_ptr[-1] + len(toks))
            kv_ptr.append(kv_ptr[-1] + len(seen))
            prefix += slots

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64)

        return ForwardBatch(
            mode=mode,
            input_ids=t(ids),
            positions=t(pos),
            out_cache_loc=t(loc),
            qo_indptr=t(qo_ptr),
            kv_indptr=t(kv_ptr),
            kv_indices=t(kv),
            logits_indices=torch.arange(len(ids)),
            kv_pool=self.pool,
        )


def test_registry():
    assert get_model_class(["LlamaForCausalLM"]) is LlamaForCausalLM
    assert issubclass(get_model_class(["MistralForCausalLM"]), LlamaForCausalLM)
    assert get_model_class(["Qwen2ForCausalLM"]) is Qwen2ForCausalLM
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        get_model_class(["GPT2LMHeadModel"])


def test_single_extend_matches_transformers(model_dir):
    config = ModelConfig.from_hf(model_dir)
    model = load_model(config, model_dir, "cpu")
    ids = _token_ids(model_dir)[0]
    seqs = Seqs(config)
    logits = model(seqs.batch(ForwardMode.EXTEND, {0: ids}))
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), config.vocab_size)
    torch.testing.assert_close(logits, hf_logits(model_dir, ids), atol=ATOL, rtol=0)


def test_prefix_extend_then_decode_matches_transformers(model_dir):
    """Two sequences batched: extend a prefix, extend the rest over the cached prefix,
    then decode one token at a time; every row equals transformers' full-sequence logits."""
    config = ModelConfig.from_hf(model_dir)
    model = load_model(config, model_dir, "cpu")
    full = _token_ids(model_dir)
    ref = [hf_logits(model_dir, ids) for ids in full]
    cuts = [(7, 20), (5, 9)]  # per sequence: prefix end, second extend end; then decode
    seqs = Seqs(config)
    steps = [
        (ForwardMode.EXTEND, [(0, c[0]) for c in cuts]),
        (ForwardMode.EXTEND, [(c[0], c[1]) for c in cuts]),
    ]
    for i in range(6):
        steps.append((ForwardMode.DECODE, [(c[1] + i, c[1] + i + 1) for c in cuts]))
    for mode, ranges in steps:
        logits = model(seqs.batch(mode, {s: full[s][a:b] for s, (a, b) in enumerate(ranges)}))
        expected = torch.cat([ref[s][a:b] for s, (a, b) in enumerate(ranges)])
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_logits_indices_select_rows(tiny_llama_dir):
    config = ModelConfig.from_hf(tiny_llama_dir)
    model = load_model(config, tiny_llama_dir, "cpu")
    ids = _token_ids(tiny_llama_dir)[0][:12]
    fb = Seqs(config).batch(ForwardMode.EXTEND, {0: ids})
    fb.logits_indices = torch.tensor([11, 3])
    torch.testing.assert_close(
        model(fb), hf_logits(tiny_llama_dir, ids)[[11, 3]], atol=ATOL, rtol=0
    )


def _copy_without_weights(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    return dst


def test_sharded_checkpoint_round_trip(tiny_qwen2_dir, tmp_path):
    tensors = load_file(tiny_qwen2_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    out = _copy_without_weights(tiny_qwen2_dir, tmp_path / "sharded")
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, out / file)
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    config = ModelConfig.from_hf(tiny_qwen2_dir)
    single = load_model(config, tiny_qwen2_dir, "cpu")
    sharded = load_model(ModelConfig.from_hf(out), out, "cpu")
    for name, p in single.state_dict().items():
        assert torch.equal(p, sharded.state_dict()[name]), name


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ],
)
def test_rope_scaling_matches_transformers(tiny_llama_dir, tmp_path, rope_scaling):
    d = tmp_path / "scaled"
    shutil.copytree(tiny_llama_dir, d)
    hf = json.loads((d / "config.json").read_text())
    hf["rope_scaling"] = rope_scaling
    (d / "config.json").write_text(json.dumps(hf))
    config = ModelConfig.from_hf(d)
    assert config.rope_scaling is not None
    ids = (_token_ids(d)[0] * 4)[:150]  # long enough to reach the low-frequency band
    logits = load_model(config, d, "cpu")(Seqs(config).batch(ForwardMode.EXTEND, {0: ids}))
    torch.testing.assert_close(logits, hf_logits(d, ids), atol=ATOL, rtol=0)
    unscaled = hf_logits(tiny_llama_dir, ids)
    assert not torch.allclose(logits, unscaled, atol=1e-2)  # the scaling did something


def test_llama_attention_and_mlp_bias_match_transformers(tiny_llama_dir, tmp_path):
    """Llama's `attention_bias` puts a bias on q/k/v *and* o; `mlp_bias` on the MLP."""
    tensors = load_file(tiny_llama_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name in list(tensors):
        if name.endswith("_proj.weight"):
            out_features = tensors[name].shape[0]
            bias = torch.randn(out_features, generator=gen) * 0.1
            tensors[name.removesuffix("weight") + "bias"] = bias
    d = _copy_without_weights(tiny_llama_dir, tmp_path / "biased")
    save_file(tensors, d / "model.safetensors")
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**hf, "attention_bias": True, "mlp_bias": True}))
    config = ModelConfig.from_hf(d)
    ids = _token_ids(d)[1]
    logits = load_model(config, d, "cpu")(Seqs(config).batch(ForwardMode.EXTEND, {0: ids}))
    torch.testing.assert_close(logits, hf_logits(d, ids), atol=ATOL, rtol=0)


def test_missing_tensor_raises(tiny_llama_dir, tmp_path):
    tensors = load_file(tiny_llama_dir / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    tensors["model.layers.9.extra.weight"] = torch.zeros(2)
    d = _copy_without_weights(tiny_llama_dir, tmp_path / "broken")
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"missing tensors \[model.layers.2.mlp.up_proj.weight\]"
        r".*unexpected tensors \[model.layers.9.extra.weight\]",
    ):
        load_model(ModelConfig.from_hf(d), d, "cpu")


def test_load_casts_to_requested_dtype_and_keeps_rope_float32(tiny_llama_dir):
    config = ModelConfig.from_hf(tiny_llama_dir, dtype="bfloat16")
    model = load_model(config, tiny_llama_dir, "cpu")
    assert model.lm_head.weight.dtype == torch.bfloat16
    rope = model.model.rotary_emb["full_attention"]
    assert rope.cos_sin_cache.dtype == torch.float32
    model.half()
    assert rope.cos_sin_cache.dtype == torch.float32


# --- ModelConfig normalisation ---


def _config_from(tmp_path: Path, generation: dict | None = None, **overrides) -> ModelConfig:
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 100,
        "max_position_embeddings": 512,
        "eos_token_id": 2,
    }
    hf.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return ModelConfig.from_hf(tmp_path)


def test_config_defaults(tmp_path):
    c = _config_from(tmp_path)
    assert (c.num_key_value_heads, c.head_dim, c.num_kv_groups) == (4, 16, 1)
    assert (c.rope_theta, c.rope_scaling, c.context_length) == (10000.0, None, 512)
    assert c.eos_token_ids == (2,) and not c.qkv_bias and not c.tie_word_embeddings
    assert c.resolve_dtype("cpu") == torch.float32


def test_config_eos_list_merges_generation_config(tmp_path):
    c = _config_from(tmp_path, generation={"eos_token_id": [7, 2]}, eos_token_id=[2, 3])
    assert c.eos_token_ids == (2, 3, 7)


def test_config_qwen2_always_has_qkv_bias(tmp_path):
    c = _config_from(
        tmp_path,
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        use_sliding_window=False,
        sliding_window=64,
    )
    assert (
        c.qkv_bias and not c.attention_bias and c.sliding_window is None and c.context_length == 512
    )


def test_config_rope_parameters_transformers5(tmp_path):
    c = _config_from(tmp_path, rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    assert c.rope_theta == 5e5 and c.rope_scaling is None


def test_config_unsupported_rope_type_is_clear(tmp_path):
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic'"):
        _config_from(tmp_path, rope_scaling={"type": "dynamic", "factor": 4.0})


def test_config_context_length_and_sliding_window(tmp_path):
    # a real sliding window: the context is the model's, not capped at the window
    c = _config_from(tmp_path, sliding_window=256)
    assert c.context_length == 512 and c.layer_types == ("sliding_attention",) * 2
    assert c.layer_window(0) == c.layer_window(1) == 256
    assert ModelConfig.from_hf(tmp_path, context_length=300).context_length == 300
    c = _config_from(tmp_path, sliding_window=64, model_type="gemma2")  # alternating
    assert (c.layer_window(0), c.layer_window(1)) == (64, None)
    with pytest.raises(ValueError, match="layer_types"):
        _config_from(tmp_path, sliding_window=64, layer_types=["sliding_attention"])


def test_config_dtype(tmp_path, monkeypatch):
    _config_from(tmp_path, torch_dtype="bfloat16")
    c = ModelConfig.from_hf(tmp_path)
    monkeypatch.setattr(model_config, "cpu_has_bf16", lambda: True)
    assert c.resolve_dtype("cpu") == torch.bfloat16  # served in bf16 where the CPU has it
    monkeypatch.setattr(model_config, "cpu_has_bf16", lambda: False)
    assert c.resolve_dtype("cpu") == torch.float32
    assert c.resolve_dtype("cuda") == torch.bfloat16
    _config_from(tmp_path, torch_dtype="float16")  # only bf16 checkpoints: fp16 -> fp32 on CPU
    monkeypatch.setattr(model_config, "cpu_has_bf16", lambda: True)
    assert ModelConfig.from_hf(tmp_path).resolve_dtype("cpu") == torch.float32
    _config_from(tmp_path, torch_dtype="bfloat16")
    assert ModelConfig.from_hf(tmp_path, dtype="float16").resolve_dtype("cpu") == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_hf(tmp_path, dtype="int8")
