"""Every model family through prefill/decode disaggregation: a prefill scheduler and a
decode scheduler in one process (KV over zmq on loopback, ``pd_sides``), greedy float32
tokens equal transformers' for a prompt past the 24-token sliding windows (prefilled in
chunks of 16), then for a second prompt sharing its first 60 tokens, which the decode
side takes from its own radix cache (only the tail's KV travels). Families with a
distinct attention or MoE feature again with one side at --tp-size 2."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.disaggregation.kv_buffers import KVBuffers
from radixlm.runtime.managers.messages import GenerateReqInput
from radixlm.tiny_families import FAMILIES, WINDOW
from tests.runtime.disaggregation.pd_client import secret_flags
from tests.runtime.disaggregation.pd_sides import (
    Side,
    assert_clean,
    drive,
    pd_generate,
    pd_pair,
)
from tests.runtime.greedy_oracle import hf_greedy

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
COMMON = dict(max_total_tokens=1024, cpu_threads=1, random_seed=0, page_size=4,
              chunked_prefill_size=16, dtype="float32")
TEXT = ("To make bread you need flour, water, salt and yeast. First, mix the flour and the "
        "water in a large bowl, then add the salt and the yeast and knead for ten minutes.")
SHARED = 60  # the second prompt's prefix in common with the first (whole pages of 4)
ARCHS = sorted(FAMILIES) + ["llama", "qwen2"]  # the built-in tiny models besides
# (family, the side at tp 2): soft-caps and sliding windows, q/k norms over every head
# (OLMo 2), experts without renormalization; Phi-3's fused tensors, Mixtral's experts,
# gpt-oss's sinks, alternating windows and head_dim 32 on a split decode side
TP2 = [("gemma2", "prefill"), ("olmo2", "prefill"), ("qwen3_moe", "prefill"),
       ("phi3", "decode"), ("mixtral", "decode"), ("gpt_oss", "decode")]


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> str:
    return secret_flags(tmp_path_factory.mktemp("pd-key"))[1]


@pytest.fixture(scope="module")
def model_dir(family_dirs, tiny_llama_dir, tiny_qwen2_dir):
    """arch -> its tiny checkpoint's directory."""
    return lambda arch: str({"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}.get(arch)
                            or family_dirs[arch])


def _oracle(path: str) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts (a long one, one sharing its first SHARED tokens, an unrelated one) and
    transformers' greedy float32 outputs for them."""
    ids = AutoTokenizer.from_pretrained(path).encode(TEXT, add_special_tokens=False)
    assert len(ids) > 40 > WINDOW
    first = (ids * 2)[:70]
    prompts = [first, first[:SHARED] + ids[3:28], ids[::-1]]
    return prompts, hf_greedy(path, prompts, MAX_NEW)


@pytest.fixture(scope="module", params=ARCHS)
def case(request, model_dir, secret):
    """(arch, prefill Side, decode Side, bootstrap port, prompts, expected outputs)."""
    path = model_dir(request.param)
    prompts, expected = _oracle(path)
    prefill, dec, port = pd_pair(path, {**COMMON, "disaggregation_secret_file": secret})
    yield request.param, prefill, dec, port, prompts, expected
    prefill.close()
    dec.close()


def _received(dec: Side) -> int:
    return dec.sched.get_info()["kv_transfer_received_tokens"]


def _pages(n: int) -> int:
    """Slots of ``n`` tokens in whole pages of 4 (KV travels in whole pages)."""
    return -(-n // COMMON["page_size"]) * COMMON["page_size"]


def _check_cold_then_radix_hit(name: str, prefill: Side, dec: Side, port: int,
                               prompts: list[list[int]], expected: list[list[int]]) -> None:
    """Cold: the whole prompt's KV crosses; then a prompt sharing SHARED tokens: the decode
    side matches them in its radix cache, claims only the rest, and still decodes
    transformers' tokens (the prefill side also reuses its own cache)."""
    got = pd_generate(prefill, dec, port, f"{name}-cold", prompts[0], 1, GREEDY)
    assert got == expected[0], f"{name} cold: {got} != {expected[0]}"
    assert _received(dec) == _pages(len(prompts[0]))
    before = _received(dec)
    got = pd_generate(prefill, dec, port, f"{name}-hit", prompts[1], 2, GREEDY)
    assert got == expected[1], f"{name} radix hit: {got} != {expected[1]}"
    assert dec.finished(f"{name}-hit").cached_tokens == SHARED
    assert _received(dec) - before == _pages(len(prompts[1]) - SHARED)
    assert prefill.finished(f"{name}-hit").cached_tokens >= SHARED
    assert_clean(prefill, dec)


def test_tokens_match_transformers(case):
    arch, prefill, dec, port, prompts, expected = case
    _check_cold_then_radix_hit(arch, prefill, dec, port, prompts, expected)


def test_decode_reads_the_transferred_kv(case, monkeypatch):
    """The control: the same pair with the received K/V zeroed as it is written gives other
    tokens, so the tokens above come from the pages that crossed (nothing recomputed)."""
    arch, prefill, dec, port, prompts, expected = case
    scatter = KVBuffers.scatter
    monkeypatch.setattr(KVBuffers, "scatter", lambda self, slots, frames: scatter(
        self, slots, [torch.zeros_like(f) for f in frames]))
    got = pd_generate(prefill, dec, port, f"{arch}-zeroed", prompts[2], 3, GREEDY)
    assert got[0] == expected[2][0]  # the first token is the prefill's
    assert got != expected[2], f"{arch}: zeroed KV gave transformers' tokens"
    assert_clean(prefill, dec)


@pytest.mark.parametrize(("arch", "split"), TP2)
def test_tp2_side_matches_transformers(model_dir, secret, arch, split):
    """One side at --tp-size 2 (rank 0 here, rank 1 a process), the other at 1: a tp-2
    prefill gathers every KV head from both ranks, a tp-2 decode gives each rank its
    heads; tokens as transformers', cold and from the decode's radix cache."""
    path = model_dir(arch)
    prompts, expected = _oracle(path)
    prefill, dec, port = pd_pair(path, {**COMMON, "disaggregation_secret_file": secret,
                                        "device": "cpu"}, **{split: {"tp_size": 2}})
    try:
        assert (prefill if split == "prefill" else dec).sched.model_runner.tp.size == 2
        _check_cold_then_radix_hit(f"{arch}-tp2-{split}", prefill, dec, port, prompts,
                                   expected)
    finally:
        prefill.close()
        dec.close()


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_swa_pool_refused_with_a_mode(secret, mode):
    """The SWA pool's sliding pages are not transferred: the pair of flags is refused at
    start-up, naming both."""
    with pytest.raises(ValueError, match="enable_hybrid_swa_memory does not support "
                                         "disaggregation_mode"):
        ServerArgs(model_path="x", enable_hybrid_swa_memory=True, disaggregation_mode=mode,
                   disaggregation_secret_file=secret)


def test_another_model_of_the_same_shape_is_refused(model_dir, secret):
    """A Mistral prefill and a Ministral decode have the same KV geometry (layers, KV heads,
    head_dim, dtype, page size) but not the same K/V: the decode refuses the prefill's
    route (a 503 naming both models) before claiming anything."""
    prefill, dec, port = pd_pair(model_dir("mistral"),
                                 {**COMMON, "disaggregation_secret_file": secret},
                                 decode_path=model_dir("ministral"))
    try:
        mine, theirs = dec.sched.pd.manager.buffers.layout, prefill.sched.pd.manager.buffers.layout
        assert (mine.num_layers, mine.num_kv_heads, mine.head_dim, mine.dtype) == (
            theirs.num_layers, theirs.num_kv_heads, theirs.head_dim, theirs.dtype)
        dec.inbox.append(GenerateReqInput("other", list(range(3, 40)), dict(GREEDY),
                                          bootstrap_host="127.0.0.1", bootstrap_port=port,
                                          bootstrap_room=9))
        drive(prefill, dec, until=lambda: dec.finished("other"))
        reason = dec.finished("other").finish_reason
        assert reason["status_code"] == 503, reason
        assert "the servers serve different models" in reason["message"], reason
        assert "MistralForCausalLM/" in reason["message"], reason
        assert "MinistralForCausalLM/" in reason["message"], reason
        assert_clean(prefill, dec)
    finally:
        prefill.close()
        dec.close()
