"""``Engine(tp_size=2)`` against ``tp_size=1`` and transformers: the same greedy output ids
through chunked prefill, prefix reuse and retraction (a small pool), the same seeded
samples; a model that does not split is refused naming its sizes; a rank that dies fails
the Engine's requests with a clear error, and shutdown leaves no rank behind."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixlm.runtime.entrypoints.engine.engine import EngineError
from radixlm.runtime.entrypoints.server_process import pid_alive
from tests.runtime.greedy_oracle import hf_greedy

MAX_NEW = 20
TEXTS = [
    "Hello",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Q: How do I reset my password?\nA:",
    '{"name": "Alice", "age": 30, "city":',
    "one two three four five six seven eight nine ten eleven twelve",
]
# chunks of 8 tokens; a pool too small for every request at once, so some retract
SMALL = {"max_total_tokens": 128, "chunked_prefill_size": 8}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_case(request, tiny_llama_dir, tiny_qwen2_dir):
    """(model dir, prompt ids, transformers' greedy outputs)."""
    path = str(tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    prompts.append((prompts[1] * 3)[:70])  # a long one: many chunks
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
            expected.append(out[0, len(ids):].tolist())
    return path, prompts, expected


def _greedy() -> dict:
    return {"max_new_tokens": MAX_NEW, "temperature": 0}


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def _rank_pids(eng) -> list[int]:
    return [p.pid for p in eng._tp_ranks.procs.values()]


def test_greedy_tp2_matches_tp1_and_transformers(arch_case, make_engine):
    path, prompts, expected = arch_case
    tp2 = make_engine(model_path=path, tp_size=2, dtype="float32", **SMALL)
    first = _ids(tp2.generate(input_ids=prompts, sampling_params=_greedy()))
    again = _ids(tp2.generate(input_ids=prompts, sampling_params=_greedy()))  # cached now
    info = tp2.get_server_info()
    assert info["num_preemptions"] > 0, "the pool was meant to retract"
    assert info["cached_tokens"] > 0, "the second round was meant to reuse prefixes"
    assert first == expected and again == expected
    tp1 = make_engine(model_path=path, dtype="float32", **SMALL)
    assert _ids(tp1.generate(input_ids=prompts, sampling_params=_greedy())) == first


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "olmo2", "mixtral", "qwen3_moe", "gpt_oss"])
def test_families_tp2_match_transformers(family_dirs, make_engine, arch):
    """Per-head q/k norms, (1 + w) sandwich norms, soft-caps, sliding windows, Phi-3's
    fused checkpoint tensors (each rank reading its rows of them), OLMo 2's q/k norms
    over every head (squares all-reduced), the MoE families' experts (each rank its
    share of every expert's rows) and gpt-oss's sinks (each rank its heads'), split over
    two ranks (tiny_families checkpoints;
    prompts past the 24-token windows)."""
    path = str(family_dirs[arch])
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.encode(TEXTS[1], add_special_tokens=False)
    prompts = [ids, (ids * 3)[:70]]
    expected = hf_greedy(path, prompts, MAX_NEW)
    tp2 = make_engine(model_path=path, tp_size=2, chunked_prefill_size=16)
    params = {**_greedy(), "ignore_eos": True}
    assert _ids(tp2.generate(input_ids=prompts, sampling_params=params)) == expected


def test_tp2_over_a_bf16_pool_matches_tp1(tiny_llama_dir, make_engine, monkeypatch):
    """--kv-cache-dtype reaches every rank: each holds its heads' K/V in bfloat16 (the
    torch path on every rank: the environment is inherited)."""
    from radixlm.runtime.executor.model_runner import ModelRunner

    monkeypatch.setenv("RADIXLM_CPU_KERNEL", "0")
    monkeypatch.setattr(ModelRunner, "paged_kernel", property(lambda self: False))
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    prompts = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    tp2 = make_engine(model_path=str(tiny_llama_dir), tp_size=2, dtype="float32",
                      kv_cache_dtype="bf16", **SMALL)
    assert tp2.scheduler.model_runner.kv_pool.k_buffers[0].dtype == torch.bfloat16
    got = _ids(tp2.generate(input_ids=prompts, sampling_params=_greedy()))
    tp1 = make_engine(model_path=str(tiny_llama_dir), dtype="float32", kv_cache_dtype="bf16",
                      **SMALL)
    assert _ids(tp1.generate(input_ids=prompts, sampling_params=_greedy())) == got


def test_seeded_sampling_same_tokens_as_one_rank(tiny_llama_dir, make_engine):
    """Only rank 0 samples (from logits gathered there), so a seed draws what it draws at
    tp_size 1."""
    params = [{"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.95, "sampling_seed": s}
              for s in (1, 2, 3)]
    prompts = ["Once upon a time", "The weather today", "def add(a, b):"]
    tp2 = make_engine(model_path=str(tiny_llama_dir), tp_size=2, dtype="float32")
    got = _ids(tp2.generate(prompts, params))
    tp1 = make_engine(model_path=str(tiny_llama_dir), dtype="float32")
    assert _ids(tp1.generate(prompts, params)) == got
    assert len({tuple(g) for g in got}) == 3


def test_uneven_split_refused_naming_the_sizes(tiny_llama_dir, make_engine):
    # 4 attention heads, 2 KV heads, intermediate 256: 3 ranks split none of them
    with pytest.raises(ValueError, match=r"tp_size 3 .*num_attention_heads \(4\).*"
                                         r"num_key_value_heads \(2\).*intermediate_size \(256\)"):
        make_engine(model_path=str(tiny_llama_dir), tp_size=3)


def test_killed_rank_fails_the_engine_and_shutdown_leaves_nothing(tiny_llama_dir,
                                                                   make_engine):
    eng = make_engine(model_path=str(tiny_llama_dir), tp_size=2)
    assert eng.generate("Hello", _greedy())["output_ids"]
    pids = _rank_pids(eng)
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 10  # the watch polls every 0.2 s
    while eng.is_alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not eng.is_alive
    with pytest.raises(EngineError, match=r"tensor-parallel rank 1 \(pid \d+\) exited"):
        eng.generate("Hello", _greedy())
    eng.shutdown()
    assert not any(pid_alive(p) for p in pids)


def test_shutdown_stops_every_rank(tiny_qwen2_dir, make_engine):
    eng = make_engine(model_path=str(tiny_qwen2_dir), tp_size=2)
    pids = _rank_pids(eng)
    assert all(pid_alive(p) for p in pids)
    eng.shutdown()
    assert [p.returncode for p in eng._tp_ranks.procs.values()] == [0]  # a clean exit
    assert not any(pid_alive(p) for p in pids)
