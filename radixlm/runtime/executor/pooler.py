"""Pooling of an embedding model (``--is-embedding``): which final hidden states make a
request's embedding, and whether it is L2-normalised.

The checkpoint names it the sentence-transformers way: ``modules.json`` lists the
modules after the transformer, and the ``Pooling`` module's ``config.json`` (usually
``1_Pooling/config.json``) sets one ``pooling_mode_*`` flag. A checkpoint without
``modules.json`` gets what SGLang and vLLM give a decoder (Qwen3-Embedding, gte-Qwen2,
e5-mistral): the last token's hidden state, normalised.

    last  the last prompt token (``pooling_mode_lasttoken``)
    mean  the mean over every prompt token (``pooling_mode_mean_tokens``)
    cls   the first token (``pooling_mode_cls_token``)

The hidden states are those after the final norm, as transformers' ``last_hidden_state``
and sentence-transformers' ``token_embeddings``. With ``modules.json`` the vector is
normalised iff it lists a ``Normalize`` module (vLLM reads it so); modules radixlm does
not apply (``Dense``, ``max`` / ``weightedmean`` pooling, ...) are refused at start-up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

POOLING_METHODS = ("last", "mean", "cls")
_ST_PREFIX = "sentence_transformers.models."
_ST_APPLIED = ("Transformer", "Pooling", "Normalize")
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}
_ST_REFUSED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                     "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolingConfig:
    method: str  # one of POOLING_METHODS
    normalize: bool
    source: str  # where it was read from (logged, /get_server_info)

    @property
    def needs_every_token(self) -> bool:
        """Whether every prompt token's hidden state is read (mean) or the first's (cls):
        a radix-cache hit keeps K/V, not hidden states, so these prompts are computed in
        full. Last-token pooling reuses any cached prefix (the last token is computed)."""
        return self.method != "last"

    @staticmethod
    def from_model_dir(model_dir: str | Path) -> PoolingConfig:
        """The checkpoint's pooling; ValueError naming the file and what it asks for when
        radixlm cannot apply it."""
        root = Path(model_dir)
        modules_path = root / "modules.json"
        if not modules_path.is_file():
            return PoolingConfig("last", True, "default (no modules.json): last token, "
                                 "normalized, as SGLang and vLLM pool decoders")
        modules = json.loads(modules_path.read_text())
        kinds = [str(m.get("type", "")).removeprefix(_ST_PREFIX) for m in modules]
        unknown = [k for k in kinds if k not in _ST_APPLIED]
        if unknown:
            raise ValueError(f"{modules_path} lists sentence-transformers modules radixlm "
                             f"does not apply: {unknown} (supported: {list(_ST_APPLIED)})")
        pooling = [m for m, k in zip(modules, kinds) if k == "Pooling"]
        method = "last"
        if pooling:
            config_path = root / pooling[0].get("path", "1_Pooling") / "config.json"
            method = _st_pooling_method(config_path)
        return PoolingConfig(method, "Normalize" in kinds, f"{modules_path}")


def _st_pooling_method(config_path: Path) -> str:
    config = json.loads(config_path.read_text())
    refused = [k for k in _ST_REFUSED_MODES if config.get(k)]
    if refused:
        raise ValueError(f"{config_path}: {refused} pooling is not supported (supported: "
                         f"{list(_ST_MODES)})")
    chosen = [method for key, method in _ST_MODES.items() if config.get(key)]
    if len(chosen) != 1:
        raise ValueError(f"{config_path} must set exactly one of {list(_ST_MODES)}, "
                         f"got {chosen or 'none'}")
    return chosen[0]


def finish_pooling(pooled: torch.Tensor, num_tokens: int, config: PoolingConfig) -> bytes:
    """The embedding of one request as little-endian float32 bytes (OpenAI's base64
    layout): ``pooled`` is the summed rows for mean pooling, else the one row."""
    vec = pooled.float()
    if config.method == "mean":
        vec = vec / num_tokens
    if config.normalize:
        vec = F.normalize(vec, p=2.0, dim=-1)  # sentence-transformers' Normalize
    return vec.cpu().contiguous().numpy().astype("<f4").tobytes()
