"""Prefix caching for hybrid models (Qwen3-Next, Qwen3.5 tiny checkpoints): the radix tree
keeps the linear layers' state at chosen prefix ends (radix_cache/snapshot_tree.py), a request
starts from the deepest matched snapshot, and its greedy tokens stay transformers'. A wrong
state (a snapshot taken at the wrong position, not copied, or overwritten) changes these
models' tokens within a few steps, so token equality with transformers is the oracle; the
cached-token counts say the prefix was really reused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixlm.tiny_hybrids import make_hybrid_model
from radixlm.tiny_model import train_tokenizer

ARCHS = ("qwen3_next", "qwen3_5")
MAX_NEW = 12
SHARED = 200
CONFIGS = {"default": {}, "chunk48": {"chunked_prefill_size": 48},
           "page4": {"page_size": 4}, "page4_chunk48": {"page_size": 4,
                                                         "chunked_prefill_size": 48}}
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
LOGPROBS: dict[tuple, torch.Tensor] = {}  # (arch, prompt) -> transformers' token logprobs
# the engine's float32 logprobs against float64; a request started from a wrong or zero
# state is off by far more even where its greedy tokens survive
LOGPROB_ATOL = 2e-3


@pytest.fixture(scope="module", params=ARCHS)
def hybrid(request, tmp_path_factory):
    """(arch, model dir, prompts sharing a 200-token prefix, transformers' greedy tokens)."""
    path = make_hybrid_model(tmp_path_factory.mktemp(request.param), request.param,
                             tokenizer=train_tokenizer())
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(1, 1000, (SHARED,), generator=gen).tolist()
    prompts = [shared + torch.randint(1, 1000, (n,), generator=gen).tolist()
               for n in (30, 41, 25)]
    short = [shared[:40] + torch.randint(1, 1000, (n,), generator=gen).tolist()
             for n in (9, 14, 21)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = {tuple(p): hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW,
                                          do_sample=False, eos_token_id=None,
                                          pad_token_id=0)[0, len(p):].tolist()
                    for p in prompts + short}
        # the greedy tokens' logprobs, from one float64 pass over prompt and output
        ref = hf.double()
        for p in prompts:
            out = expected[tuple(p)]
            logits = ref(torch.tensor([p + out[:-1]])).logits[0, len(p) - 1:]
            LOGPROBS[request.param, tuple(p)] = torch.log_softmax(logits, -1)[
                torch.arange(len(out)), out].float()
    return request.param, path, prompts, short, expected


def _run(eng, prompts, expected, what: str, n: int = 1) -> list[int]:
    """Generate ``prompts``, check every token against transformers' and the engine's
    accounting; each output's cached tokens."""
    outs = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "n": n})
    want = [expected[tuple(p)] for p in prompts for _ in range(n)]
    got = [o["output_ids"] for o in outs]
    assert got == want, f"{what}: engine {got} != transformers {want}"
    eng.scheduler.cache.check_accounting()
    return [o["meta_info"]["cached_tokens"] for o in outs]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_shared_prefix_is_reused(hybrid, make_engine, config):
    """The second request sharing 200 tokens with the first starts from a snapshot inside
    them (64 / 128, or a chunk's end), the third from the branch point the second saved
    (all 200), and the first prompt again from its own end."""
    arch, path, (a, b, c), _, expected = hybrid
    eng = make_engine(model_path=str(path), **CONFIGS[config])
    ps = CONFIGS[config].get("page_size", 1)
    assert _run(eng, [a], expected, f"{arch} {config} first") == [0]
    out = eng.generate(input_ids=b, sampling_params=GREEDY, return_logprob=True)
    cached_b = out["meta_info"]["cached_tokens"]
    assert out["output_ids"] == expected[tuple(b)], f"{arch} {config} second"
    assert 0 < cached_b < SHARED, f"{arch} {config}: second request cached {cached_b}"
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, LOGPROBS[arch, tuple(b)], atol=LOGPROB_ATOL, rtol=0)
    (cached_c,) = _run(eng, [c], expected, f"{arch} {config} third")
    assert cached_c == SHARED - SHARED % ps, f"{arch} {config}: third request cached {cached_c}"
    (again,) = _run(eng, [a], expected, f"{arch} {config} first again")
    assert again == (len(a) - 1) // ps * ps, f"{arch} {config}: the same prompt cached {again}"
    tree = eng.scheduler.cache.tree
    assert tree.num_snapshots() > 0
    assert all(n.snapshot is not None for n in [tree.match_prefix(a).last_node])


@pytest.mark.parametrize("inner", [True, False])
def test_n2_warm_up_prefill_is_reused(hybrid, make_engine, inner):
    """n > 1: the engine's warm-up prefill leaves a snapshot where the samples' match ends
    (the last page before the prompt's last token), so both samples reuse the prompt; a
    model that snapshots only at an extend's end (``inner`` False, as a hybrid whose layers
    ignore ``StateIndices.saves``) gets it by the warm-up's prefill ending a chunk there."""
    arch, path, (a, *_), _, expected = hybrid
    eng = make_engine(model_path=str(path), page_size=4)
    eng.scheduler.cache.snapshots.inner = inner
    cached = _run(eng, [a], expected, f"{arch} n=2 inner={inner}", n=2)
    assert cached == [(len(a) - 1) // 4 * 4] * 2, f"{arch}: samples cached {cached}"


def test_tiny_pool_evicts_and_retracts(hybrid, make_engine):
    """A KV pool smaller than the running requests' sequences (retraction, K/V eviction
    with their snapshots) and two request slots' worth of snapshots (snapshot eviction):
    every token still transformers', and prefixes still reused."""
    arch, path, _, short, expected = hybrid
    eng = make_engine(model_path=str(path), max_total_tokens=128, chunked_prefill_size=16,
                      max_running_requests=6)
    cache = eng.scheduler.cache
    assert cache.snapshot_slots == 7  # as many as the request slots
    _run(eng, short, expected, f"{arch} tiny pool n=2", n=2)
    cached = _run(eng, short, expected, f"{arch} tiny pool again")
    assert eng.get_server_info()["num_preemptions"] > 0, "the pool was meant to retract"
    assert cache.evicted_tokens > 0 and any(cached), cached
    assert cache.tree.evicted_snapshots > 0, "the snapshot budget was meant to fill"
    info = eng.get_server_info()
    assert info["snapshot_state_slots"] == 7
    assert info["evicted_state_snapshots"] == cache.tree.evicted_snapshots
    assert info["state_snapshots"] == cache.tree.num_snapshots()
    assert cache.tree.num_snapshots() <= cache.snapshot_slots


def test_flush_cache_frees_snapshots(hybrid, make_engine):
    arch, path, (a, b, _), _, expected = hybrid
    eng = make_engine(model_path=str(path), chunked_prefill_size=64)
    _run(eng, [a, b], expected, f"{arch} before flush")
    cache = eng.scheduler.cache
    assert cache.tree.num_snapshots() > 0
    assert eng.flush_cache()
    assert cache.tree.num_snapshots() == 0 and cache.snapshots.pending == 0
    assert cache.states.available_size() == cache.states.size
    cache.check_accounting()
    assert _run(eng, [b], expected, f"{arch} after flush") == [0]
