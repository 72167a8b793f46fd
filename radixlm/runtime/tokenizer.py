"""Loading the model directory's tokenizer (local files only; nothing is downloaded)."""

from __future__ import annotations

import os
from typing import Any

from radixlm.runtime import gguf_file
from radixlm.runtime.model_dir import ModelDirError
from radixlm.tiny_model import default_tiny_model_path


def resolve_model_path(model_path: str | None, load_format: str = "auto") -> str:
    """A local model directory; None means the built-in tiny model (built on first use).
    A GGUF file (``.gguf``, or any file with ``load_format`` gguf) becomes the directory
    its metadata describes (``gguf_file.view_dir_for``: config.json, tokenizer files, the
    weights read from the file itself)."""
    if model_path is None:
        return str(default_tiny_model_path())
    if os.path.isfile(model_path) and (load_format == "gguf" or (
            load_format == "auto" and model_path.lower().endswith(".gguf"))):
        try:
            return str(gguf_file.view_dir_for(model_path))
        except gguf_file.GGUFError as e:  # one line at start-up, like a bad directory's
            raise ModelDirError(str(e)) from None
    if load_format == "gguf":
        raise ModelDirError(f"load_format gguf needs model_path to be a GGUF file, got "
                            f"{model_path!r}")
    if not os.path.isdir(model_path):
        raise ModelDirError(f"model_path {model_path!r} is not a local directory or .gguf "
                            "file (radixlm loads checkpoints from disk; nothing is downloaded)")
    return model_path


def load_tokenizer(path: str) -> Any:
    # imported here: transformers imports torch (seconds), and a server's start reads
    # resolve_model_path before its children are spawned
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def gguf_served_name(model_path: str | None, resolved: str) -> str | None:
    """The name a GGUF file serves under when ``--served-model-name`` is not given: the
    file's name (the view directory's is a digest); None for a directory."""
    if model_path is None or resolved == model_path:
        return None
    return os.path.basename(model_path)
