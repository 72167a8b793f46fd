"""Requests that share a prefix nobody has computed yet compute it once: the first runs,
the others wait until the tree holds it — also while the first is still in the middle of
a chunked prefill (its next chunk computes the tokens the others would)."""

from __future__ import annotations

import random

PREFIX, SUFFIX = 100, 8


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(5, 400) for _ in range(PREFIX)]
    return [prefix + [rng.randrange(5, 400) for _ in range(SUFFIX)] for _ in range(n)]


def test_a_shared_prefix_is_computed_once_across_chunks(make_engine):
    eng = make_engine(chunked_prefill_size=64, max_total_tokens=2048, dtype="float32")
    prompts = _prompts(4)
    outs = eng.generate(input_ids=prompts,
                        sampling_params={"max_new_tokens": 2, "temperature": 0})
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    # the first computes the prefix (in two chunks); each other one finds all of it
    assert cached == [0, PREFIX, PREFIX, PREFIX], cached
    alone = make_engine(max_total_tokens=2048, dtype="float32")
    for prompt, out in zip(prompts, outs):
        want = alone.generate(input_ids=prompt,
                              sampling_params={"max_new_tokens": 2, "temperature": 0})
        assert out["output_ids"] == want["output_ids"]
