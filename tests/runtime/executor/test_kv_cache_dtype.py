"""--kv-cache-dtype (SGLang's flag): its spellings, the pool's dtype and size, and the
engine over a narrow pool against its oracle: a float32 engine whose stored K/V (and the
new tokens its extend attends to) are rounded to the same dtype. The torch path computes
in float32 either way, so the two must agree bit for bit."""

from __future__ import annotations

import argparse
import math
import re

import pytest
import torch

import radixlm
from radixlm import kernels
from radixlm.kernels import cpu_paged
from radixlm.radix_cache import kv_pool
from radixlm.radix_cache.kv_pool import KVPool, kv_cache_torch_dtype
from radixlm.runtime import config
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.server_args_cli import add_server_args, server_args_from_cli
from tests.compat.sglang_wheel import sglang_dir

SPELLINGS = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_e4m3": torch.float8_e4m3fn,
}
NARROW = ["bfloat16", "float16", "fp8_e5m2", "fp8_e4m3"]
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def add(a, b):\n    return",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen",
]


# --- the flag ---------------------------------------------------------------------------------
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_each_spelling_resolves_to_its_dtype(model_dtype):
    assert set(config.KV_CACHE_DTYPES) == set(SPELLINGS) | {"auto"} == set(kv_pool.KV_CACHE_DTYPES)
    assert kv_cache_torch_dtype("auto", model_dtype) == model_dtype
    for name, dtype in SPELLINGS.items():
        assert ServerArgs(kv_cache_dtype=name).kv_cache_dtype == name
        assert kv_cache_torch_dtype(name, model_dtype) == dtype
        # the name reported back is a spelling of the same dtype
        assert SPELLINGS[kv_pool.kv_cache_dtype_name(dtype)] == dtype


def test_cli_flag():
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert server_args_from_cli(parser.parse_args([])).kv_cache_dtype == "auto"
    args = server_args_from_cli(parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"]))
    assert args.kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ValueError, match="--kv-cache-dtype.*block-scaled"):
        server_args_from_cli(parser.parse_args(["--kv-cache-dtype", "nvfp4"]))


@pytest.mark.parametrize("bad", ["mxfp8", "nvfp4", "fp4_mx_block16", "int8", "BF16", ""])
def test_unsupported_choices_are_refused_naming_the_flag(bad):
    with pytest.raises(ValueError, match="--kv-cache-dtype") as err:
        ServerArgs(kv_cache_dtype=bad)
    assert ("block-scaled" in str(err.value)) == (bad in config.SGLANG_KV_CACHE_DTYPES)
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        kv_cache_torch_dtype(bad, torch.float32)


def test_engine_refuses_before_loading_anything():
    with pytest.raises(ValueError, match="--kv-cache-dtype.*block-scaled"):
        radixlm.Engine(kv_cache_dtype="mxfp8")


def test_sglang_choices_are_each_accepted_or_refused():
    """SGLang 0.5.23's choice list: what we accept, plus the refused block-scaled ones."""
    text = (sglang_dir() / "srt" / "arg_groups" / "fields" / "model.py").read_text()
    field = text[text.index("    kv_cache_dtype:"):]
    block = field[field.index("choices=[") + len("choices=["):field.index("]")]
    choices = set(re.findall(r'"([^"]+)"', block))
    assert choices, "SGLang's kv_cache_dtype choices not found"
    accepted = set(config.KV_CACHE_DTYPES) - {"fp16", "float16", "float32"}  # our additions
    assert choices == accepted | set(config.SGLANG_KV_CACHE_DTYPES)


# --- the pool ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NARROW)
def test_pool_holds_the_dtype(name):
    dtype = SPELLINGS[name]
    pool = KVPool(16, 3, 2, 8, dtype)
    assert all(b.dtype == dtype for b in pool.k_buffers + pool.v_buffers)
    k_buf, v_buf = pool.get_kv_buffer(2)
    kernels.store_kv(k_buf, v_buf, torch.tensor([3, 5]), torch.ones(2, 2, 8),
                     torch.full((2, 2, 8), 2.0))
    assert k_buf.dtype == dtype and k_buf[3].float().eq(1).all() and v_buf[5].float().eq(2).all()


def test_bytes_per_token_follow_the_dtype():
    f32 = KVPool.bytes_per_token(4, 2, 32, torch.float32)
    assert f32 == 2 * 4 * 2 * 32 * 4
    assert KVPool.bytes_per_token(4, 2, 32, torch.bfloat16) * 2 == f32
    assert KVPool.bytes_per_token(4, 2, 32, torch.float16) * 2 == f32
    assert KVPool.bytes_per_token(4, 2, 32, torch.float8_e5m2) * 4 == f32
    assert KVPool.bytes_per_token(4, 2, 32, torch.float8_e4m3fn) * 4 == f32


def test_pool_capacity_from_a_memory_budget(tiny_llama_dir):
    """The same --kv-cache-memory-gb holds twice the tokens in bf16, four times in fp8."""
    sizes = {}
    for name in ("auto", "bf16", "fp8_e4m3"):
        args = ServerArgs(device="cpu", kv_cache_dtype=name, kv_cache_memory_gb=2.0 ** -10)
        runner = ModelRunner(args, str(tiny_llama_dir))
        assert runner.kv_pool.k_buffers[0].dtype == (SPELLINGS.get(name) or torch.float32)
        assert runner.kv_pool_bytes <= 1 << 20
        sizes[name] = runner.pool_size
    assert sizes["bf16"] == 2 * sizes["auto"] and sizes["fp8_e4m3"] == 4 * sizes["auto"]


# --- the engine -------------------------------------------------------------------------------
@pytest.fixture
def torch_path(monkeypatch):
    """The gathering torch passes (not the CPU kernel, which is another pool reader)."""
    monkeypatch.setattr(ModelRunner, "paged_kernel", property(lambda self: False))


def _round_like_the_pool(monkeypatch, dtype: torch.dtype) -> None:
    """A float32 pool that holds what a ``dtype`` pool holds: stores rounded, and the new
    tokens of extend attention rounded (as the narrow pool's readers round them)."""
    store, extend = kernels.store_kv, kernels.extend_attention

    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).to(t.dtype)

    def rounded_store(k_buf, v_buf, loc, k, v, backend=None):
        assert k_buf.dtype == torch.float32, k_buf.dtype
        store(k_buf, v_buf, loc, r(k), r(v), backend=backend)

    def rounded_extend(q, k, v, *args, **kwargs):
        return extend(q, r(k), r(v), *args, **kwargs)

    monkeypatch.setattr(kernels, "store_kv", rounded_store)
    monkeypatch.setattr(kernels, "extend_attention", rounded_extend)


def _run(eng, tok) -> list[dict]:
    ids = [tok.encode(t, add_special_tokens=False) for t in PROMPTS]
    return eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0},
                        return_logprob=True)


def _logprobs(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("name", NARROW)
def test_engine_equals_float32_engine_over_rounded_kv(make_engine, tiny_llama_dir, torch_path,
                                                      monkeypatch, name):
    dtype = SPELLINGS[name]
    narrow = make_engine(model_path=str(tiny_llama_dir), kv_cache_dtype=name,
                         chunked_prefill_size=16)
    runner = narrow.scheduler.model_runner
    assert runner.kv_pool.k_buffers[0].dtype == dtype and runner.dtype == torch.float32
    assert narrow.get_server_info()["kv_cache_dtype"] == kv_pool.kv_cache_dtype_name(dtype)
    got = _run(narrow, narrow.tokenizer)
    again = _run(narrow, narrow.tokenizer)  # the prompts' KV now comes from the cache
    _round_like_the_pool(monkeypatch, dtype)
    oracle = make_engine(model_path=str(tiny_llama_dir), chunked_prefill_size=16)
    assert oracle.scheduler.model_runner.kv_pool.k_buffers[0].dtype == torch.float32
    want = _run(oracle, oracle.tokenizer)
    for g, a, w in zip(got, again, want):
        assert g["output_ids"] == w["output_ids"]
        assert _logprobs(g) == _logprobs(w)  # same float32 math on the same values
        assert all(math.isfinite(lp) for lp in _logprobs(g))
        assert a["meta_info"]["cached_tokens"] > 0 and a["output_ids"] == g["output_ids"]


@pytest.mark.parametrize("name", ["bf16", "fp8_e5m2", "fp8_e4m3"])
def test_engine_default_path_over_a_narrow_pool(make_engine, tiny_llama_dir, name):
    """Whatever path reads the pool by default (the CPU kernel for its KV_DTYPES when it is
    built, else the torch passes): finite outputs, and a repeat served from the prefix
    cache gives the same tokens. (No agreement with float32 K/V is asserted: the tiny
    model's random weights leave near ties that fp8's 2-3 mantissa bits flip.)"""
    dtype = SPELLINGS[name]
    eng = make_engine(model_path=str(tiny_llama_dir), kv_cache_dtype=name)
    runner = eng.scheduler.model_runner
    assert runner.kv_pool.k_buffers[0].dtype == dtype
    assert runner.paged_kernel == (dtype in cpu_paged.KV_DTYPES and cpu_paged.available())
    got = _run(eng, eng.tokenizer)
    again = _run(eng, eng.tokenizer)
    for g, a in zip(got, again):
        assert len(g["output_ids"]) == 12 and all(math.isfinite(lp) for lp in _logprobs(g))
        assert a["meta_info"]["cached_tokens"] > 0 and a["output_ids"] == g["output_ids"]
