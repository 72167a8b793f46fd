"""A model directory radixlm cannot serve is refused with one error naming why, before any
config field is parsed or any process starts: an architecture it does not serve (named,
with the served ones listed), no config.json, no weights, no tokenizer files; from
``ModelConfig.from_hf``, ``Engine(...)`` and ``radixlm serve`` (one line, exit 1)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from radixlm import Engine
from radixlm.runtime.entrypoints.server_process import free_port
from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.model_dir import ModelDirError

# transformers model_type -> the architecture its checkpoints name: classic decoders whose
# configs lack our fields, hybrid attention / state-space models, and MLA
UNSERVED = [("gpt2", "GPT2LMHeadModel"), ("gptj", "GPTJForCausalLM"),
            ("bloom", "BloomForCausalLM"), ("mpt", "MptForCausalLM"),
            ("gpt_bigcode", "GPTBigCodeForCausalLM"),
            ("deepseek_v2", "DeepseekV2ForCausalLM"),
            ("deepseek_v3", "DeepseekV3ForCausalLM")]


def _write_config(path: Path, model_type: str, **fields) -> Path:
    """config.json only, as transformers' own config class writes it."""
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except (KeyError, ValueError):
        pytest.skip(f"the installed transformers has no {model_type}")
    config.save_pretrained(path)
    return path


def _refusal(load, path: Path) -> str:
    with pytest.raises(ModelDirError) as e:
        load(path)
    return str(e.value)


@pytest.mark.parametrize(("model_type", "arch"), UNSERVED)
def test_unserved_architecture_is_refused_by_name(tmp_path, model_type, arch):
    path = _write_config(tmp_path, model_type, architectures=[arch])
    for load in (ModelConfig.from_hf, lambda p: Engine(model_path=str(p))):
        msg = _refusal(load, path)
        assert f"radixlm does not serve {arch}" in msg, msg
        assert "; it serves LlamaForCausalLM" in msg, msg
        assert str(path / "config.json") in msg and "Qwen3MoeForCausalLM" in msg


def test_config_without_architectures_is_read_by_its_model_type(tmp_path):
    """A config saved on its own (no ``architectures``) of a served model_type is that
    model_type's causal LM, as transformers' AutoModelForCausalLM maps it; of another
    model_type it is refused naming the model_type."""
    served = _write_config(tmp_path / "llama", "llama")
    assert ModelConfig.from_hf(served).architectures == ("LlamaForCausalLM",)
    gemma3 = _write_config(tmp_path / "gemma3", "gemma3_text")
    assert ModelConfig.from_hf(gemma3).architectures == ("Gemma3ForCausalLM",)
    msg = _refusal(ModelConfig.from_hf, _write_config(tmp_path / "gpt2", "gpt2"))
    assert "a config.json without architectures (model_type 'gpt2')" in msg


def test_served_config_lacking_a_field_names_it(tmp_path, tiny_llama_dir):
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    text = (tmp_path / "config.json").read_text().replace('"num_attention_heads"', '"x"')
    (tmp_path / "config.json").write_text(text)
    assert "lacks 'num_attention_heads', which LlamaForCausalLM needs" in _refusal(
        ModelConfig.from_hf, tmp_path)


def _incomplete(tiny: Path, root: Path, missing: str) -> Path:
    """The tiny Llama checkpoint without ``missing``: config.json, the weights or every
    tokenizer file."""
    out = root / f"no-{missing}"
    shutil.copytree(tiny, out)
    drop = {"config": ["config.json"], "weights": ["model.safetensors"],
            "tokenizer": ["tokenizer.json", "tokenizer_config.json"]}[missing]
    for name in drop:
        (out / name).unlink()
    return out


INCOMPLETE = {"config": "no config.json in model directory",
              "weights": "no *.safetensors weights in",
              "tokenizer": "no tokenizer files in"}


@pytest.mark.parametrize("missing", list(INCOMPLETE))
def test_incomplete_directory_names_the_missing_file(tmp_path, tiny_llama_dir, missing):
    path = _incomplete(tiny_llama_dir, tmp_path, missing)
    assert INCOMPLETE[missing] in _refusal(lambda p: Engine(model_path=str(p)), path)


@pytest.mark.parametrize("missing", ["config", "tokenizer", "gpt2"])
def test_serve_refuses_in_one_line(tmp_path, tiny_llama_dir, missing):
    """``radixlm serve`` exits 1 with the one message on stderr: no traceback, from no
    process (it stops before its children start)."""
    if missing == "gpt2":
        path, want = _write_config(tmp_path, "gpt2", architectures=["GPT2LMHeadModel"]), \
            "radixlm does not serve GPT2LMHeadModel"
    else:
        path, want = _incomplete(tiny_llama_dir, tmp_path, missing), INCOMPLETE[missing]
    proc = subprocess.run([sys.executable, "-m", "radixlm.cli", "serve", "--model-path",
                           str(path), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "You need to have" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("radixlm serve: ") and want in proc.stderr, proc.stderr
