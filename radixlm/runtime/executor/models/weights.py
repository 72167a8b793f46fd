"""Stream a Hugging Face safetensors checkpoint into a model, one tensor at a time.

The model says where each checkpoint tensor goes (``checkpoint_layout``: the same name,
or rows of a fused q/k/v or gate/up parameter); tensors the engine recomputes (RoPE
tables) are skipped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

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


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) pairs, one shard open at a time."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Copy every checkpoint tensor into the same-named parameter (casting to its dtype
    and device). Raises ValueError naming missing, unexpected or misshapen tensors.

    A parameter shared by two names (tied embeddings: ``lm_head.weight`` is
    ``model.embed_tokens.weight``) is expected once, under its first name.
    """
    params = dict(model.named_parameters())
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - params.keys()
    layout = model.checkpoint_layout()  # checkpoint name -> (parameter, rows)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in iter_safetensors(model_dir):
        if name in tied or name.endswith(_IGNORED_SUFFIXES):
            continue
        if name not in layout:
            unexpected.append(name)
            continue
        param_name, rows = layout[name]
        target = params[param_name] if rows is None else params[param_name][rows]
        if target.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(target.shape)} (in {model_dir})"
            )
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(name)
    missing = sorted(layout.keys() - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {model_dir} does not match the model: "
            f"missing tensors {_short(missing)}, unexpected tensors {_short(unexpected)}"
        )
    logger.info("loaded %d tensors from %s", len(loaded), model_dir)


def _short(names: list[str], limit: int = 8) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return f"[{', '.join(names[:limit])}{more}]" if names else "[]"
