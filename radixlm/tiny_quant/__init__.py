"""Our own writers of quantized checkpoints (GGUF, ...) for tests and benchmarks: a Hugging
Face model directory in, a file in the format's own layout out."""
