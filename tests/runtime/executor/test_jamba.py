"""Jamba (Mamba v1 layers beside attention, experts every other layer) against transformers on
a tiny checkpoint its own classes wrote (``radixlm.tiny_hybrids.MAMBA1_HYBRIDS``): the
selective scan over packed sequences against its own steps, every row's logits through the
runner with states carried across extends and decodes, greedy tokens through the Engine
(prompts of 20-300 tokens, chunked prefill, page size 4, two samples of each prompt in a
pool that forces retraction), and a cached prefix's state reused with the same tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.jamba import modeling_jamba

from radixlm import cli
from radixlm.runtime.distributed.parallel_state import TpGroup
from radixlm.runtime.executor.layers.gated_delta import Snapshots
from radixlm.runtime.executor.layers.mamba1 import selective_scan, selective_scan_step
from radixlm.runtime.executor.models import build_model
from radixlm.runtime.model_config import LINEAR, ModelConfig
from radixlm.tiny_hybrids import make_hybrid_model
from radixlm.tiny_model import train_tokenizer
from tests.runtime.executor.greedy_checks import check_greedy
from tests.runtime.executor.hybrid_checks import check_logits_over_steps
from tests.runtime.executor.test_mamba2_hybrids import _hf_greedy

# against transformers in float64 (its experts' eager loop): ours is 3.1e-4 off at most,
# transformers' own float32 model 2.4e-4 (float32 rounding); a state not carried or a wrong
# projection layout moves logits by more than 1
ATOL = 5e-4
MAX_NEW = 30
LENGTHS = (20, 75, 300)
ENGINE_CONFIGS = {"page4_chunk48": {"page_size": 4, "chunked_prefill_size": 48},
                  "tiny_pool_n2": {"max_total_tokens": 128, "chunked_prefill_size": 16,
                                   "max_running_requests": 8}}
MAMBA_LAYERS = [0, 2, 3]


@pytest.fixture(scope="module")
def jamba(tmp_path_factory):
    """(model dir, prompts, transformers' float32 model, its greedy outputs)."""
    path = make_hybrid_model(tmp_path_factory.mktemp("jamba"), "jamba",
                             tokenizer=train_tokenizer())
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in LENGTHS]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, prompts, hf, _hf_greedy(hf, prompts)


def test_selective_scan_packed_from_states_with_snapshots():
    """Three sequences (one shorter than the scan's block, one longer) from random states in
    float64: every output, final state and snapshot equals stepping token by token, and
    from zeros the outputs are transformers' ``mamba_selective_scan``."""
    gen = torch.Generator().manual_seed(0)
    lens, inner, n = [5, 70, 131], 6, 4
    tokens = sum(lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, dt, B, C = rand(tokens, inner), rand(tokens, inner), rand(tokens, n), rand(tokens, n)
    A_log, D, dt_bias, state0 = rand(inner, n) * 0.5, rand(inner), rand(inner), rand(3, inner, n)
    snaps = Snapshots.of([(1, 1), (2, 64), (2, 65), (0, 5), (2, 131)])
    y, state, got_snaps = selective_scan(x, dt, A_log, B, C, D, dt_bias, state0, lens, snaps)
    want_y, want_states, want_snaps = [], [], {}
    for seq, (start, length) in enumerate(zip([0, 5, 75], lens)):
        s = state0[seq:seq + 1]
        for t in range(start, start + length):
            out, s = selective_scan_step(x[t:t + 1], dt[t:t + 1], A_log, B[t:t + 1],
                                         C[t:t + 1], D, dt_bias, s)
            want_y.append(out)
            want_snaps[(seq, t - start + 1)] = s[0]
        want_states.append(s[0])
    torch.testing.assert_close(y, torch.cat(want_y))
    torch.testing.assert_close(state, torch.stack(want_states))
    pairs = zip(snaps.seqs.tolist(), snaps.lens.tolist())
    torch.testing.assert_close(got_snaps, torch.stack([want_snaps[p] for p in pairs]))
    y0, _, _ = selective_scan(x, dt, A_log, B, C, D, dt_bias, torch.zeros_like(state0), lens)
    rows = slice(75, 206)  # the third sequence
    ref = modeling_jamba.mamba_selective_scan(
        x[rows].T[None], dt[rows].T[None], -A_log.exp(), B[rows].T[None], C[rows].T[None],
        D=D, delta_bias=dt_bias, delta_softplus=True, use_associative_scan=False)
    # transformers' scan makes its writes in float32 (``B.float()``) whatever the input
    torch.testing.assert_close(y0[rows], ref[0].T, atol=1e-5, rtol=1e-5)


def test_config_reads_the_layers(jamba):
    config = ModelConfig.from_hf(jamba[0])
    assert config.architectures == ("JambaForCausalLM",) and config.is_hybrid
    assert config.kv_layers == 1
    assert [i for i, t in enumerate(config.layer_types) if t == LINEAR] == MAMBA_LAYERS


def test_logits_match_transformers(jamba):
    """Two sequences: extend a prefix, extend past the scan's 64-token blocks from the
    states left in the slots, decode 3 steps; every row equals transformers' float64 logits
    of the whole sequence. The slots start with garbage: a fresh sequence must not read it."""
    path, prompts, _, _ = jamba
    seqs = [prompts[1], prompts[2][:150]]
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                     experts_implementation="eager").eval()
    with torch.no_grad():
        ref = [ref_model(torch.tensor([s])).logits[0].float() for s in seqs]
    check_logits_over_steps(path, seqs, ref, MAMBA_LAYERS, ATOL, "jamba")


@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
def test_greedy_matches_transformers(jamba, make_engine, config):
    path, prompts, hf, expected = jamba
    if config.startswith("tiny_pool"):
        prompts = [prompts[0], prompts[1][:24], prompts[2][:28]]
        expected = _hf_greedy(hf, prompts)
    eng = make_engine(model_path=str(path), **ENGINE_CONFIGS[config])
    check_greedy(eng, "jamba", config, prompts, expected, MAX_NEW)


# shared 200: the state at a chunk's end (192); shared 298: the state the layers wrote
# inside the one-chunk prefill (at 296, the last page end before the prompt's last token)
PREFIX_CASES = {"shared_200_chunk48_page4": ({"page_size": 4, "chunked_prefill_size": 48}, 200),
                "shared_298_page4": ({"page_size": 4}, 298)}


@pytest.mark.parametrize("case", list(PREFIX_CASES))
def test_cached_prefix_state_is_reused(jamba, make_engine, case):
    """A second request starts from a state the radix cache kept (its cached tokens say
    so); its tokens are still transformers'."""
    path, prompts, hf, expected = jamba
    config, shared = PREFIX_CASES[case]
    gen = torch.Generator().manual_seed(3)
    second = prompts[2][:shared] + torch.randint(1, 1000, (37,), generator=gen).tolist()
    want = _hf_greedy(hf, [second])[0]
    eng = make_engine(model_path=str(path), **config)
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    out = eng.generate(input_ids=[prompts[2]], sampling_params=params)[0]
    assert out["output_ids"] == expected[2], f"jamba {case}: first request"
    out = eng.generate(input_ids=[second], sampling_params=params)[0]
    assert out["output_ids"] == want, f"jamba {case}: {out['output_ids']} != {want}"
    assert shared - 8 <= out["meta_info"]["cached_tokens"] <= shared, out["meta_info"]
    eng.scheduler.cache.check_accounting()


def test_make_tiny_model_writes_jamba(tmp_path):
    assert cli.main(["make-tiny-model", str(tmp_path), "--arch", "jamba"]) == 0
    config = ModelConfig.from_hf(tmp_path)
    assert config.architectures == ("JambaForCausalLM",) and config.is_hybrid


def test_tp2_matches_transformers(jamba, make_engine):
    """At --tp-size 2 each rank holds half of the mixer's channels and a state of them;
    greedy tokens are still transformers', through chunked prefill and page size 4."""
    path, prompts, hf, expected = jamba
    prompts, expected = prompts[:2], [e[:12] for e in expected[:2]]
    eng = make_engine(model_path=str(path), tp_size=2, dtype="float32", page_size=4,
                      chunked_prefill_size=32)
    runner = eng.scheduler.model_runner
    assert {i: s.ssm_shape for i, s in runner.model.state_specs().items()} == {
        i: (64, 16) for i in MAMBA_LAYERS}
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    assert got == expected


def test_tp_split_that_does_not_divide_is_refused(jamba):
    config = ModelConfig.from_hf(jamba[0])
    with pytest.raises(ValueError, match="JambaForCausalLM.*128 channels.*tp_size \\(3\\)"):
        build_model(config, "cpu", TpGroup(rank=0, size=3))
