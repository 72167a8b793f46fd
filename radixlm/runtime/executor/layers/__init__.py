"""The building blocks the model families compose (after SGLang's ``srt/layers``):

- ``norm``: RMSNorm (``w`` or Gemma's ``1 + w``), fused residual add, per-head q/k norms;
- ``rotary``: RoPE tables (default, linear, llama3, yarn, longrope), partial rotary;
- ``activation``: the gated MLP's SiLU and GELU-tanh, gpt-oss's clamped SwiGLU;
- ``attention``: ``RadixAttention`` over the paged pool, with sliding windows, logit
  soft-capping, attention sinks and the score scale per layer;
- ``logits``: the lm_head with logits scaling and final soft-capping.
- ``moe``: mixture of experts (router, each family's routing rule, stacked experts run one
  matmul pair per active expert).

The tensor-parallel linear layers and embeddings live in ``runtime/distributed/layers.py``.
"""
