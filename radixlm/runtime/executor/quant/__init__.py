"""Quantized checkpoints: reading each format's tensors (GGUF blocks, ...) into
``kernels.qweight.QuantWeight`` and loading them into a model."""
