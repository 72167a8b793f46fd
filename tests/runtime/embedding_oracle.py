"""transformers as the oracle of embeddings: the base model's ``last_hidden_state``
(after the final norm), pooled and L2-normalised as sentence-transformers does, in
float32; and checkpoints that name their pooling the sentence-transformers way."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

TOLERANCE = 1e-5  # the bound, float32


@functools.cache
def _hf(model_dir: str) -> tuple[torch.nn.Module, object]:
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def token_ids(model_dir: Path, text: str) -> list[int]:
    """The ids sentence-transformers embeds: the tokenizer's special tokens included."""
    return _hf(str(model_dir))[1](text)["input_ids"]


def embed(model_dir: Path, ids: list[int], method: str = "last",
          normalize: bool = True) -> torch.Tensor:
    model, _ = _hf(str(model_dir))
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]  # [tokens, hidden]
    vec = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[method]
    return F.normalize(vec, p=2.0, dim=-1) if normalize else vec


def max_error(got: list[float], want: torch.Tensor) -> float:
    return (torch.tensor(got, dtype=torch.float64) - want.double()).abs().max().item()


def pooled_checkpoint(base: Path, dest: Path, method: str, normalize: bool) -> Path:
    """``base``'s files (linked) plus modules.json and 1_Pooling/config.json naming
    ``method`` (last|mean|cls) and, if ``normalize``, a Normalize module."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if not (dest / f.name).exists():
            os.symlink(f, dest / f.name)
    kinds = ["Transformer", "Pooling"] + (["Normalize"] if normalize else [])
    modules = [{"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{k}"}
               for i, (k, p) in enumerate(zip(kinds, ["", "1_Pooling", "2_Normalize"]))]
    (dest / "modules.json").write_text(json.dumps(modules))
    key = {"last": "lasttoken", "mean": "mean_tokens", "cls": "cls_token"}[method]
    (dest / "1_Pooling").mkdir(exist_ok=True)
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 0, f"pooling_mode_{key}": True}))
    return dest
