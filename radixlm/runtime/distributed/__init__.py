"""Tensor parallelism: process groups (``parallel_state``) and the layers that split a
model over them (``layers``). Imports nothing of radixlm but the shared modules."""
