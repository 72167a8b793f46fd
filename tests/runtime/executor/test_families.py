"""Every model family against transformers on tiny checkpoints that transformers' own
classes wrote (``radixlm.tiny_families``): logits through hand-built paged batches, and
greedy tokens through the Engine with prompts longer than the sliding windows, paged and
chunked, then again from the radix cache."""

from __future__ import annotations

import json
import os
import shutil

import torch

if not torch.cuda.is_available():  # before the Triton kernels are first imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from radixlm import cli  # noqa: E402
from radixlm.kernels import cpu_paged, masked_attention  # noqa: E402
from radixlm.radix_cache.kv_pool import KVPool  # noqa: E402
from radixlm.runtime.config import ServerArgs  # noqa: E402
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixlm.runtime.executor.layers import moe  # noqa: E402
from radixlm.runtime.executor.model_runner import ModelRunner  # noqa: E402
from radixlm.runtime.executor.models import get_model_class, load_model  # noqa: E402
from radixlm.runtime.executor.models.weights import checkpoint_shapes, plan_load  # noqa: E402
from radixlm.runtime.model_config import (  # noqa: E402
    FULL,
    SLIDING,
    ModelConfig,
    rope_scaling_of,
    rope_theta_of,
)
from radixlm.tiny_families import FAMILIES, WINDOW, family_config  # noqa: E402
from tests.runtime.executor.greedy_checks import check_greedy  # noqa: E402

ATOL = 1e-4
MAX_NEW = 12
TEXT = ("To make bread you need flour, water, salt and yeast. First, mix the flour and the "
        "water in a large bowl, then add the salt and the yeast and knead for ten minutes.")
ENGINE_CONFIGS = {"default": {}, "page4_chunk16": {"page_size": 4, "chunked_prefill_size": 16},
                  # a pool smaller than the batch: requests retract and resume; n = 2
                  "tiny_pool_n2": {"max_total_tokens": 128, "chunked_prefill_size": 16}}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, family_dirs):
    """(arch, model dir, prompts, transformers' eager model, its greedy outputs)."""
    path = family_dirs[request.param]
    ids = AutoTokenizer.from_pretrained(path).encode(TEXT, add_special_tokens=False)
    prompts = [ids, ids[:10], (ids * 2)[:70]]  # 46 and 70 tokens: past the 24-token windows
    assert len(ids) > 40 > WINDOW
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    return request.param, path, prompts, hf, _hf_greedy(hf, prompts)


def _hf_greedy(hf, prompts: list[list[int]]) -> list[list[int]]:
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def _batch(pool: KVPool, slots: dict[int, list[int]], mode: ForwardMode,
           new: dict[int, list[int]], start: dict[int, int]) -> ForwardBatch:
    """One forward of ``new[seq]`` tokens appended to each sequence (slots never reused)."""
    ids, pos, loc, kv, qo_ptr, kv_ptr = [], [], [], [], [0], [0]
    for seq, toks in new.items():
        prefix = slots.setdefault(seq, [])
        fresh = list(range(start[0], start[0] + len(toks)))
        start[0] += len(toks)
        seen = prefix + fresh if mode.is_decode else list(prefix)
        ids += toks
        pos += range(len(prefix), len(prefix) + len(toks))
        loc += fresh
        kv += seen
        qo_ptr.append(qo_ptr[-1] + len(toks))
        kv_ptr.append(kv_ptr[-1] + len(seen))
        prefix += fresh
    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64)

    return ForwardBatch(mode=mode, input_ids=t(ids), positions=t(pos), out_cache_loc=t(loc),
                        qo_indptr=t(qo_ptr), kv_indptr=t(kv_ptr), kv_indices=t(kv),
                        logits_indices=torch.arange(len(ids)), kv_pool=pool)


def test_logits_match_transformers(family):
    """Two sequences: extend a prefix, extend past the window over the cached prefix, decode;
    every row equals transformers' logits of the whole sequence (final soft-caps and logit
    scaling included, which greedy tokens cannot show)."""
    arch, path, prompts, hf, _ = family
    config = ModelConfig.from_hf(path)
    model = load_model(config, path, "cpu")
    full = [prompts[0], prompts[2]]
    with torch.no_grad():
        ref = [hf(torch.tensor([ids])).logits[0] for ids in full]
    pool = KVPool(512, config.num_layers, config.num_key_value_heads, config.head_dim,
                  torch.float32)
    slots: dict[int, list[int]] = {}
    cuts = [(7, 30), (20, 60)]  # prefix end, second extend end (past the window); then decode
    steps = [(ForwardMode.EXTEND, [(0, a) for a, _ in cuts]),
             (ForwardMode.EXTEND, list(cuts))]
    steps += [(ForwardMode.DECODE, [(b + i, b + i + 1) for _, b in cuts]) for i in range(4)]
    start = [0]
    for mode, ranges in steps:
        fb = _batch(pool, slots, mode, {s: full[s][a:b] for s, (a, b) in enumerate(ranges)},
                    start)
        expected = torch.cat([ref[s][a:b] for s, (a, b) in enumerate(ranges)])
        torch.testing.assert_close(model(fb), expected, atol=ATOL, rtol=0, msg=arch)


@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
def test_greedy_matches_transformers(family, make_engine, config):
    arch, path, prompts, _, expected = family
    eng = make_engine(model_path=str(path), **ENGINE_CONFIGS[config])
    check_greedy(eng, arch, config, prompts, expected, MAX_NEW)


def test_make_tiny_model_cli_writes_every_family(tmp_path):
    for arch in ("olmo2", "granite"):
        assert cli.main(["make-tiny-model", str(tmp_path / arch), "--arch", arch]) == 0
        config = ModelConfig.from_hf(tmp_path / arch)
        assert config.architectures == (get_model_class(config.architectures).__name__,)
    with pytest.raises(SystemExit):
        cli.main(["make-tiny-model", str(tmp_path / "x"), "--arch", "gpt2"])


def test_qwen3_moe_slides_every_layer(family_dirs, make_engine):
    """transformers' Qwen3-MoE windows every layer when ``use_sliding_window`` is on, whatever
    ``max_window_layers`` says (by Qwen2's and Qwen3's rule the tiny model's 3 would leave no
    layer sliding): so do we, token for token; and the window decides tokens within these
    prompts (transformers without it gives others)."""
    path = family_dirs["qwen3_moe"]
    config = ModelConfig.from_hf(path)
    assert config.hf_config["max_window_layers"] == config.num_layers == 3
    assert [config.layer_window(i) for i in range(3)] == [WINDOW] * 3
    ids = AutoTokenizer.from_pretrained(path).encode(TEXT, add_special_tokens=False)
    prompts = [ids, (ids * 2)[:70]]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    unwindowed = AutoConfig.from_pretrained(path)
    unwindowed.sliding_window = None
    full = AutoModelForCausalLM.from_pretrained(path, config=unwindowed, dtype=torch.float32,
                                                attn_implementation="eager").eval()
    expected = _hf_greedy(hf, prompts)
    assert _hf_greedy(full, prompts) != expected
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    eng = make_engine(model_path=str(path))
    assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)
            ] == expected


def test_gemma3_rope_per_layer_type(tmp_path):
    """transformers 5's rope_parameters keyed by layer type, and the older config.json with
    rope_local_base_freq / rope_scaling / sliding_window_pattern, give the same RoPE."""
    new = family_config("gemma3", 100).to_dict()
    assert rope_theta_of(new, SLIDING) == 10000.0 and rope_scaling_of(new, SLIDING) is None
    assert rope_theta_of(new, FULL) == 100000.0
    assert rope_scaling_of(new, FULL) == {"rope_type": "linear", "factor": 2.0}
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=100000.0, rope_local_base_freq=10000.0, sliding_window_pattern=2,
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(old))
    config = ModelConfig.from_hf(tmp_path)
    assert config.layer_types == (SLIDING, FULL, SLIDING)
    assert (config.layer_window(0), config.layer_window(1)) == (WINDOW, None)
    assert rope_theta_of(old, SLIDING) == 10000.0 and rope_scaling_of(old, SLIDING) is None
    assert (config.rope_theta, config.rope_scaling) == (100000.0, rope_scaling_of(new, FULL))


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_windowed_decode_takes_the_plain_kernels(family_dirs, make_engine, monkeypatch,
                                                 cpu_kernel):
    """Decode of uncapped sliding layers runs over each sequence's last `window` slots
    (ForwardBatch.window_views) through the planned path / compiled CPU kernel, never the
    masked one; tokens still equal transformers'."""
    path = family_dirs["mistral"]
    if not cpu_kernel:
        monkeypatch.setattr(ModelRunner, "paged_kernel", property(lambda self: False))
    ids = AutoTokenizer.from_pretrained(path).encode(TEXT, add_special_tokens=False)
    prompts = [ids, ids[:10], (ids * 2)[:70]]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    expected = _hf_greedy(hf, prompts)
    eng = make_engine(model_path=str(path))
    assert eng.scheduler.model_runner.decode_windows == [WINDOW]

    def refuse(*args, **kwargs):
        raise AssertionError("a windowed decode took the masked path")

    monkeypatch.setattr(masked_attention, "decode_attention", refuse)
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    assert got == expected


@pytest.mark.skipif(not cpu_paged.available(), reason="kernel not built")
@pytest.mark.parametrize("config", ["default", "page4_chunk16"])
@pytest.mark.parametrize("arch", ["mistral", "ministral", "gemma2", "gemma3", "phi3", "olmo3",
                                  "qwen3", "gpt_oss"])
def test_windowed_and_capped_layers_take_the_cpu_kernel(family_dirs, make_engine, monkeypatch,
                                                        arch, config):
    """Prefill of sliding-window and soft-capped layers runs in the compiled CPU kernel
    with the window / cap (counted), never the masked torch path (made to refuse); prompts
    past the windows, chunked over cached prefixes longer than them; tokens as
    transformers'."""
    path = family_dirs[arch]
    ids = AutoTokenizer.from_pretrained(path).encode(TEXT, add_special_tokens=False)
    prompts = [ids, ids[:10], (ids * 2)[:70]]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    expected = _hf_greedy(hf, prompts)
    eng = make_engine(model_path=str(path), **ENGINE_CONFIGS[config])
    assert eng.scheduler.model_runner.paged_kernel
    calls = {"extend": 0, "decode": 0}
    real = cpu_paged.paged_attention

    def counting(*args):
        if args[11] is not None or args[12] is not None:  # sliding_window, logit_cap
            calls["extend" if args[8] else "decode"] += 1  # causal: an extend segment
        return real(*args)

    def refuse(*args, **kwargs):
        raise AssertionError("a windowed / capped layer took the masked path")

    monkeypatch.setattr(cpu_paged, "paged_attention", counting)
    monkeypatch.setattr(masked_attention, "decode_attention", refuse)
    monkeypatch.setattr(masked_attention, "extend_attention", refuse)
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    assert got == expected, f"{arch} {config}"
    assert calls["extend"] > 0
    if arch == "gemma2":  # capped sliding layers decode in the kernel (no window view)
        assert calls["decode"] > 0


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3", "gpt_oss", "mixtral",
                                  "qwen3_moe"])
def test_triton_path(family_dirs, make_engine, no_masked_path, monkeypatch, arch):
    """--attention-backend triton (interpreted without CUDA): every layer in the Triton
    kernels, sliding windows and gpt-oss's sinks included (never the masked torch path),
    MoE experts in the fused-MoE kernel, gpt-oss's biased ones too (never the grouped CPU
    path); tokens as transformers'."""
    path = family_dirs[arch]
    ids = AutoTokenizer.from_pretrained(path).encode(TEXT, add_special_tokens=False)
    prompts = [ids, (ids * 2)[:40]]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    expected = [out[:6] for out in _hf_greedy(hf, prompts)]
    eng = make_engine(model_path=str(path), attention_backend="triton",
                      device="cuda" if torch.cuda.is_available() else "cpu")

    def grouped(*args, **kwargs):
        raise AssertionError("the Triton path took the grouped CPU experts")

    monkeypatch.setattr(moe.FusedExperts, "grouped", grouped)
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)
            ] == expected


def test_weight_update_refuses_other_family_options(family_dirs, tmp_path):
    """/update_weights_from_disk keeps the served model's options: a checkpoint whose
    config.json changes a soft-cap or the sliding layers' RoPE base is refused by name."""
    src = family_dirs["gemma3"]
    runner = ModelRunner(ServerArgs(model_path=str(src), max_total_tokens=256, device="cpu"),
                         str(src))
    assert runner.check_weights(str(src))  # the same checkpoint: fine
    for name, change, match in (("cap", {"attn_logit_softcapping": 5.0}, "logit_cap"),
                                ("scale", {"query_pre_attn_scalar": 64}, "sm_scale"),
                                ("rope", {"rope_parameters": {
                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 100000.0},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 500.0}}},
                                 "sliding-layer rope_theta")):
        other = tmp_path / name
        shutil.copytree(src, other)
        config = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=match):
            runner.check_weights(str(other))


def test_multimodal_gemma3_loads_its_language_model_only(family_dirs, tmp_path):
    src = family_dirs["gemma3mm"]
    config = ModelConfig.from_hf(src)  # text_config under the top level's architectures
    assert config.architectures == ("Gemma3ForConditionalGeneration",)
    assert config.hidden_size == 64 and config.tie_word_embeddings
    model = load_model(config, src, "cpu")
    names = plan_load(model, src).keys()
    assert names and all(n.startswith("language_model.model.") for n in names)
    assert any(n.startswith("vision_tower.") for n in checkpoint_shapes(src))
    other = tmp_path / "extra"
    shutil.copytree(src, other)
    tensors = load_file(other / "model.safetensors")
    tensors["language_model.model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(tensors, other / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected tensors \[language_model.model.layers.9"):
        plan_load(model, other)
