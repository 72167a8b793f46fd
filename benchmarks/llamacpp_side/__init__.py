"""radixlm against llama.cpp (``llama-cpp-python``), side by side on the same GGUF files
(``benchmarks/llamacpp_side_by_side.py``).

Only the standard library at import time: ``llama_worker`` runs under llama.cpp's own venv
(numpy and ``llama_cpp``, no radixlm, no torch) and ``convert`` under this repository's venv
with llama.cpp's vendored ``gguf-py`` first on its path.
"""
