"""The KV memory one long context needs with and without the SWA pool
(``--enable-hybrid-swa-memory``), computed from a transformers config, and measured on a
tiny model.

    python benchmarks/swa_pool.py [--context 32768] [--page-size 16] [--chunk 2048]
                                  [--config path/to/config.json] [--measure]

Computed: without the SWA pool every layer keeps all ``--context`` tokens; with it, full
layers keep them all and sliding layers at most ``window + 4 pages + chunk`` (what a
request holds while a prefill chunk runs: ``swa_pool.py``; its lock on the tree's window
of its cached prefix adds up to one window more, briefly). Shapes: Gemma 3 12B (48 layers,
5 sliding : 1 full, window 1024, 8 KV heads of 256) and Mistral 7B v0.1 (32 sliding layers,
window 4096, 8 KV heads of 128), built with transformers' config classes (no download), in
bfloat16; ``--config`` adds one. ``--measure``: a tiny Gemma 3 (window 24) runs one request
of 600 tokens with the SWA pool on, and the most sliding slots held before any forward
(by the request and its lock on the cached prefix, not the tree's evictable pages) is
printed beside the pool sizes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import transformers

SHAPES = {
    "gemma3-12b": lambda: transformers.Gemma3TextConfig(
        hidden_size=3840, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
        head_dim=256, sliding_window=1024, intermediate_size=15360),
    "mistral-7b": lambda: transformers.MistralConfig(sliding_window=4096),
}


def layer_split(config: transformers.PretrainedConfig) -> tuple[int, int, int]:
    """(full layers, sliding layers, window) of a transformers config."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window:
        return n, 0, 0
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * n
    sliding = sum(t == "sliding_attention" for t in types)
    return n - sliding, sliding, window


def pool_bytes(config: transformers.PretrainedConfig, context: int, page: int, chunk: int,
               itemsize: int = 2) -> dict[str, float]:
    full, sliding, window = layer_split(config)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size
                                                     // config.num_attention_heads)
    per_layer_token = 2 * config.num_key_value_heads * head_dim * itemsize  # K and V
    swa_slots = min(context, window + 4 * page + chunk) if sliding else 0
    one = context * (full + sliding) * per_layer_token
    two = (context * full + swa_slots * sliding) * per_layer_token
    return {"full_layers": full, "sliding_layers": sliding, "window": window,
            "sliding_slots": swa_slots, "one_pool_gib": one / 2**30,
            "swa_pool_gib": two / 2**30, "ratio": one / two if two else float("inf")}


def measure(prompt_len: int = 600, new: int = 40) -> dict[str, int]:
    """A tiny Gemma 3 with the SWA pool: the most sliding slots in use before a forward."""
    from radixlm import Engine
    from radixlm.tiny_families import make_family_model

    with tempfile.TemporaryDirectory() as d:
        path = make_family_model(Path(d) / "gemma3", "gemma3")
        eng = Engine(model_path=str(path), enable_hybrid_swa_memory=True, page_size=4,
                     chunked_prefill_size=64, max_total_tokens=1024,
                     swa_full_tokens_ratio=0.125, cpu_threads=1, random_seed=0)
        try:
            cache, runner = eng.scheduler.cache, eng.scheduler.model_runner
            most = [0]
            forward = runner.forward

            def watched(batch, req_to_token):
                most[0] = max(most[0], cache.swa.size - cache.allocator.swa_available_size()
                              - cache.tree.swa_evictable_size())
                return forward(batch, req_to_token)

            runner.forward = watched
            eng.generate(input_ids=[(7 * i) % 500 + 3 for i in range(prompt_len)],
                         sampling_params={"max_new_tokens": new, "temperature": 0,
                                          "ignore_eos": True})
            return {"request_tokens": prompt_len + new, "window": cache.swa.window,
                    "full_pool": cache.pool_size, "sliding_pool": cache.swa.size,
                    "most_sliding_slots_used": most[0]}
        finally:
            eng.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--config", help="a config.json of another model")
    p.add_argument("--measure", action="store_true")
    a = p.parse_args()
    configs = {name: make() for name, make in SHAPES.items()}
    if a.config:
        configs[a.config] = transformers.AutoConfig.from_pretrained(Path(a.config).parent)
    for name, config in configs.items():
        row = pool_bytes(config, a.context, a.page_size, a.chunk)
        print(json.dumps({"model": name, "context": a.context, **{
            k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}}))
    if a.measure:
        print(json.dumps({"measured": measure()}))


if __name__ == "__main__":
    main()
