"""radixlm against vLLM's CPU build, side by side (``benchmarks/vllm_side_by_side.py``).

Only the standard library at import time: ``workloads`` and ``worker`` also run under vLLM's
own venv, which has no radixlm.
"""
