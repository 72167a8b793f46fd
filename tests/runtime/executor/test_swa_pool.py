"""The SWA pool (``--enable-hybrid-swa-memory``): sliding layers' K/V in a smaller pool
whose slots a request frees as its window moves on. Greedy float32 tokens equal
transformers' with prompts past the windows, in the configurations of
``test_families.py``; the sliding pool really holds fewer slots than the requests' length."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the Triton kernels are first imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from radixlm.runtime.config import ServerArgs  # noqa: E402
from radixlm.tiny_families import WINDOW  # noqa: E402
from tests.runtime.executor.greedy_checks import check_greedy  # noqa: E402
from tests.runtime.greedy_oracle import hf_greedy  # noqa: E402

MAX_NEW = 12
TEXT = ("To make bread you need flour, water, salt and yeast. First, mix the flour and the "
        "water in a large bowl, then add the salt and the yeast and knead for ten minutes.")
SWA = {"enable_hybrid_swa_memory": True}
CONFIGS = {
    "default": {},
    "page4_chunk16": {"page_size": 4, "chunked_prefill_size": 16},
    # a pool smaller than the batch: requests retract and resume; n = 2
    "tiny_pool_n2": {"max_total_tokens": 160, "chunked_prefill_size": 16,
                     "swa_full_tokens_ratio": 0.5},
    # the sliding pool (64 slots) smaller than one request (94 tokens)
    "small_swa": {"max_total_tokens": 256, "swa_full_tokens_ratio": 0.25},
}


def _prompts(path) -> list[list[int]]:
    ids = AutoTokenizer.from_pretrained(path).encode(TEXT, add_special_tokens=False)
    assert len(ids) > 40 > WINDOW
    return [ids, ids[:10], (ids * 2)[:82]]  # 46 and 82 tokens: past the 24-token windows


@pytest.fixture(scope="module", params=["mistral", "gemma2", "gemma3", "gpt_oss"])
def family(request, family_dirs):
    path = family_dirs[request.param]
    prompts = _prompts(path)
    return request.param, path, prompts, hf_greedy(path, prompts, MAX_NEW)


def _watch_swa(eng) -> list[tuple[int, int]]:
    """Before every forward: (sliding slots held by requests and their locks, not the
    tree's evictable ones; longest request's KV length)."""
    runner, cache = eng.scheduler.model_runner, eng.scheduler.cache
    seen: list[tuple[int, int]] = []
    forward = runner.forward

    def watched(batch, req_to_token):
        used = (cache.swa.size - cache.allocator.swa_available_size()
                - cache.tree.swa_evictable_size())
        longest = max(p + n for p, n in zip(batch.prefix_lens, batch.extend_lens))
        seen.append((used, longest))
        return forward(batch, req_to_token)

    runner.forward = watched
    return seen


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_transformers(family, make_engine, config):
    arch, path, prompts, expected = family
    eng = make_engine(model_path=str(path), **SWA, **CONFIGS[config])
    assert eng.scheduler.cache.swa is not None
    seen = _watch_swa(eng)
    check_greedy(eng, arch, config, prompts, expected, MAX_NEW)
    if config == "small_swa":  # a request longer than the whole sliding pool ran
        assert max(k for _, k in seen) > eng.scheduler.cache.swa.size


def test_sliding_pool_holds_only_the_window(family_dirs, make_engine):
    """One long request: its sliding slots stay within window + 3 pages, the window of
    its cached prefix it locks, and the forward's new tokens, however long it grows; the
    pool is smaller than it."""
    path = family_dirs["gemma3"]
    prompt = (_prompts(path)[0] * 3)[:120]
    expected = hf_greedy(path, [prompt], 40)
    page, chunk = 4, 16
    eng = make_engine(model_path=str(path), page_size=page, chunked_prefill_size=chunk,
                      max_total_tokens=2048, swa_full_tokens_ratio=0.0625, **SWA)
    cache = eng.scheduler.cache
    assert cache.swa.size == 128 < len(prompt) + 40
    assert eng.scheduler.model_runner.kv_pool.swa.k_buffers[0].shape[0] == 128 + 1
    seen = _watch_swa(eng)
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    assert eng.generate(input_ids=prompt, sampling_params=params)["output_ids"] == expected[0]
    assert max(k for _, k in seen) == len(prompt) + 39
    # before a forward: what the request kept (window + 3 pages at most), the tree's
    # window it locks, and its new pages
    assert all(used <= 2 * WINDOW + 4 * page + chunk + page for used, _ in seen), seen
    assert max(used for used, _ in seen) < len(prompt)


def test_triton_path(family_dirs, make_engine, no_masked_path):
    """--attention-backend triton (interpreted without CUDA) reads the sliding pool through
    the mapping too."""
    path = family_dirs["gemma3"]
    prompts = [_prompts(path)[0][:40]]
    expected = [out[:4] for out in hf_greedy(path, prompts, 4)]
    eng = make_engine(model_path=str(path), attention_backend="triton", page_size=4,
                      chunked_prefill_size=16, max_total_tokens=256,
                      swa_full_tokens_ratio=0.5,
                      device="cuda" if torch.cuda.is_available() else "cpu", **SWA)
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)
            ] == expected


def test_flags(family_dirs, make_engine):
    with pytest.raises(ValueError, match="swa_full_tokens_ratio"):
        ServerArgs(model_path="x", swa_full_tokens_ratio=0)
    with pytest.raises(ValueError, match="both set"):
        ServerArgs(model_path="x", enable_hybrid_swa_memory=True, disable_hybrid_swa_memory=True)
    with pytest.raises(ValueError, match="enable_hybrid_swa_memory does not support tp_size"):
        ServerArgs(model_path="x", enable_hybrid_swa_memory=True, tp_size=2)
    with pytest.raises(ValueError, match="--swa-full-tokens-ratio 0.05"):
        make_engine(model_path=str(family_dirs["gemma3"]), max_total_tokens=256,
                    swa_full_tokens_ratio=0.05, **SWA)
    eng = make_engine(model_path=str(family_dirs["gemma3"]), max_total_tokens=256)
    assert eng.scheduler.cache.swa is None  # opt-in


def test_shared_prefix_past_the_window_is_reused(family_dirs, make_engine):
    """Sliding eviction tombstones a cached node (its sliding K/V freed, full kept): a
    prompt continuing the cached sequence reuses it only up to a point whose last window
    is live, and its tokens still equal transformers'."""
    path = family_dirs["gemma2"]
    base = (_prompts(path)[0] * 2)[:64]
    first_out = hf_greedy(path, [base], MAX_NEW)[0]
    prompts = [base + first_out[:8], base[:40] + [9, 10]]
    expected = hf_greedy(path, prompts, MAX_NEW)
    eng = make_engine(model_path=str(path), page_size=4, chunked_prefill_size=-1,
                      max_total_tokens=512, swa_full_tokens_ratio=0.25, **SWA)
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    assert eng.generate(input_ids=base, sampling_params=params)["output_ids"] == first_out
    cache = eng.scheduler.cache
    # the tree: [0, 40) (split at its sliding lock), [40, 64), [64, 72); the engine is idle
    assert cache.tree.evict_swa(24) == 24
    dead = [len(n.key) for n in cache.tree._nodes() if n.swa_tombstone]
    assert dead == [24], cache.tree.pretty_print()
    cache.check_accounting()
    cont = eng.generate(input_ids=prompts[0], sampling_params=params)
    assert cont["output_ids"] == expected[0]
    assert cont["meta_info"]["cached_tokens"] == 40  # 68 cached, but [40, 64) is dead
    other = eng.generate(input_ids=prompts[1], sampling_params=params)
    assert other["output_ids"] == expected[1]
    assert other["meta_info"]["cached_tokens"] == 40
