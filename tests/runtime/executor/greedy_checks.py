"""The engine-configuration check the family tests share: greedy tokens equal to
transformers' cold and again from the radix cache, ``n`` samples where the config says so,
and the retraction a tiny pool is meant to force."""

from __future__ import annotations


def check_greedy(eng, arch: str, config: str, prompts: list[list[int]],
                 expected: list[list[int]], max_new: int) -> None:
    n = 2 if config.endswith("_n2") else 1
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, "n": n}
    want = [e for e in expected for _ in range(n)]
    for attempt in ("cold", "radix hit"):
        got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
        assert got == want, f"{arch} {config} {attempt}: engine {got} != {want}"
    info = eng.get_server_info()
    assert info["cache_hit_rate"] > 0
    if config.startswith("tiny_pool"):
        assert info["num_preemptions"] > 0, "the pool was meant to retract"
