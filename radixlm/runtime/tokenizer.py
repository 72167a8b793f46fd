"""Loading the model directory's tokenizer (local files only; nothing is downloaded)."""

from __future__ import annotations

import os
from typing import Any

from radixlm.runtime.model_dir import ModelDirError
from radixlm.tiny_model import default_tiny_model_path


def resolve_model_path(model_path: str | None) -> str:
    """A local model directory; None means the built-in tiny model (built on first use)."""
    if model_path is None:
        return str(default_tiny_model_path())
    if not os.path.isdir(model_path):
        raise ModelDirError(f"model_path {model_path!r} is not a local directory (radixlm "
                            "loads Hugging Face checkpoints from disk; nothing is downloaded)")
    return model_path


def load_tokenizer(path: str) -> Any:
    # imported here: transformers imports torch (seconds), and a server's start reads
    # resolve_model_path before its children are spawned
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
