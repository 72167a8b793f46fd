"""The Engine against transformers: greedy output ids are identical, whatever the batch
composition, page size, chunking, cache state or retraction history (docs/design.md)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixlm.kernels import fma_linear

MAX_NEW = 16
TEXTS = [
    "Hello",
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Q: How do I reset my password?\nA:",
    "def add(a, b):\n    return",
    "To make bread you need flour, water, salt and yeast. First, mix the flour and the "
    "water in a large bowl, then add the salt and the yeast and knead for ten minutes. "
    "Let the dough rise for an hour before you shape it.",
    '{"name": "Alice", "age": 30, "city":',
    "one two three four five six seven eight nine ten eleven twelve",
    "The weather today is sunny with a light breeze from the west, and tomorrow",
]


def _prompt_ids(tok) -> list[list[int]]:
    ids = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    long_prompt = (ids[5] * 4)[:150]  # a prompt far longer than the others
    return ids + [long_prompt]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_case(request, tiny_llama_dir, tiny_qwen2_dir):
    """(model dir, prompt ids, transformers' greedy outputs) per architecture."""
    path = str(tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = _prompt_ids(tok)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
            expected.append(out[0, len(ids):].tolist())
    return path, prompts, expected


def _greedy(n: int = MAX_NEW) -> dict:
    return {"max_new_tokens": n, "temperature": 0}


def _check(outs, expected):
    got = [o["output_ids"] for o in outs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i}: engine {g} != transformers {e}"


CONFIGS = {
    "default": {},
    "page16": {"page_size": 16},
    "chunk8": {"chunked_prefill_size": 8},
    "chunk8_page4_nomix": {"chunked_prefill_size": 8, "page_size": 4,
                           "enable_mixed_chunk": False},
    "no_radix": {"disable_radix_cache": True},
    "tiny_pool": {"max_total_tokens": 256, "chunked_prefill_size": 64},
    "tiny_pool_page8": {"max_total_tokens": 320, "page_size": 8, "schedule_policy": "fcfs"},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_transformers_batched(arch_case, make_engine, config):
    path, prompts, expected = arch_case
    eng = make_engine(model_path=path, **CONFIGS[config])
    outs = eng.generate(input_ids=prompts, sampling_params=_greedy())
    _check(outs, expected)
    # the same requests again: now their prefixes are cached
    outs = eng.generate(input_ids=prompts, sampling_params=_greedy())
    _check(outs, expected)
    if config.startswith("tiny_pool"):
        assert eng.get_server_info()["num_preemptions"] > 0, "the pool was meant to retract"


@pytest.mark.parametrize("config", ["default", "chunk8"])
def test_greedy_matches_transformers_without_the_cpu_kernel(arch_case, make_engine, config,
                                                           monkeypatch):
    # the padded torch passes that gather K/V (the path where the kernel cannot be built)
    from radixlm.runtime.executor.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "paged_kernel", property(lambda self: False))
    path, prompts, expected = arch_case
    eng = make_engine(model_path=path, **CONFIGS[config])
    assert not eng.scheduler.model_runner.paged_kernel
    _check(eng.generate(input_ids=prompts, sampling_params=_greedy()), expected)


def test_greedy_matches_transformers_with_and_without_prepacked_weights(arch_case,
                                                                       make_engine):
    # the default multiplies by prepacked weights on a CPU in float32; the flag keeps
    # torch's dense matmul: both are the same model
    path, prompts, expected = arch_case
    for disable in (False, True):
        eng = make_engine(model_path=path, disable_cpu_weight_prepack=disable)
        runner = eng.scheduler.model_runner
        assert (runner.prepacked_layers == 0) == disable
        # the copies' memory is reported: every linear weight and the LM head once more
        # (oneDNN's copy), and again in panels (kernels/fma_linear.py): on an AVX-512 CPU
        # both, on an AVX2 one the panels alone
        weights = [m.weight for n, m in runner.model.named_modules()
                   if n.endswith(("_proj", "lm_head"))]
        panel = fma_linear.panel_columns() if fma_linear.supports(torch.zeros(1, 1)) else 0
        linear = 0 if panel and fma_linear.replaces_onednn() else sum(w.nbytes for w in weights)
        if panel:
            linear += sum(-(-w.shape[0] // panel) * panel * w.shape[1] * 4 for w in weights)
        assert eng.get_server_info()["prepacked_weight_bytes"] == (0 if disable else linear)
        _check(eng.generate(input_ids=prompts, sampling_params=_greedy()), expected)


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs", "lof"])
def test_policies_and_arrivals_while_decoding(arch_case, make_engine, policy):
    """Requests join while others decode (from other threads, at different times)."""
    path, prompts, expected = arch_case
    eng = make_engine(model_path=path, schedule_policy=policy, chunked_prefill_size=16)
    results: dict[int, dict] = {}

    def run(i: int) -> None:
        time.sleep(0.02 * (i % 4))
        results[i] = eng.generate(input_ids=prompts[i], sampling_params=_greedy())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    _check([results[i] for i in range(len(prompts))], expected)


def test_each_prompt_alone_matches(arch_case, make_engine):
    path, prompts, expected = arch_case
    eng = make_engine(model_path=path, page_size=4)
    for ids, exp in zip(prompts[:4], expected[:4]):
        assert eng.generate(input_ids=ids, sampling_params=_greedy())["output_ids"] == exp
