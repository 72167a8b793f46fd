"""The Mamba2 hybrids (Nemotron-H, Granite 4 hybrid, Falcon-H1, Bamba: Mamba2 and attention)
against transformers on tiny checkpoints its own classes wrote
(``radixlm.tiny_hybrids.MAMBA2_HYBRIDS``): every row's logits through the runner with states
carried across extends and decodes, and greedy tokens through the Engine (prompts of 20-300
tokens, chunked prefill shorter than them, page size 4, two samples of each prompt in a pool
that forces retraction), and a cached prefix's state reused with the same tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixlm import cli
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor.hybrid import refuse_hybrid_features
from radixlm.runtime.model_config import LINEAR, ModelConfig
from radixlm.tiny_hybrids import MAMBA2_HYBRIDS, make_hybrid_model
from radixlm.tiny_model import train_tokenizer
from tests.runtime.executor.hybrid_checks import check_logits_over_steps

# against transformers in float64 (its experts' loop: the grouped matmul has no float64).
# 1e-4 holds for Falcon-H1 and Nemotron-H (4.0e-5, 6.3e-5). Bamba's 2.0e-4 and Granite 4's
# 1.1e-4 are float32 rounding, not our scan: our SSD in float32 is as exact as its steps
# (test_chunk_precision.py); with every pure function of layers/ in float64 Bamba is still
# 2.5e-4 off transformers truly in float64 (its own float32 casts in the norms and the SSD
# made float64 too), transformers' own float32 model 2.8e-4; each random tiny Mamba2 layer
# amplifies a relative perturbation of its input 2.4x, and Granite's moves between 2.9e-5
# and 1.1e-4 with the order of float32 sums alone. A state not carried or a wrong
# projection layout moves logits by more than 1.
ATOL = {"falcon_h1": 1e-4, "nemotron_h": 1e-4, "granitemoehybrid": 5e-4, "bamba": 5e-4}
MAX_NEW = 30
LENGTHS = (20, 75, 300)
ENGINE_CONFIGS = {"default": {}, "page4_chunk48": {"page_size": 4, "chunked_prefill_size": 48},
                  "tiny_pool_n2": {"max_total_tokens": 128, "chunked_prefill_size": 16,
                                   "max_running_requests": 8}}
# arch -> (architecture, layers with a Mamba2 state, layers with K/V)
EXPECTED = {"nemotron_h": ("NemotronHForCausalLM", [0, 3], 1),
            "granitemoehybrid": ("GraniteMoeHybridForCausalLM", [0, 2, 3], 1),
            "falcon_h1": ("FalconH1ForCausalLM", [0, 1, 2], 3),
            "bamba": ("BambaForCausalLM", [0, 2, 3], 1)}


@pytest.fixture(scope="module")
def mamba_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mamba2")
    tok = train_tokenizer()
    return {arch: make_hybrid_model(root / arch, arch, tokenizer=tok) for arch in MAMBA2_HYBRIDS}


@pytest.fixture(scope="module", params=sorted(MAMBA2_HYBRIDS))
def hybrid(request, mamba_dirs):
    """(arch, model dir, prompts, transformers' model, its greedy outputs)."""
    path = mamba_dirs[request.param]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in LENGTHS]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, prompts, hf, _hf_greedy(hf, prompts)


def _hf_greedy(hf, prompts: list[list[int]]) -> list[list[int]]:
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def test_config_reads_the_layers(hybrid):
    arch, path, *_ = hybrid
    config = ModelConfig.from_hf(path)
    name, mamba, kv = EXPECTED[arch]
    assert config.architectures == (name,) and config.is_hybrid
    assert config.kv_layers == kv
    # Falcon-H1's layers all have K/V; their Mamba2 beside attention is not a layer type
    linear = [] if arch == "falcon_h1" else mamba
    assert [i for i, t in enumerate(config.layer_types) if t == LINEAR] == linear


def test_logits_match_transformers(hybrid):
    """Two sequences: extend a prefix, extend past several 32-token scan chunks from the
    states left in the slots, decode 3 steps; every row equals transformers' float64 logits
    of the whole sequence. The slots start with garbage: a fresh sequence must not read it."""
    arch, path, prompts, hf, _ = hybrid
    seqs = [prompts[1], prompts[2][:150]]
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                     experts_implementation="eager").eval()
    with torch.no_grad():
        ref = [ref_model(torch.tensor([s])).logits[0].float() for s in seqs]
    check_logits_over_steps(path, seqs, ref, EXPECTED[arch][1], ATOL[arch], arch)


@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
def test_greedy_matches_transformers(hybrid, make_engine, config):
    arch, path, prompts, hf, expected = hybrid
    if config.startswith("tiny_pool"):
        prompts = [prompts[0], prompts[1][:24], prompts[2][:28]]
        expected = _hf_greedy(hf, prompts)
    eng = make_engine(model_path=str(path), **ENGINE_CONFIGS[config])
    n = 2 if config.endswith("_n2") else 1
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "n": n}
    want = [e for e in expected for _ in range(n)]
    for attempt in ("cold", "again"):
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        got = [o["output_ids"] for o in outs]
        assert got == want, f"{arch} {config} {attempt}: engine {got} != {want}"
    if config.startswith("tiny_pool"):
        assert eng.get_server_info()["num_preemptions"] > 0, "the pool was meant to retract"


PREFIX_CASES = {
    # a multi-turn follow-up: the whole first sequence (prompt and answer) then more; the
    # finished request's end kept its state
    "follow_up": ({}, None),
    # a prompt sharing the first 200 tokens: the state at a chunk's end (192)
    "shared_200_chunk48_page4": ({"page_size": 4, "chunked_prefill_size": 48}, 200),
    # sharing 298: the state the layers wrote inside the one-chunk prefill (at 296, the last
    # page end before the prompt's last token)
    "shared_298_page4": ({"page_size": 4}, 298),
}


@pytest.mark.parametrize("case", list(PREFIX_CASES))
def test_cached_prefix_state_is_reused(hybrid, make_engine, case):
    """A second request starts from a state the radix cache kept (its cached tokens say
    so); its tokens are still transformers'."""
    arch, path, prompts, hf, expected = hybrid
    config, shared = PREFIX_CASES[case]
    gen = torch.Generator().manual_seed(3)
    extra = torch.randint(1, 1000, (37,), generator=gen).tolist()
    first = prompts[2]
    second = (first + expected[2] if shared is None else first[:shared]) + extra
    want = _hf_greedy(hf, [second])[0]
    eng = make_engine(model_path=str(path), **config)
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    out = eng.generate(input_ids=[first], sampling_params=params)[0]
    assert out["output_ids"] == expected[2], f"{arch} {case}: first request"
    out = eng.generate(input_ids=[second], sampling_params=params)[0]
    assert out["output_ids"] == want, f"{arch} {case}: {out['output_ids']} != {want}"
    cached = out["meta_info"]["cached_tokens"]
    assert (shared or 300) - 8 <= cached <= (shared or 330), out["meta_info"]
    eng.scheduler.cache.check_accounting()


def test_refuses_what_cannot_serve_a_hybrid(mamba_dirs):
    """Falcon-H1 (no ``LINEAR`` layer type: its Mamba2 is beside attention) is a hybrid too."""
    for arch, path in mamba_dirs.items():
        config = ModelConfig.from_hf(path)
        args = ServerArgs(model_path=str(path), device="cpu")
        refuse_hybrid_features(args, config)  # the defaults serve it
        bad = dataclasses.replace(args)
        object.__setattr__(bad, "is_embedding", True)  # skip the cross-field checks
        with pytest.raises(ValueError, match=f"{EXPECTED[arch][0]}.*--is-embedding"):
            refuse_hybrid_features(bad, config)


def test_make_tiny_model_writes_the_mamba2_hybrids(tmp_path):
    for arch in MAMBA2_HYBRIDS:
        assert cli.main(["make-tiny-model", str(tmp_path / arch), "--arch", arch]) == 0
        config = ModelConfig.from_hf(tmp_path / arch)
        assert config.architectures == (EXPECTED[arch][0],) and config.is_hybrid


def test_layer_names_of_released_files():
    """Released config.json files: Nemotron-H's ``hybrid_override_pattern`` and no layer
    list; Granite 4's ``mamba`` / ``attention`` layer types."""
    from radixlm.runtime.model_config import FULL, MLP_ONLY, _layer_types, _num_layers

    hf = {"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*-E"}
    assert _num_layers(hf) == 6
    assert _layer_types(hf, None) == (LINEAR, MLP_ONLY, LINEAR, FULL, MLP_ONLY, MLP_ONLY)
    with pytest.raises(ValueError, match="hybrid_override_pattern"):
        _layer_types({"model_type": "nemotron_h", "hybrid_override_pattern": "MX"}, None)
    granite = {"model_type": "granitemoehybrid", "num_hidden_layers": 3,
               "layer_types": ["mamba", "attention", "mamba"]}
    assert _layer_types(granite, None) == (LINEAR, FULL, LINEAR)
    bamba = {"model_type": "bamba", "num_hidden_layers": 3, "attn_layer_indices": [2]}
    assert _layer_types(bamba, None) == (LINEAR, LINEAR, FULL)

