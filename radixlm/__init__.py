"""radixlm: an SGLang-style structured generation runtime."""
