"""hf_formats.py, hf_layouts.py and hf_packing.py read what the tools write: each format
written by tiny_quant/hf_writer.py (packing code of its own) and, where the tool installs
here, by the tool itself (compressed-tensors' compressors; AutoAWQ's unpacker), then read
back into a QuantWeight whose dequantization must equal the writer's bit for bit. Header
checks name the tensor; detection refuses what is not supported by the field's name."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from radixlm.runtime.executor.quant.hf_formats import scheme_for
from radixlm.runtime.executor.quant.hf_layouts import QuantScheme, TensorInfo
from radixlm.runtime.executor.quant.hf_packing import act_order_perm
from radixlm.tiny_model import default_tiny_model_path
from radixlm.tiny_quant.hf_writer import (
    QuantizedLinear,
    quantization_config,
    quantize_linear,
    write_quantized,
)

PREFIX = "model.layers.0.mlp.experts.3.up_proj"  # an MoE expert reads like any linear
DTYPES = {torch.int32: "I32", torch.int64: "I64", torch.int8: "I8", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}


def header(tensors: dict[str, torch.Tensor]) -> dict[str, TensorInfo]:
    return {k: (DTYPES[v.dtype], tuple(v.shape)) for k, v in tensors.items()}


def scheme(fmt: str, **options: object) -> QuantScheme:
    s = scheme_for({"quantization_config": quantization_config(fmt, **options)}, None)
    assert s is not None
    return s


def read_back(fmt: str, q: QuantizedLinear, **options: object):
    s = scheme(fmt, **options)
    tensors = {PREFIX + k: v for k, v in q.tensors.items()}
    shapes = header(tensors)
    assert s.quantized_modules(shapes) == [PREFIX]
    n, k = s.logical_shape(shapes, PREFIX, tensors.__getitem__)
    return s.read(tensors.__getitem__, PREFIX, n, k)


CASES = [  # (fmt, n, k, options): odd shapes and group tails wherever the layout allows
    ("awq", 40, 96, {"group": 32}),
    ("awq", 24, 128, {"group": 64}),
    ("awq", 16, 256, {"group": 128}),
    ("awq", 64, 100, {"group": -1}),
    ("awq", 64, 99, {"group": -1}),  # one group: any k, odd too
    ("gptq", 48, 200, {"group": 64}),  # a 8-column tail group
    ("gptq", 48, 200, {"group": 64, "sym": False}),
    ("gptq", 48, 200, {"group": 64, "sym": False, "checkpoint_format": "gptq_v2"}),
    ("gptq", 40, 256, {"group": 32, "desc_act": True}),
    ("gptq", 40, 264, {"group": 128, "desc_act": True, "sym": False}),
    ("gptq", 32, 96, {"group": -1, "desc_act": True}),
    ("gptq", 48, 256, {"group": 32, "bits": 8, "sym": False}),
    ("gptq", 48, 256, {"group": 128, "bits": 8}),
    ("w4a16", 37, 128, {"group": 32}),
    ("w4a16", 37, 96, {"group": 32, "sym": False}),
    ("w4a16", 37, 101, {"group": -1}),  # per channel: k not a multiple of 8
    ("w4a16", 40, 128, {"group": 32, "actorder": True}),
    ("w4a16", 40, 99, {"group": -1, "actorder": True}),  # one group: no reordering
    ("w4a16", 41, 96, {"group": 32, "bits": 8, "sym": False}),
    ("w8a8-int8", 33, 77, {}),
    ("fp8-block", 200, 300, {}),  # partial 128x128 tiles at both edges
    ("fp8-block", 64, 96, {"block": (32, 64)}),
    ("fp8-tensor", 33, 77, {}),
    ("fp8-channel", 33, 77, {}),
]


@pytest.mark.parametrize(("fmt", "n", "k", "options"), CASES,
                         ids=[f"{c[0]}-{c[1]}x{c[2]}-{c[3]}" for c in CASES])
def test_round_trip_is_exact(fmt: str, n: int, k: int, options: dict) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k))
    q = quantize_linear(fmt, w, **options)
    got = read_back(fmt, q, **options)
    assert got.shape == (n, k)
    assert torch.equal(got.dequantize(), q.dequantized)
    # and the writer quantized at all: within a few steps of the weight
    bound = {"w4": 0.35, "w8": 0.03, "fp8": 0.2}[got.kind]
    assert (q.dequantized - w).abs().max() < bound * w.abs().max()
    ordered = options.get("desc_act") or options.get("actorder")
    assert (got.perm is not None) == bool(ordered and options.get("group", 128) > 0)


def test_act_order_groups_features_from_all_over_the_row() -> None:
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    q = quantize_linear("gptq", w, group=16, desc_act=True)
    got = read_back("gptq", q, group=16, desc_act=True)
    g_idx = q.tensors[".g_idx"].long()
    assert torch.equal(g_idx[got.perm], torch.arange(64) // 16)
    assert len(set(g_idx[:16].tolist())) > 1  # not i // group


def test_act_order_perm_refuses_uneven_groups() -> None:
    with pytest.raises(ValueError, match=r"x\.g_idx: not an assignment.*\[5, 3\]"):
        act_order_perm(torch.tensor([0, 0, 0, 0, 0, 1, 1, 1]), 8, 4, "x.g_idx")
    with pytest.raises(ValueError, match=r"x\.g_idx: group indices must lie in 0\.\.1"):
        act_order_perm(torch.tensor([0, 0, 0, 0, 2, 2, 2, 2]), 8, 4, "x.g_idx")
    assert act_order_perm(torch.arange(8) // 4, 8, 4, "x") is None


# ---------------------------------------------------------------- the tools' own code


def test_pack_quantized_matches_compressed_tensors() -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import (
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    for sym in (True, False):
        w = torch.randn(37, 96, generator=torch.Generator().manual_seed(2))
        ours = quantize_linear("w4a16", w, group=32, sym=sym)
        args = QuantizationArgs(num_bits=4, type="int", symmetric=sym, group_size=32,
                                strategy="group")
        sch = QuantizationScheme(targets=["Linear"], weights=args)
        state = {"weight": w, "weight_scale": ours.tensors[".weight_scale"]}
        if not sym:  # our zero points, unpacked as the tool holds them before packing
            zp = torch.round(-8 - w.view(37, 3, 32).clamp(max=0).amin(-1)
                             / ours.tensors[".weight_scale"].float()).clamp(-8, 7)
            state["weight_zero_point"] = zp.to(torch.int8)
        theirs = PackedQuantizationCompressor.compress(state, sch)
        for name, t in theirs.items():
            assert torch.equal(ours.tensors["." + name], t), name
        got = read_back("w4a16", QuantizedLinear({"." + k: v for k, v in theirs.items()},
                                                 ours.dequantized), group=32, sym=sym)
        tool = PackedQuantizationCompressor.decompress(theirs, sch)["weight"]
        assert torch.equal(got.dequantize(tool.dtype), tool)


@pytest.mark.parametrize("fmt", ["w8a8-int8", "fp8-channel", "fp8-tensor"])
def test_naive_quantized_matches_compressed_tensors(fmt: str) -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.naive_quantized.base import (
        NaiveQuantizationCompressor,
    )
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = torch.randn(33, 77, generator=torch.Generator().manual_seed(3))
    ours = quantize_linear(fmt, w)
    args = QuantizationArgs(num_bits=8, type="int" if fmt == "w8a8-int8" else "float",
                            strategy="tensor" if fmt == "fp8-tensor" else "channel")
    sch = QuantizationScheme(targets=["Linear"], weights=args)
    theirs = NaiveQuantizationCompressor.compress(
        {"weight": w, "weight_scale": ours.tensors[".weight_scale"]}, sch)
    assert torch.equal(theirs["weight"].view(torch.int8),
                       ours.tensors[".weight"].view(torch.int8))
    tool = NaiveQuantizationCompressor.decompress(theirs, sch)["weight"]
    got = read_back(fmt, QuantizedLinear({"." + k: v for k, v in theirs.items()},
                                         ours.dequantized))
    assert torch.equal(got.dequantize(tool.dtype), tool)


def _autoawq_packing():
    """AutoAWQ's packing_utils, loaded from its file (the package's __init__ pulls in
    datasets and CUDA extensions); None when AutoAWQ is not installed."""
    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "utils" / "packing_utils.py"
    module_spec = importlib.util.spec_from_file_location("awq_packing_utils", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_awq_matches_autoawq() -> None:
    """AutoAWQ's own dequantizer reads our file; its AWQ -> exllama (GPTQ v1) repacking,
    read as GPTQ, gives our AWQ reader's weight."""
    packing = _autoawq_packing()
    if packing is None:
        pytest.skip("AutoAWQ is not installed (PYTHONPATH to a --no-deps install runs it)")
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(4))
    w[:4, :32] = w[:4, :32].abs()  # zero points of 0: the v1 words borrow
    q = quantize_linear("awq", w, group=32)
    t = q.tensors
    tool = packing.dequantize_gemm(t[".qweight"], t[".qzeros"], t[".scales"], 4, 32)
    got = read_back("awq", q, group=32)
    assert torch.equal(got.dequantize(torch.float16), tool.T)
    qweight, qzeros = packing.unpack_reorder_pack(t[".qweight"], t[".qzeros"], 4)
    as_gptq = QuantizedLinear({".qweight": qweight, ".qzeros": qzeros, ".scales": t[".scales"],
                               ".g_idx": torch.arange(128, dtype=torch.int32) // 32},
                              q.dequantized)
    assert torch.equal(read_back("gptq", as_gptq, group=32).dequantize(), q.dequantized)


def autogptq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                        g_idx: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's torch fallback (qlinear_cuda_old), v1 zeros read field by field (right
    unless a zero point is 0: see the borrow test): [k, n] in input order, each input row
    scaled by its own group (g_idx), not sorted."""
    wf = torch.arange(0, 32, bits, dtype=torch.int32)
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, 32 // bits),
                                      wf.view(1, 1, -1)) & ((1 << bits) - 1)
    zeros = (zeros + 1).reshape(scales.shape)
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, 32 // bits, -1),
                                       wf.view(1, -1, 1)) & ((1 << bits) - 1)
    weight = weight.reshape(-1, weight.shape[2])
    return scales[g_idx.long()].float() * (weight - zeros[g_idx.long()]).float()


@pytest.mark.parametrize("options", [{"group": 32, "desc_act": True, "sym": False},
                                     {"group": 64, "bits": 8, "desc_act": True},
                                     {"group": 128, "sym": False}])
def test_gptq_matches_autogptq_reference(options: dict) -> None:
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(5))
    q = quantize_linear("gptq", w, **options)
    t = q.tensors
    tool = autogptq_dequantize(t[".qweight"], t[".qzeros"], t[".scales"], t[".g_idx"],
                               options.get("bits", 4))
    assert torch.equal(read_back("gptq", q, **options).dequantize(), tool.T)


# ---------------------------------------------------------------- a whole checkpoint


@pytest.mark.parametrize(("fmt", "options"), [
    ("awq", {"group": 64}), ("gptq", {"group": 32, "desc_act": True}),
    ("w4a16", {"group": 128}), ("w8a8-int8", {}), ("fp8-block", {}), ("fp8-tensor", {}),
])
def test_model_directory(tmp_path: Path, fmt: str, options: dict) -> None:
    src = default_tiny_model_path("llama")
    dequantized = write_quantized(src, tmp_path, fmt, **options)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (tmp_path / "tokenizer.json").is_file()
    s = scheme_for(config, None)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f, \
            safe_open(str(Path(src) / "model.safetensors"), "pt") as orig:
        shapes = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()))
                  for k in f.keys()}
        modules = s.quantized_modules(shapes)
        assert sorted(p + ".weight" for p in modules) == sorted(dequantized)
        assert len(modules) == 4 * 7  # q k v o gate up down in each of 4 layers
        for prefix in modules:
            n, k = s.logical_shape(shapes, prefix, f.get_tensor)
            assert (n, k) == tuple(orig.get_slice(prefix + ".weight").get_shape())
            got = s.read(f.get_tensor, prefix, n, k)
            assert torch.equal(got.dequantize(), dequantized[prefix + ".weight"]), prefix
        dense = s.dense_tensors(shapes)
        assert "lm_head.weight" in dense and "model.embed_tokens.weight" in dense
        for name in dense:
            assert torch.equal(f.get_tensor(name), orig.get_tensor(name)), name
        assert not any(n.endswith(".input_scale") for n in dense)


# ---------------------------------------------------------------- header checks


def _bad_header(fmt: str, options: dict, name: str, value: TensorInfo | None
                ) -> tuple[QuantScheme, dict[str, TensorInfo], dict[str, torch.Tensor]]:
    q = quantize_linear(fmt, torch.randn(40, 128), **options)
    tensors = {PREFIX + k: v for k, v in q.tensors.items()}
    shapes = header(tensors)
    if value is None:
        del shapes[PREFIX + name]
    else:
        shapes[PREFIX + name] = value
    return scheme(fmt, **options), shapes, tensors


@pytest.mark.parametrize(("fmt", "options", "name", "value", "message"), [
    ("awq", {"group": 32}, ".qzeros", ("I32", (4, 4)),
     r"up_proj\.qzeros: I32 \(4, 4\), expected I32 \(4, 5\)"),
    ("awq", {"group": 32}, ".scales", None, r"up_proj\.scales: missing, expected"),
    ("awq", {"group": 32}, ".scales", ("I32", (4, 40)), r"up_proj\.scales: I32"),
    ("awq", {"group": 48}, ".qweight", ("I32", (128, 5)),
     r"up_proj\.qweight: 128 input features are not a multiple of group_size 48"),
    ("gptq", {"group": 32}, ".scales", ("F16", (4, 48)),
     r"up_proj\.scales: F16 \(4, 48\), expected F16/BF16/F32 \(4, 40\)"),
    ("gptq", {"group": 32, "desc_act": True}, ".g_idx", None, r"up_proj\.g_idx: missing"),
    ("gptq", {"group": 32}, ".qweight", ("I32", (16, 36)), r"36 outputs are not a multiple"),
    ("w4a16", {"group": 32}, ".weight_packed", ("I32", (40, 15)),
     r"up_proj\.weight_shape: \[40, 128\] does not match .*weight_packed \(40, 15\)"),
    ("w4a16", {"group": 32, "sym": False}, ".weight_zero_point", ("I32", (40, 4)),
     r"up_proj\.weight_zero_point: I32 \(40, 4\), expected I32 \(5, 4\)"),
    ("w8a8-int8", {}, ".weight_scale", ("BF16", (40, 2)),
     r"up_proj\.weight_scale: BF16 \(40, 2\), expected F16/BF16/F32 \(40, 1\)"),
    ("fp8-block", {}, ".weight_scale_inv", ("F32", (1, 2)),
     r"up_proj\.weight_scale_inv: F32 \(1, 2\), expected F16/BF16/F32 \(1, 1\)"),
    ("fp8-block", {}, ".weight", ("F8_E4M3", (40,)), r"up_proj\.weight: F8_E4M3 \(40,\)"),
])
def test_header_mismatch_names_the_tensor(fmt: str, options: dict, name: str,
                                          value: TensorInfo | None, message: str) -> None:
    s, shapes, tensors = _bad_header(fmt, options, name, value)
    with pytest.raises(ValueError, match=message):
        s.logical_shape(shapes, PREFIX, tensors.__getitem__)


def test_quantized_modules_and_ignore_lists() -> None:
    ct = scheme_for({"quantization_config": {
        **quantization_config("w4a16", group=32),
        "ignore": ["lm_head", "re:.*mlp.gate$", "model.layers.1.self_attn.o_proj"]}}, None)
    assert ct.quantized("model.layers.0.mlp.experts.7.gate_proj")
    assert not ct.quantized("model.layers.0.mlp.gate")  # the MoE router
    assert not ct.quantized("model.layers.1.self_attn.o_proj")
    assert ct.quantized("model.layers.10.self_attn.o_proj")
    assert not ct.quantized("lm_head")
    awq = scheme_for({"quantization_config": {**quantization_config("awq"),
                                              "modules_to_not_convert": ["visual"]}}, None)
    assert not awq.quantized("visual.blocks.0.attn.qkv") and not awq.quantized("lm_head")
    gptq = scheme_for({"quantization_config": {**quantization_config("gptq"), "lm_head": True,
                                               "dynamic": {r"-:.*\.layers\.0\..*": {}}}},
                      None)
    assert gptq.quantized("lm_head") and not gptq.quantized("model.layers.0.mlp.up_proj")
    assert gptq.quantized("model.layers.10.mlp.up_proj")
    shapes = {"model.layers.0.mlp.up_proj.qweight": ("I32", (16, 40))}
    with pytest.raises(ValueError, match=r"up_proj\.qweight: stored quantized \(I32\) but"):
        gptq.quantized_modules(shapes)
    with pytest.raises(ValueError, match=r"up_proj\.qzeros: no quantized .*up_proj\.qweight"):
        gptq.dense_tensors({"model.layers.0.mlp.up_proj.qzeros": ("I32", (1, 5))})
    optimum = scheme_for({"quantization_config": {
        **quantization_config("gptq"),
        "modules_in_block_to_quantize": [["self_attn.q_proj"], ["mlp.up_proj"]]}}, None)
    assert optimum.quantized("model.layers.3.self_attn.q_proj")
    assert not optimum.quantized("model.layers.3.self_attn.k_proj")


# ---------------------------------------------------------------- detection and refusals


def test_detection_and_requested_names() -> None:
    assert scheme_for({}, None) is None
    assert scheme_for({}, "gguf") is None
    assert scheme_for({"quantization_config": {"quant_method": "mxfp4"}}, None) is None
    gptq = {"quantization_config": quantization_config("gptq", sym=False)}
    assert scheme_for(gptq, "gptq_marlin").method == "gptq"
    assert scheme_for({"quantization_config": quantization_config("awq")}, "AWQ_Marlin").kind \
        == "w4"
    int8 = {"quantization_config": quantization_config("w8a8-int8")}
    assert scheme_for(int8, "w8a8_int8").kind == "w8"
    assert scheme_for(int8, "compressed_tensors").kind == "w8"
    assert scheme_for({"quantization_config": quantization_config("fp8-channel")},
                      "w8a8_fp8").kind == "fp8"
    sglang = {"quantization_config": {"quant_method": "w8a8_int8"}}
    assert scheme_for(sglang, None).tensor_suffixes() == (".weight", ".weight_scale")
    old = {"quantization_config": {"bits": 4, "group_size": 128, "desc_act": True}}
    assert scheme_for(old, "gptq").desc_act  # an old quantize_config.json: no quant_method


@pytest.mark.parametrize(("config", "requested", "message"), [
    ({}, "fp8", r"--quantization fp8: the checkpoint has no quantization_config"),
    ({}, "bitsandbytes", r"--quantization 'bitsandbytes' is not one of"),
    ({"quant_method": "gptq", "bits": 4}, "awq",
     r"--quantization awq does not match .*quant_method = 'gptq'"),
    ({"quant_method": "awq", "bits": 4}, "gguf", r"does not match"),
    ({"quant_method": "bitnet"}, None, r"quant_method = 'bitnet' is not supported"),
    ({"quant_method": "gptq", "bits": 3}, None, r"quantization_config\.bits = 3"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, None,
     r"quantization_config\.checkpoint_format = 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {r"+:.*down.*": {"bits": 8}}}, None,
     r"quantization_config\.dynamic\['\+:\.\*down\.\*'\]"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, None,
     r"quantization_config\.version = 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, None,
     r"quantization_config\.zero_point = False"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, None, r"quantization_config\.fmt = 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, None,
     r"quantization_config\.weight_block_size = \[128\]"),
])
def test_refusals_name_the_field(config: dict, requested: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        scheme_for({"quantization_config": config} if config else {}, requested)


def _ct(**changes: object) -> dict:
    cfg = quantization_config("w8a8-int8")
    group = cfg["config_groups"]["group_0"]
    for key, value in changes.items():
        where, _, field = key.partition("__")
        target = {"weights": group["weights"], "acts": group["input_activations"],
                  "top": cfg}[where]
        target[field] = value
    return {"quantization_config": cfg}


@pytest.mark.parametrize(("config", "requested", "message"), [
    (_ct(acts__symmetric=False), None, r"quantization_config\.symmetric = False"),
    (_ct(top__kv_cache_scheme={"num_bits": 8}), None, r"quantization_config\.kv_cache_scheme"),
    (_ct(weights__num_bits=4), None, r"quantization_config\.num_bits = 4"),
    (_ct(top__format="marlin-24"), None, r"quantization_config\.format = 'marlin-24'"),
    (_ct(top__quantization_status="frozen"), None, r"quantization_status = 'frozen'"),
    (_ct(weights__dynamic=True), None, r"quantization_config\.dynamic = True"),
    (_ct(), "w8a8_fp8", r"--quantization w8a8_fp8: the checkpoint's weights are w8"),
    (_ct(top__format="pack-quantized"), None, r"input_activations with pack-quantized"),
])
def test_compressed_tensors_refusals(config: dict, requested: str | None, message: str
                                     ) -> None:
    with pytest.raises(ValueError, match=message):
        scheme_for(config, requested)


def test_static_input_scales_are_dropped() -> None:
    s = scheme("fp8-tensor")
    assert s.ignored_suffixes() == (".input_scale",)
    s = scheme_for(_ct(acts__dynamic=False, acts__strategy="tensor"), None)
    assert s.ignored_suffixes() == (".input_scale",)
    mixed = _ct()
    groups = mixed["quantization_config"]["config_groups"]
    groups["group_1"] = json.loads(json.dumps(groups["group_0"]))
    groups["group_1"]["weights"]["strategy"] = "tensor"
    with pytest.raises(ValueError, match=r"config_groups: groups with different weight"):
        scheme_for(mixed, None)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from radixlm.tiny_families import make_family_model

    out = tmp_path_factory.mktemp("qwen3_moe")
    make_family_model(out, "qwen3_moe")
    return out


@pytest.mark.parametrize(("fmt", "options"), [
    ("awq", {"group": 32}), ("gptq", {"group": 32, "desc_act": True, "sym": False}),
    ("w4a16", {"group": 32}), ("fp8-block", {}),
])
def test_moe_experts(moe_model: Path, tmp_path: Path, fmt: str, options: dict) -> None:
    """Qwen3-MoE's experts (``mlp.experts.N.*_proj``) read like any linear; the routers
    (``mlp.gate``) stay float, and compressed-tensors' ignore says so."""
    dequantized = write_quantized(moe_model, tmp_path, fmt, **options)
    config = json.loads((tmp_path / "config.json").read_text())
    s = scheme_for(config, None)
    if fmt == "w4a16":
        assert not s.quantized("model.layers.0.mlp.gate")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()))
                  for k in f.keys()}
        modules = s.quantized_modules(shapes)
        assert sorted(p + ".weight" for p in modules) == sorted(dequantized)
        assert "model.layers.0.mlp.experts.7.down_proj" in modules
        assert "model.layers.0.mlp.gate.weight" in s.dense_tensors(shapes)
        for prefix in modules:
            n, k = s.logical_shape(shapes, prefix, f.get_tensor)
            got = s.read(f.get_tensor, prefix, n, k)
            assert torch.equal(got.dequantize(), dequantized[prefix + ".weight"]), prefix


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v1_zero_point_zero_borrows(bits: int) -> None:
    """v1 stores the qzeros words minus 0x11111111: a zero point of 0 (a group with
    nothing below zero) borrows from its neighbour, which only adding the word back
    undoes; adding 1 to each field (AutoGPTQ's reader) gets both fields wrong."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(6))
    w[:8, :32] = w[:8, :32].abs()  # zero point 0 in group 0 of rows 0..7
    q = quantize_linear("gptq", w, group=32, bits=bits, sym=False)
    got = read_back("gptq", q, group=32, bits=bits, sym=False)
    assert torch.equal(got.dequantize(), q.dequantized)
    t = q.tensors
    naive = autogptq_dequantize(t[".qweight"], t[".qzeros"], t[".scales"], t[".g_idx"], bits)
    assert not torch.equal(naive.T, q.dequantized)
