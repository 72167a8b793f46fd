"""The built-in tiny model: deterministic files, a standard HF layout, decisive logits."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixlm import cli
from radixlm.tiny_model import (
    CORPUS_PATH,
    default_tiny_model_path,
    make_tiny_model,
)

logger = logging.getLogger(__name__)

FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
)
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    '{"name": "',
    "Water boils at",
    "Hello",
    "Ticket #48213\nSubject:",
    "1 + 1 =",
    "Bonjour, ça va?",
    "The train from",
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request):
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_builds_are_byte_identical(tmp_path, arch):
    a = make_tiny_model(tmp_path / "a", arch=arch)
    assert cli.main(["make-tiny-model", str(tmp_path / "b"), "--arch", arch]) == 0
    for name in FILES:
        assert (a / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    c = make_tiny_model(tmp_path / "c", arch=arch, seed=1)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_default_path_uses_cache_dir_and_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    path = default_tiny_model_path("llama")
    assert path == tmp_path / "tiny-llama-v1" and (path / "model.safetensors").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert default_tiny_model_path("llama") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-llama-v1"]  # no temp dirs left


def test_config_shapes(tiny_llama_dir, tiny_qwen2_dir):
    llama = json.loads((tiny_llama_dir / "config.json").read_text())
    qwen2 = json.loads((tiny_qwen2_dir / "config.json").read_text())
    assert llama["architectures"] == ["LlamaForCausalLM"] and not llama["tie_word_embeddings"]
    assert qwen2["architectures"] == ["Qwen2ForCausalLM"] and qwen2["tie_word_embeddings"]
    for c in (llama, qwen2):
        assert (
            c["hidden_size"],
            c["num_hidden_layers"],
            c["num_attention_heads"],
            c["num_key_value_heads"],
            c["head_dim"],
            c["intermediate_size"],
        ) == (128, 4, 4, 2, 32, 256)
        assert c["max_position_embeddings"] == 4096 and c["rope_theta"] == 10000.0


def test_tokenizer(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == json.loads((model_dir / "config.json").read_text())["vocab_size"]
    assert 1500 <= len(tok) <= 2000
    assert tok.eos_token == tok.pad_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok.model_max_length == 4096
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tok.encode(special)) == 1
    for s in [
        "Hello, world!",
        "  two  spaces\tand a tab\n",
        "Café, naïve, Zürich — 日本語 🙂",
        '{"a": [1, 2.5, null]}',
        "x = {'k': v} ;; ¿qué?",
    ]:
        assert tok.decode(tok.encode(s)) == s
    assert len(tok.encode("The capital of France is Paris.")) < 12  # merges were learned


def test_chat_template(tiny_llama_dir):
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


def test_logits_are_decisive(model_dir):
    """Greedy choices never hinge on float noise: top-1 vs top-2 logit gaps are large."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    text = CORPUS_PATH.read_text(encoding="utf-8")
    ids = tok.encode(text[2000:4000] + text[20000:21500])[:400]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    top = logits.topk(2, dim=-1).values
    gap = top[:, 0] - top[:, 1]
    logger.info(
        "%s: top-1 margin median %.3f min %.4f p10 %.3f over %d positions",
        model_dir.name,
        gap.median(),
        gap.min(),
        gap.quantile(0.1),
        len(ids),
    )
    assert gap.median() > 0.7
    assert gap.min() > 1e-3
    assert (logits.argmax(-1) == torch.tensor(ids)).float().mean() < 0.1  # not an echo


def test_greedy_does_not_stop_at_once(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stops = {tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    chats = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in PROMPTS[:5]
    ]
    batch = tok(PROMPTS + chats, return_tensors="pt", padding=True)
    out = model.generate(
        **batch, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
    )[:, batch.input_ids.shape[1] :].tolist()
    stopped_early = sum(bool(stops & set(row)) for row in out)
    assert stopped_early <= len(out) // 4
    assert min(len(set(row)) for row in out) >= 8  # not stuck repeating one token


def test_cli_sizes_override_the_preset(tmp_path):
    sizes = ["--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--num-kv-heads",
             "2", "--head-dim", "16", "--intermediate-size", "96"]
    assert cli.main(["make-tiny-model", str(tmp_path / "m"), "--preset", "tiny", *sizes]) == 0
    c = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"],
            c["num_key_value_heads"], c["head_dim"], c["intermediate_size"]) == (2, 64, 4, 2,
                                                                                16, 96)
    assert c["vocab_size"] == json.loads(
        (default_tiny_model_path() / "config.json").read_text())["vocab_size"]  # the preset's
    # a shape that cannot be built, and sizes for a family written by transformers: errors
    with pytest.raises(SystemExit):
        cli.main(["make-tiny-model", str(tmp_path / "x"), "--num-heads", "3"])
    with pytest.raises(SystemExit):
        cli.main(["make-tiny-model", str(tmp_path / "y"), "--arch", "olmo2", "--preset", "tiny"])
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
