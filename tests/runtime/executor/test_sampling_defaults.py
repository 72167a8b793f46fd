"""``--sampling-defaults model`` (SGLang's flag, and vLLM's behaviour): a request's unset
temperature / top_p / top_k / min_p / repetition_penalty take the checkpoint's
generation_config.json values; ``openai`` keeps the API's defaults."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

import radixlm
from radixlm.runtime.executor.sampling_params import SamplingParams, sampling_defaults
from radixlm.runtime.model_config import model_sampling_defaults
from radixlm.tiny_model import default_tiny_model_path


def _with_generation_config(tmp_path, **fields):
    model = tmp_path / "model"
    shutil.copytree(default_tiny_model_path(), model)
    path = model / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, **fields}))
    return model


def test_reads_the_sampling_keys_only(tmp_path):
    model = _with_generation_config(tmp_path, temperature=0.7, top_p=0.8, top_k=0,
                                    repetition_penalty=1.05, do_sample=True, max_length=99)
    assert model_sampling_defaults(model) == {"temperature": 0.7, "top_p": 0.8, "top_k": -1,
                                              "repetition_penalty": 1.05}
    assert model_sampling_defaults(tmp_path) == {}  # no generation_config.json


def test_unset_fields_take_the_defaults():
    defaults = {"temperature": 0.7, "top_k": 20}
    sp = SamplingParams.with_defaults({"temperature": 0.0, "top_p": None}, defaults)
    assert (sp.temperature, sp.top_k, sp.top_p) == (0.0, 20, 1.0)
    assert SamplingParams.with_defaults(None, defaults).temperature == 0.7


def test_a_bad_value_fails_the_start_naming_it(tmp_path):
    model = _with_generation_config(tmp_path, temperature=-1)
    with pytest.raises(ValueError, match="temperature"):
        sampling_defaults(SimpleNamespace(sampling_defaults="model"), str(model))
    model.joinpath("generation_config.json").write_text(json.dumps({"top_p": "high"}))
    with pytest.raises(ValueError, match="top_p"):
        model_sampling_defaults(model)
    assert sampling_defaults(SimpleNamespace(sampling_defaults="openai"), str(model)) == {}


def test_engine_requests_follow_the_model(tmp_path):
    """temperature 0 in generation_config.json: a request without one is greedy (the same
    tokens as an explicit temperature 0, whatever the seed); with openai defaults it samples."""
    model = _with_generation_config(tmp_path, temperature=0.0)
    prompt = "The quick brown fox"
    eng = radixlm.Engine(model_path=str(model), random_seed=0, max_total_tokens=2048)
    try:
        greedy = eng.generate(prompt, {"max_new_tokens": 12, "temperature": 0.0,
                                       "ignore_eos": True})["output_ids"]
        for seed in (1, 2):
            out = eng.generate(prompt, {"max_new_tokens": 12, "sampling_seed": seed,
                                        "ignore_eos": True})["output_ids"]
            assert out == greedy
    finally:
        eng.shutdown()
    eng = radixlm.Engine(model_path=str(model), random_seed=0, max_total_tokens=2048,
                         sampling_defaults="openai")
    try:
        sampled = {tuple(eng.generate(prompt, {"max_new_tokens": 12, "sampling_seed": seed,
                                               "ignore_eos": True})["output_ids"])
                   for seed in (1, 2, 3)}
        assert len(sampled) > 1  # temperature 1: seeds disagree
    finally:
        eng.shutdown()
