"""transformers as the oracle of greedy tokens: a checkpoint's eager float32 model, its
``generate`` without sampling and without stopping at EOS (as ``ignore_eos``)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def hf_greedy(path: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """The ``max_new`` greedy output ids of each prompt."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
