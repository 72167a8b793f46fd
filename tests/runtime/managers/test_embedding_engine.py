"""Embeddings through the scheduler (``Engine(is_embedding=True).encode``) against
transformers: last-token, mean and cls pooling, batched prompts of different lengths,
chunked prefill and radix-cache hits; and the pooling a checkpoint names."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModel

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor.pooler import PoolingConfig
from tests.runtime.embedding_oracle import (
    TOLERANCE,
    embed,
    max_error,
    pooled_checkpoint,
    token_ids,
)

TEXTS = ["The capital of France is Paris.", "hi",
         "Once upon a time, a fox and a crow argued about cheese for a long while."]
ENGINE = dict(is_embedding=True, dtype="float32", chunked_prefill_size=4,
              max_total_tokens=2048)


@pytest.fixture(scope="module")
def last_engine(make_module_engine, tiny_qwen2_dir):
    return make_module_engine(model_path=str(tiny_qwen2_dir), **ENGINE)


def _check(model_dir, results, texts, method="last", normalize=True) -> None:
    for res, text in zip(results, texts):
        ids = token_ids(model_dir, text)
        assert res["meta_info"]["prompt_tokens"] == len(ids)
        assert res["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        err = max_error(res["embedding"], embed(model_dir, ids, method, normalize))
        assert err < TOLERANCE, (text, method, err)


def test_last_token_batched_chunked_and_cached(last_engine, tiny_qwen2_dir):
    results = last_engine.encode(TEXTS)  # one batch, chunks of 4 tokens
    _check(tiny_qwen2_dir, results, TEXTS)
    again = last_engine.encode(TEXTS[2])  # the whole prompt but its last token is cached
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
    _check(tiny_qwen2_dir, [again], TEXTS[2:])
    ids = token_ids(tiny_qwen2_dir, TEXTS[0])
    by_ids = last_engine.encode(input_ids=[ids, ids[:3]])
    assert max_error(by_ids[0]["embedding"], embed(tiny_qwen2_dir, ids)) < TOLERANCE
    assert max_error(by_ids[1]["embedding"], embed(tiny_qwen2_dir, ids[:3])) < TOLERANCE
    assert last_engine.get_server_info()["pooling"] == {"method": "last", "normalize": True}


@pytest.mark.parametrize("method,normalize", [("mean", False), ("cls", True)])
def test_pooling_over_every_token_never_uses_the_cache(make_engine, tiny_qwen2_dir, tmp_path,
                                                       method, normalize):
    ckpt = pooled_checkpoint(tiny_qwen2_dir, tmp_path / method, method, normalize)
    eng = make_engine(model_path=str(ckpt), **ENGINE)
    _check(ckpt, eng.encode(TEXTS), TEXTS, method, normalize)
    again = eng.encode(TEXTS[2])  # its K/V is cached, its hidden states are not
    assert again["meta_info"]["cached_tokens"] == 0
    _check(ckpt, [again], TEXTS[2:], method, normalize)


def test_generation_and_unsupported_options_refused(last_engine, make_engine):
    with pytest.raises(ValueError, match="use Engine.encode"):
        last_engine.generate("hello")
    with pytest.raises(ValueError, match="dimensions"):
        last_engine.encode("hello", dimensions=8)
    with pytest.raises(ValueError, match="image_data"):
        last_engine.encode("hello", image_data="x.png")
    with pytest.raises(ValueError, match="is_embedding=True"):
        make_engine(max_total_tokens=1024).encode("hello")


def test_base_model_checkpoint_without_an_lm_head(make_engine, tiny_llama_dir, tmp_path):
    """What embedding checkpoints are (e5-mistral, Qwen3-Embedding): transformers'
    AutoModel saved, ``layers.0...`` names, no ``lm_head``; fine for embeddings only."""
    base = tmp_path / "base"
    AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_llama_dir / name, base)
    assert json.loads((base / "config.json").read_text())["architectures"] == ["LlamaModel"]
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    _check(base, make_engine(model_path=str(base), **ENGINE).encode(TEXTS), TEXTS)
    with pytest.raises(ValueError, match=r"missing tensors \[lm_head.weight\].*--is-emb"):
        make_engine(model_path=str(base), max_total_tokens=1024)


def test_encode_writes_request_log_records(make_engine, tiny_qwen2_dir, tmp_path):
    path = tmp_path / "requests.jsonl"
    eng = make_engine(model_path=str(tiny_qwen2_dir), log_requests_file=str(path), **ENGINE)
    eng.encode(TEXTS[:2], rid=["r0", "r1"])
    eng.shutdown()  # writes what is queued
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["rid"], r["route"], r["text"]) for r in records] == [
        ("r0", "Engine.encode", TEXTS[0]), ("r1", "Engine.encode", TEXTS[1])]
    assert records[0]["prompt_tokens"] == len(token_ids(tiny_qwen2_dir, TEXTS[0]))
    assert records[0]["completion_tokens"] == 0


def test_embedding_servers_have_no_prefill_decode_split():
    with pytest.raises(ValueError, match="is_embedding.*disaggregation-mode prefill"):
        ServerArgs(is_embedding=True, disaggregation_mode="prefill").validate()


def _write(dir_, modules, pooling=None):
    dir_.mkdir()
    (dir_ / "modules.json").write_text(json.dumps(
        [{"type": f"sentence_transformers.models.{k}", "path": p} for k, p in modules]))
    if pooling is not None:
        (dir_ / "1_Pooling").mkdir()
        (dir_ / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return dir_


def test_pooling_config_from_the_checkpoint(tmp_path):
    default = PoolingConfig.from_model_dir(tmp_path)
    assert (default.method, default.normalize) == ("last", True)
    st = [("Transformer", ""), ("Pooling", "1_Pooling")]
    mean = PoolingConfig.from_model_dir(_write(
        tmp_path / "m", [*st, ("Normalize", "2_Normalize")],
        {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}))
    assert (mean.method, mean.normalize, mean.needs_every_token) == ("mean", True, True)
    cls = PoolingConfig.from_model_dir(_write(tmp_path / "c", st,
                                              {"pooling_mode_cls_token": True}))
    assert (cls.method, cls.normalize) == ("cls", False)
    with pytest.raises(ValueError, match="Dense"):
        PoolingConfig.from_model_dir(_write(tmp_path / "d", [*st, ("Dense", "2_Dense")],
                                            {"pooling_mode_lasttoken": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        PoolingConfig.from_model_dir(_write(tmp_path / "x", st,
                                            {"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="exactly one"):
        PoolingConfig.from_model_dir(_write(tmp_path / "n", st, {}))
