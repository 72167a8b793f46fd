"""llama.cpp's own ``convert_hf_to_gguf.py``, run with two in-memory patches:
``python -m llamacpp_side.convert LLAMA_CPP_DIR HF_DIR OUT.gguf OUTTYPE``.

The script (and its ``conversion/`` package and ``gguf-py``) come from the
``llama-cpp-python`` sdist's ``vendor/llama.cpp``; nothing of theirs is edited on disk.

- The pre-tokenizer: the script hashes how the tokenizer splits a fixed text and refuses a
  hash it does not list (``get_vocab_base_pre``). radixlm's built-in tokenizer is
  byte-level BPE with GPT-2's split regex (``ByteLevel(use_regex=True)``, no prefix space,
  no normalizer), which is llama.cpp's ``gpt-2`` pre-tokenizer. A listed hash is still
  answered by their code; only the refusal becomes ``gpt-2``.
- SentencePiece: a Llama directory is first tried as a SentencePiece one, which imports
  ``sentencepiece`` before it looks for ``tokenizer.model``. Without the package (this venv
  has none) a directory without that file raises FileNotFoundError, as it would with the
  package installed; the script then falls back to the BPE vocabulary.
"""

from __future__ import annotations

import logging
import runpy
import sys
from pathlib import Path

logger = logging.getLogger(__name__)
FALLBACK_PRE = "gpt-2"  # the split regex of radixlm's tokenizer (see the module docstring)


def patch(text_model: type) -> None:
    """Wrap ``text_model``'s pre-tokenizer lookup and SentencePiece reader (see above)."""
    lookup = text_model.get_vocab_base_pre
    read_sentencepiece = text_model._create_vocab_sentencepiece

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return lookup(self, tokenizer)
        except NotImplementedError:
            logger.warning("pre-tokenizer hash not in llama.cpp's list: written as %r",
                           FALLBACK_PRE)
            return FALLBACK_PRE

    def create_vocab_sentencepiece(self):
        if not (Path(self.dir_model) / "tokenizer.model").is_file():
            raise FileNotFoundError(f"File not found: {self.dir_model}/tokenizer.model")
        return read_sentencepiece(self)

    text_model.get_vocab_base_pre = get_vocab_base_pre
    text_model._create_vocab_sentencepiece = create_vocab_sentencepiece


def convert(llama_cpp_dir: Path, hf_dir: Path, out: Path, outtype: str) -> None:
    """Run their script in this process as ``convert_hf_to_gguf.py HF_DIR --outfile OUT
    --outtype OUTTYPE``, their ``gguf-py`` ahead of any installed ``gguf``."""
    script = llama_cpp_dir / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(f"no convert_hf_to_gguf.py in {llama_cpp_dir}")
    sys.path[:0] = [str(llama_cpp_dir / "gguf-py"), str(llama_cpp_dir)]
    from conversion import base  # theirs, found through the path above

    patch(base.TextModel)
    sys.argv = [str(script), str(hf_dir), "--outfile", str(out), "--outtype", outtype]
    runpy.run_path(str(script), run_name="__main__")


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO)
    llama_cpp_dir, hf_dir, out, outtype = argv
    convert(Path(llama_cpp_dir), Path(hf_dir), Path(out), outtype)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
