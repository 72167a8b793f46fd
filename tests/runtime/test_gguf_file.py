"""GGUF files: hostile files refused by name (never a crash, a hang or an allocation beyond
the file's size), and the view directory of a file our writer made from a tiny checkpoint
reads back as that checkpoint's config and tokenizer (``runtime/gguf_file.py``)."""

from __future__ import annotations

import os
import stat
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from transformers import AutoTokenizer

from radixlm.runtime.executor.layers.moe import num_experts_of
from radixlm.runtime.executor.models.weights import SWAP_FIELDS
from radixlm.runtime.gguf_container import GGUFError
from radixlm.runtime.gguf_file import open_gguf, view_dir_for
from radixlm.runtime.model_config import ModelConfig
from radixlm.tiny_quant.gguf_writer import write_gguf

# --- a GGUF file written byte by byte (every field under the test's control) ---

U32, U64, STR, ARR = 4, 10, 8, 9


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: int, value) -> bytes:
    body = {U32: lambda v: struct.pack("<I", v), U64: lambda v: struct.pack("<Q", v),
            STR: _s}[vtype](value) if vtype != ARR else value
    return _s(key) + struct.pack("<I", vtype) + body


def _tensor(name: str, dims: list[int], ggml_type: int, offset: int) -> bytes:
    return (_s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<IQ", ggml_type, offset))


def raw_gguf(path: Path, kvs: list[bytes] | None = None, tensors: list[bytes] | None = None,
             data: bytes = b"\0" * 64, version: int = 3, counts: tuple[int, int] | None = None,
             magic: bytes = b"GGUF") -> Path:
    kvs = [_kv("general.architecture", STR, "llama")] if kvs is None else kvs
    tensors = [_tensor("token_embd.weight", [4, 4], 0, 0)] if tensors is None else tensors
    n_t, n_kv = counts if counts is not None else (len(tensors), len(kvs))
    head = magic + struct.pack("<IQQ", version, n_t, n_kv) + b"".join(kvs) + b"".join(tensors)
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + data)
    return path


def refused(path: Path, *words: str) -> str:
    """open_gguf(path) raises GGUFError naming each of ``words``, allocating < 4 MB."""
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError) as err:
            open_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(err.value)
    for word in words:
        assert word in message, message
    assert peak < 4 << 20, (peak, message)
    return message


# --- the container ---


def test_bad_magic_and_versions(tmp_path):
    refused(raw_gguf(tmp_path / "a", magic=b"GGML"), "not a GGUF file")
    refused(raw_gguf(tmp_path / "b", version=1), "version 1")
    refused(raw_gguf(tmp_path / "c", version=3 << 24), "big-endian")
    (tmp_path / "d").write_bytes(b"GGUF\3\0")
    refused(tmp_path / "d", "too short")


def test_huge_counts_refused_before_looping(tmp_path):
    refused(raw_gguf(tmp_path / "a", counts=(1, 1 << 62)), "metadata entries")
    refused(raw_gguf(tmp_path / "b", counts=(1 << 60, 1)), "tensors")
    # an array claiming 2^60 strings, a string claiming 2^62 bytes
    tokens = struct.pack("<IQ", STR, 1 << 60) + _s("a")
    refused(raw_gguf(tmp_path / "c", kvs=[_kv("tokenizer.ggml.tokens", ARR, tokens)]),
            "tokenizer.ggml.tokens")
    long = _s("general.name") + struct.pack("<IQ", STR, 1 << 62) + b"abc"
    refused(raw_gguf(tmp_path / "d", kvs=[long]), "general.name")
    nested = struct.pack("<IQ", ARR, 3) + struct.pack("<IQ", ARR, 1) * 3
    refused(raw_gguf(tmp_path / "e", kvs=[_kv("x.nested", ARR, nested)]), "x.nested")


def test_bad_values_name_the_key(tmp_path):
    refused(raw_gguf(tmp_path / "a", kvs=[_s("x.key") + struct.pack("<I", 77) + b"\0" * 8]),
            "x.key", "unknown value type 77")
    dup = [_kv("general.architecture", STR, "llama")] * 2
    refused(raw_gguf(tmp_path / "b", kvs=dup), "general.architecture", "twice")
    refused(raw_gguf(tmp_path / "c", kvs=[_kv("general.name", STR, b"\xff\xfe")]),
            "general.name", "UTF-8")
    refused(raw_gguf(tmp_path / "d", kvs=[_kv("general.alignment", U32, 24)]),
            "general.alignment")


def test_bad_tensors_name_the_tensor(tmp_path):
    t = _tensor
    cases = {  # case: (tensor infos, the tensor named, what is said)
        "unknown": ([t("blk.0.attn_q.weight", [32, 2], 99, 0)], "blk.0.attn_q.weight",
                    "unknown GGML type 99"),
        "i32": ([t("output.weight", [4], 26, 0)], "output.weight", "I32"),
        "dims": ([t("blk.0.attn_k.weight", [1 << 32] * 4, 0, 0)], "blk.0.attn_k.weight",
                 "more bytes"),
        "ndims": ([t("blk.0.attn_v.weight", [1] * 5, 0, 0)], "blk.0.attn_v.weight",
                  "5 dimensions"),
        "zero": ([t("blk.0.ffn_up.weight", [4, 0], 0, 0)], "blk.0.ffn_up.weight", "zero"),
        "past": ([t("output.weight", [8, 4], 0, 0)], "output.weight", "past the end"),
        "offset": ([t("output.weight", [4], 0, 1 << 40)], "output.weight", "past the end"),
        "align": ([t("output.weight", [4], 0, 8)], "output.weight", "alignment"),
        "blocks": ([t("output.weight", [33, 2], 8, 0)], "output.weight", "blocks of 32"),
        "overlap": ([t("output.weight", [8], 0, 0), t("token_embd.weight", [8], 0, 0)],
                    "token_embd.weight", "overlap"),
        "twice": ([t("output.weight", [4], 0, 0), t("output.weight", [4], 0, 32)],
                  "output.weight", "twice"),
    }
    for case, (tensors, name, words) in cases.items():
        refused(raw_gguf(tmp_path / case, tensors=tensors), repr(name), words)


def test_truncated_anywhere(tmp_path, tiny_llama_dir):
    good = write_gguf(tiny_llama_dir, tmp_path / "good.gguf", "Q8_0")
    data = good.read_bytes()
    with open_gguf(good) as model:
        header_end = min(info.offset for info in model.tensors.values())
    for cut in (3, 10, 23, 40, 300, 5000, header_end - 7, header_end + 100, len(data) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        message = refused(path)
        assert any(w in message for w in ("truncated", "past the end", "too short")), message


def test_random_header_corruption_is_a_gguf_error(tmp_path, tiny_llama_dir):
    """Bytes of the header flipped at random: the file opens (a value that still fits) or
    is a GGUFError, never another exception."""
    good = write_gguf(tiny_llama_dir, tmp_path / "good.gguf", "Q8_0")
    data = bytearray(good.read_bytes())
    with open_gguf(good) as model:
        header_end = min(info.offset for info in model.tensors.values())
    rng = np.random.default_rng(0)
    path = tmp_path / "bad.gguf"
    outcomes = {"opened": 0, "refused": 0}
    for _ in range(150):
        bad = bytearray(data)
        for at in rng.integers(0, header_end, size=rng.integers(1, 4)):
            bad[at] = rng.integers(0, 256)
        path.write_bytes(bad)
        try:
            open_gguf(path).close()
            outcomes["opened"] += 1
        except GGUFError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0, outcomes


# --- the model: metadata that disagrees with the tensors ---

H, LAYERS, HEADS, KV, FF, VOCAB = 64, 2, 4, 2, 128, 300


def model_gguf(path: Path, meta: dict | None = None, drop: tuple[str, ...] = (),
               shapes: dict[str, tuple[int, ...]] | None = None, arch: str = "llama",
               tokens: int = VOCAB, keys: dict[str, int] | None = None) -> Path:
    """A small F32 Llama-shaped GGUF through gguf's own writer, with ``meta`` overriding
    keys, ``drop`` leaving tensors out and ``shapes`` changing them."""
    w = GGUFWriter(path, arch)
    values = {"context_length": 256, "embedding_length": H, "block_count": LAYERS,
              "feed_forward_length": FF, "attention.head_count": HEADS,
              "attention.head_count_kv": KV, "attention.layer_norm_rms_epsilon": 1e-5,
              **(meta or {})}
    for key, value in values.items():
        full = f"{arch}.{key}"
        if isinstance(value, float):
            w.add_float32(full, value)
        elif value >= 1 << 32:
            w.add_uint64(full, value)
        else:
            w.add_uint32(full, value)
    for key, value in (keys or {}).items():
        w.add_uint32(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(tokens)])
    hd = H // HEADS
    want = {"token_embd.weight": (VOCAB, H), "output_norm.weight": (H,),
            "output.weight": (VOCAB, H)}
    for i in range(LAYERS):
        want.update({f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,),
                     f"blk.{i}.attn_q.weight": (HEADS * hd, H),
                     f"blk.{i}.attn_k.weight": (KV * hd, H),
                     f"blk.{i}.attn_v.weight": (KV * hd, H),
                     f"blk.{i}.attn_output.weight": (H, HEADS * hd),
                     f"blk.{i}.ffn_gate.weight": (FF, H), f"blk.{i}.ffn_up.weight": (FF, H),
                     f"blk.{i}.ffn_down.weight": (H, FF)})
    want.update(shapes or {})
    rng = np.random.default_rng(0)
    for name, shape in want.items():
        if name not in drop:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_consistent_model_opens(tmp_path):
    with open_gguf(model_gguf(tmp_path / "ok.gguf")) as model:
        assert model.architecture == "LlamaForCausalLM"
        cfg = model.hf_config()
        assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"],
                cfg["vocab_size"], cfg["tie_word_embeddings"]) == (H, LAYERS, KV, VOCAB, False)
        q = model.tensors["model.layers.1.self_attn.q_proj.weight"]
        assert q.shape == (H, H) and q.gguf_name == "blk.1.attn_q.weight"
        assert q.unpermute_heads == HEADS
        assert model.tensors["model.layers.1.self_attn.k_proj.weight"].unpermute_heads == KV


def test_metadata_disagreeing_with_tensors(tmp_path):
    cases = [
        ({"meta": {"embedding_length": 96}}, ["shape", "embedding_length 96"]),
        ({"meta": {"attention.head_count": 8}}, ["blk.0.attn_k.weight", "head_count 8"]),
        ({"meta": {"attention.key_length": 32}}, ["blk.0.attn_q.weight", "key_length 32"]),
        ({"meta": {"attention.head_count_kv": 4}}, ["blk.0.attn_k.weight", "head_count_kv 4"]),
        ({"meta": {"feed_forward_length": 64}}, ["blk.0.ffn_gate.weight"]),
        ({"meta": {"block_count": 1}}, ["blk.1.", "block_count is 1"]),
        ({"meta": {"block_count": 3}}, ["layer 2"]),
        ({"meta": {"block_count": 1 << 40}}, ["llama.block_count"]),
        ({"drop": ("blk.1.ffn_down.weight",), "meta": {}}, ["layer 1"]),
        ({"drop": ("token_embd.weight",)}, ["token_embd.weight"]),
        ({"tokens": VOCAB + 1}, ["tokenizer.ggml.tokens", "301"]),
        ({"shapes": {"blk.0.attn_norm.weight": (H + 1,)}}, ["blk.0.attn_norm.weight"]),
        ({"shapes": {"blk.0.attn_bogus.weight": (H,)}}, ["blk.0.attn_bogus.weight"]),
        ({"arch": "gpt2"}, ["'gpt2'", "general.architecture"]),
        ({"arch": "gpt-oss"}, ["gpt-oss.expert_count is missing"]),
    ]
    for i, (kwargs, words) in enumerate(cases):
        kwargs = {"drop": (), **kwargs}
        refused(model_gguf(tmp_path / f"m{i}.gguf", **kwargs), *words)


def test_bad_special_token_id(tmp_path):
    refused(model_gguf(tmp_path / "eos.gguf", keys={"tokenizer.ggml.eos_token_id": VOCAB}),
            "tokenizer.ggml.eos_token_id")
    with open_gguf(model_gguf(tmp_path / "ok.gguf",
                              keys={"tokenizer.ggml.eos_token_id": 7})) as model:
        assert model.hf_config()["eos_token_id"] == 7


def test_stop_ids_as_llama_cpp_collects_them(tmp_path):
    """EOS, the EOT id and, in a file that names none, the tokens spelled as an end of
    turn (llama.cpp's vocabulary finds them by spelling)."""
    path = model_gguf(tmp_path / "stop.gguf", keys={"tokenizer.ggml.eos_token_id": 5})
    with open_gguf(path) as model:
        assert model.stop_ids() == [5]
        model.metadata["tokenizer.ggml.tokens"][7] = "<|im_end|>"
        model.metadata["tokenizer.ggml.eot_token_id"] = 9
        assert model.stop_ids() == [5, 9, 7]


# --- the view directory: the HF checkpoint's config and tokenizer again ---

SAMPLES = ["Hello world, kato ri!", "  two leading spaces", '{"id": 3}\n\tx', "ünï cødé ✓",
           "<|im_start|>user\nhi<|im_end|>"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3",
                                  "phi3", "qwen3_moe", "mixtral"])
def test_view_reads_as_the_checkpoint(arch, tmp_path, family_dirs, tiny_llama_dir,
                                      tiny_qwen2_dir):
    hf_dir = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}.get(arch) or family_dirs[arch]
    path = write_gguf(hf_dir, tmp_path / f"{arch}.gguf", "Q8_0")
    view = tmp_path / "view"
    with open_gguf(path) as model:
        model.write_view(view)
    a, b = ModelConfig.from_hf(hf_dir), ModelConfig.from_hf(view)
    assert [f for f in SWAP_FIELDS if getattr(a, f) != getattr(b, f)] == [], \
        [(f, getattr(a, f), getattr(b, f)) for f in SWAP_FIELDS if getattr(a, f) != getattr(b, f)]
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "rope_local_base_freq", "num_experts", "moe_intermediate_size",
                "norm_topk_prob", "mlp_only_layers", "num_experts_per_tok"):
        if key in a.hf_config:
            assert b.hf_config.get(key) == a.hf_config[key], key
    assert num_experts_of(b.hf_config) == num_experts_of(a.hf_config)
    quant = b.hf_config["quantization_config"]
    assert quant == {"quant_method": "gguf", "gguf_file": str(path.resolve())}
    ta, tb = AutoTokenizer.from_pretrained(hf_dir), AutoTokenizer.from_pretrained(view)
    for text in SAMPLES:
        assert ta(text)["input_ids"] == tb(text)["input_ids"], text
        assert tb.decode(tb(text)["input_ids"]) == ta.decode(ta(text)["input_ids"])
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    assert ta.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tb.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (ta.eos_token, ta.bos_token) == (tb.eos_token, tb.bos_token)


def test_llama3_rope_scaling_round_trips(tmp_path, tiny_llama_dir):
    import json
    import shutil

    hf_dir = tmp_path / "llama3"
    shutil.copytree(tiny_llama_dir, hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["rope_theta"] = 500000.0
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with open_gguf(write_gguf(hf_dir, tmp_path / "l3.gguf", "F16")) as model:
        assert "rope_freqs.weight" in model.raw
        got = model.hf_config()["rope_scaling"]
    want = cfg["rope_scaling"]
    assert got["rope_type"] == "llama3" and got["original_max_position_embeddings"] == 8192
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        assert got[key] == pytest.approx(want[key], rel=1e-3), key


def test_view_dir_is_cached_private_and_atomic(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tiny_llama_dir, tmp_path / "m.gguf", "Q8_0")
    view = view_dir_for(path)
    assert view.parent == tmp_path / "cache" / "gguf" and (view / "tokenizer.json").is_file()
    assert stat.S_IMODE(view.stat().st_mode) == 0o700
    mtime = (view / "config.json").stat().st_mtime_ns
    assert view_dir_for(path) == view and (view / "config.json").stat().st_mtime_ns == mtime
    assert [p.name for p in view.parent.iterdir()] == [view.name]  # no temporary left
    os.utime(path, ns=(1, 1))  # another file at the same path: another view
    assert view_dir_for(path) != view
