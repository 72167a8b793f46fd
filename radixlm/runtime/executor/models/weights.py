"""Stream a Hugging Face safetensors checkpoint into a model, one tensor at a time.

The model says where each checkpoint tensor goes (``checkpoint_layout``: the same name,
or rows of a fused q/k/v or gate/up parameter, and under tensor parallelism which slice of
the tensor this rank holds); tensors the engine recomputes (RoPE tables) are skipped. A
rank reads only its slices (``safe_open(...).get_slice``), so it holds about 1/tp_size of
the weights and never a whole tensor it splits. Every shape is checked from the safetensors
headers before any parameter is written, so a checkpoint that does not fit leaves the
model as it was (startup, and ``/update_weights_from_disk`` through ``config_differences``).
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from torch import nn

from radixlm.runtime.distributed.layers import Placement, Shard
from radixlm.runtime.executor.models import mxfp4
from radixlm.runtime.model_config import SLIDING, ModelConfig, rope_scaling_of, rope_theta_of

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Checkpoint tensors the engine does not load: it recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's files: the shards named by the index, else ``model.safetensors``,
    else every ``*.safetensors`` in the directory."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir}")
    return files


class LoadTarget(NamedTuple):
    """A parameter (or rows of one) and the slice of the checkpoint tensor it receives
    (None: the whole tensor), and the placement it came from (which parameter, which rows:
    where a quantized checkpoint's weight goes, ``executor/quant/loader.py``)."""

    tensor: torch.Tensor
    shard: Shard | None = None
    place: Placement | None = None


def _read(files: dict[str, Any], name: str, shard: Shard | None) -> torch.Tensor:
    """The tensor ``name`` (in the open safetensors file ``files[name]``), or only ``shard``
    of it; an MXFP4 pair (``X_blocks`` / ``X_scales``) dequantized (``mxfp4.py``)."""
    index = () if shard is None else (slice(None),) * shard.dim + (slice(shard.start,
                                                                         shard.stop),)
    scales = name.removesuffix(mxfp4.BLOCKS) + mxfp4.SCALES
    if name.endswith(mxfp4.BLOCKS) and scales in files:
        return mxfp4.read(files[name], files[scales], name, index)
    return files[name].get_tensor(name) if shard is None else files[name].get_slice(name)[index]


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every checkpoint tensor, read from the safetensors headers only;
    an MXFP4 pair as one ``X_blocks`` of the dequantized shape (``mxfp4.logical_shapes``)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return mxfp4.logical_shapes(shapes)


def plan_load(model: nn.Module, model_dir: str | Path, optional: tuple[str, ...] = (),
              shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, LoadTarget]:
    """checkpoint name -> the parameter (or rows of one) it is copied into and this rank's
    slice of it, after checking every tensor's presence and shape from the headers; no
    weight is read or touched. Raises ValueError naming missing, unexpected and misshapen
    tensors; those in ``optional`` may be missing (an embedding model's LM head).

    A checkpoint tensor placed as a tuple fills several parameters (or row ranges) from
    slices of itself (Phi-3's fused qkv_proj under tensor parallelism: this rank's q, k and
    v rows). A parameter shared by two names (tied embeddings: ``lm_head.weight`` is
    ``model.embed_tokens.weight``) is expected once, under its first name. A model with
    ``canonical_checkpoint_name`` maps the file's names to its layout's first (None: skip
    the tensor); the returned keys are the file's names. A base model's checkpoint
    (transformers' ``AutoModel``: ``layers.0...`` for ``model.layers.0...``, as embedding
    checkpoints are saved) fills the same parameters. ``shapes``: the checkpoint's tensors
    and shapes when they come from elsewhere than ``model_dir``'s safetensors headers (a
    quantized checkpoint's logical weights: ``executor/quant/loader.py``).
    """
    params = dict(model.named_parameters())
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - params.keys()
    layout = model.checkpoint_layout()  # checkpoint name -> Placement
    # a wrapper's names (a multimodal checkpoint's language model) -> the layout's; None:
    # a tensor the model does not use (its vision tower)
    canonical = getattr(model, "canonical_checkpoint_name", lambda n: n)
    targets: dict[str, tuple[LoadTarget, ...]] = {}
    found: set[str] = set()
    unexpected: list[str] = []
    misshapen: list[str] = []
    if shapes is None:
        shapes = checkpoint_shapes(model_dir)
    for file_name, shape in shapes.items():
        name = canonical(file_name)
        if name is None or name in tied or name.endswith(_IGNORED_SUFFIXES):
            continue
        if name not in layout and f"model.{name}" in layout:  # a base model's names
            name = f"model.{name}"
        if name not in layout:
            unexpected.append(file_name)
            continue
        found.add(name)
        places = (layout[name],) if isinstance(layout[name], Placement) else layout[name]
        targets[file_name] = tuple(_target(params, place) for place in places)
        expected = {_expected_shape(name, t) for t in targets[file_name]}
        if expected != {shape}:
            misshapen.append(f"{file_name} {shape} (expected {' or '.join(map(str, expected))})")
    missing = sorted(layout.keys() - found - set(optional))
    if missing or unexpected or misshapen:
        hint = ("; a checkpoint without an LM head serves embeddings only (--is-embedding)"
                if missing == ["lm_head.weight"] else "")
        raise ValueError(
            f"checkpoint in {model_dir} does not match the model: "
            f"missing tensors {_short(missing)}, unexpected tensors {_short(unexpected)}, "
            f"tensors of another shape {_short(misshapen)}{hint}"
        )
    return targets


def _target(params: dict[str, nn.Parameter], place: Placement) -> LoadTarget:
    param_name, rows, shard, transposed = place
    tensor = params[param_name] if rows is None else params[param_name][rows]
    return LoadTarget(tensor.transpose(-1, -2) if transposed else tensor, shard, place)


def _expected_shape(name: str, target: LoadTarget) -> tuple[int, ...]:
    """The checkpoint shape ``target`` expects: its own, with ``shard.full`` rows along the
    sharded dim (this rank holds ``shard.size`` of them)."""
    expected = list(target.tensor.shape)
    if target.shard is not None:
        shard = target.shard
        assert expected[shard.dim] == shard.size, f"{name}: {expected} vs {shard}"
        expected[shard.dim] = shard.full
    return tuple(expected)


def copy_weights(targets: dict[str, tuple[LoadTarget, ...]], model_dir: str | Path) -> None:
    """Stream the checkpoint into ``targets`` (from ``plan_load``), one tensor (or this
    rank's slice of one) at a time, casting to each parameter's dtype and device: peak
    extra memory is one slice."""
    with torch.no_grad(), ExitStack() as stack:
        files: dict[str, Any] = {}  # name -> its open file (an MXFP4 pair may be split)
        for path in safetensors_files(model_dir):
            f = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            files.update(dict.fromkeys(f.keys(), f))
        for name, place in targets.items():
            for target in place:
                target.tensor.copy_(_read(files, name, target.shard))
    logger.info("loaded %d tensors from %s", len(targets), model_dir)


def load_weights(model: nn.Module, model_dir: str | Path, optional: tuple[str, ...] = ()) -> None:
    """Check the whole checkpoint against the model (``plan_load``: shapes, missing and
    unexpected tensors), then copy it in. Nothing is copied if anything differs."""
    copy_weights(plan_load(model, model_dir, optional), model_dir)


# ModelConfig fields a checkpoint swapped in at runtime must share with the served one:
# they fix parameter shapes, the KV pool's layout, RoPE tables and stop tokens.
SWAP_FIELDS = (
    "architectures", "hidden_size", "num_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps",
    "rope_theta", "rope_scaling", "max_position_embeddings", "tie_word_embeddings",
    "attention_bias", "qkv_bias", "mlp_bias", "sliding_window", "eos_token_ids",
    "layer_types", "partial_rotary_factor",
)


def config_differences(served: ModelConfig, new: ModelConfig) -> list[str]:
    """``field: served -> new`` for every SWAP_FIELDS entry that differs, and the RoPE of
    sliding layers (Gemma 3's own base)."""
    diffs = [f"{f}: {getattr(served, f)!r} -> {getattr(new, f)!r}" for f in SWAP_FIELDS
             if getattr(served, f) != getattr(new, f)]
    for name, of in (("sliding-layer rope_theta", rope_theta_of),
                     ("sliding-layer rope_scaling", rope_scaling_of)):
        old_value, new_value = of(served.hf_config, SLIDING), of(new.hf_config, SLIDING)
        if old_value != new_value:
            diffs.append(f"{name}: {old_value!r} -> {new_value!r}")
    return diffs


def _short(names: list[str], limit: int = 8) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return f"[{', '.join(names[:limit])}{more}]" if names else "[]"
