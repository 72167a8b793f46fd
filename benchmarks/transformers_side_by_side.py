"""Offline throughput on three workloads, radixlm.Engine against transformers `generate`
(static batches) and transformers' continuous batching (paged KV cache, requests joining
and leaving the batch), side by side in one process, alternating, medians of rounds:

- shared-prefix: 4 groups x 8 prompts, a 512-token system prompt per group + 32-token
  questions, 32 output tokens (transformers: one static batch, no padding needed);
- unique: 32 prompts of 256 random tokens, 64 output tokens (one static batch);
- variable: 48 prompts of 16-512 tokens with 8-128 output tokens (transformers: left-padded
  batches of 16 in arrival order, each generating its batch's longest output; only the
  requested tokens count).

    .venv/bin/python benchmarks/transformers_side_by_side.py --preset small
    .venv/bin/python benchmarks/transformers_side_by_side.py --workload unique --rounds 5

Greedy, EOS ignored. Also prints the engine's share of the machine's measured float32
matmul peak (model FLOPs: 2 x non-embedding parameters per token, plus attention).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import radixlm
from radixlm.tiny_model import add_model_args, resolve_model

Request = tuple[list[int], int]  # prompt ids, output tokens


def workload(name: str, vocab: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    if name == "shared-prefix":
        out = []
        for _ in range(4):
            system = ids(512)
            out += [(system + ids(32), 32) for _ in range(8)]
        return out
    if name == "unique":
        return [(ids(256), 64) for _ in range(32)]
    if name == "variable":
        return [(ids(rng.randint(16, 512)), rng.randint(8, 128)) for _ in range(48)]
    raise ValueError(name)


def run_engine(eng: radixlm.Engine, reqs: list[Request]) -> float:
    eng.flush_cache()
    sps = [{"max_new_tokens": o, "temperature": 0, "ignore_eos": True} for _, o in reqs]
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=[p for p, _ in reqs], sampling_params=sps)
    dt = time.perf_counter() - t0
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [o for _, o in reqs]
    return dt


def run_hf(model, reqs: list[Request], batch: int) -> tuple[float, int]:
    """Seconds, and tokens computed (prompt padding and generated tokens included)."""
    total, computed = 0.0, 0
    for i in range(0, len(reqs), batch):
        part = reqs[i: i + batch]
        width = max(len(p) for p, _ in part)
        out_len = max(o for _, o in part)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in part])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in part])
        with torch.no_grad():
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=out_len,
                           min_new_tokens=out_len, do_sample=False, pad_token_id=0)
            total += time.perf_counter() - t0
        computed += len(part) * (width + out_len)
    return total, computed


def run_hf_cb(model, reqs: list[Request]) -> float:
    """transformers' continuous batching (``continuous_batching_context_manager``: paged KV
    cache, requests joining and leaving the batch): seconds from the first request queued to
    the last one finished; each request generates exactly its own output length."""
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(o for _, o in reqs),
                          pad_token_id=0)
    # sized as the engine is: room for every request at once, 2048-token forwards (the
    # engine's chunked prefill), every request in one batch (transformers' own defaults,
    # which cannot size the cache on a CPU, measured 1.5x slower on the unique workload)
    tokens = sum(len(p) + o for p, o in reqs)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=tokens // 16 + 2 * len(reqs) + 16,
                                  max_batch_tokens=2048, max_requests_per_batch=len(reqs))
    with model.continuous_batching_context_manager(generation_config=gc, block=True,
                                                   continuous_batching_config=cb,
                                                   timeout=5) as manager:
        t0 = time.perf_counter()
        rids = [manager.add_request(p, max_new_tokens=o, eos_token_id=-1) for p, o in reqs]
        done: dict[str, int] = {}
        while len(done) < len(rids):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                assert out.error is None, out.error
                done[out.request_id] = len(out.generated_tokens)
        dt = time.perf_counter() - t0
    assert [done[r] for r in rids] == [o for _, o in reqs], "outputs of the wrong length"
    return dt


def matmul_peak_gflops(threads: int) -> float:
    """The faster of torch's matmul and oneDNN's over a prepacked weight (what the engine
    uses on a CPU), 2048 x 2048 x 2048 in float32."""
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    packed = torch.ops.mkldnn._reorder_linear_weight(b, None)

    def onednn():
        return torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")

    best = 0.0
    for fn in (lambda: a @ b, onednn):
        for _ in range(3):
            fn()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        best = max(best, 10 * 2 * 2048**3 / (time.perf_counter() - t0) / 1e9)
    return best


def model_flops(cfg, reqs: list[Request], cached: int) -> float:
    """2 x non-embedding parameters per computed token, the LM head for each output token
    (prompt tokens need no logits), plus the attention's QK and PV."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_token = 2 * layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)
    tokens = sum(len(p) + o for p, o in reqs) - cached
    head = 2 * h * cfg.vocab_size * sum(o for _, o in reqs)
    attn = sum(2 * 2 * layers * q * (len(p) + o) ** 2 / 2 for p, o in reqs)
    return tokens * per_token + head + attn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", nargs="+", default=["shared-prefix", "unique", "variable"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hf-batch", type=int, default=16, help="transformers batch (variable)")
    ap.add_argument("--no-cb", action="store_true",
                    help="skip transformers' continuous batching")
    add_model_args(ap)
    args = ap.parse_args()
    path = resolve_model(args.model_path, args.preset)
    threads = torch.get_num_threads()
    eng = radixlm.Engine(model_path=path, random_seed=0, cpu_threads=threads,
                         max_total_tokens=65536)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = eng.model_config
    peak = matmul_peak_gflops(threads)  # measured again at the end: the larger counts
    warm = workload("unique", cfg.vocab_size, seed=9)[:2]
    run_engine(eng, warm)
    run_hf(hf, warm, 2)
    if not args.no_cb:
        run_hf_cb(hf, warm)
    print(f"model {path}: hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocabulary "
          f"{cfg.vocab_size}; {threads} torch threads each; measured matmul peak "
          f"{peak:.0f} GFLOP/s; median of {args.rounds} alternating rounds")
    print("| workload | transformers generate (s) | transformers CB (s) | radixlm (s) | "
          "ratio vs generate | ratio vs CB | useful / computed tokens (generate) | "
          "radixlm cache hit | radixlm % of matmul peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.workload:
        reqs = workload(name, cfg.vocab_size)
        batch = len(reqs) if name != "variable" else args.hf_batch
        t_eng, t_hf, t_cb = [], [], []
        for _ in range(args.rounds):
            before = eng.get_server_info()
            t_eng.append(run_engine(eng, reqs))
            after = eng.get_server_info()
            dt, computed = run_hf(hf, reqs, batch)
            t_hf.append(dt)
            if not args.no_cb:
                t_cb.append(run_hf_cb(hf, reqs))
        cached = int(after["cached_tokens"] - before["cached_tokens"])
        useful = sum(len(p) + o for p, o in reqs)
        e, h = statistics.median(t_eng), statistics.median(t_hf)
        cb = f"{statistics.median(t_cb):.2f}" if t_cb else "-"
        vs_cb = f"{statistics.median(t_cb) / e:.2f}" if t_cb else "-"
        share = model_flops(cfg, reqs, cached) / e / 1e9 / peak
        hit = cached / sum(len(p) for p, _ in reqs)
        print(f"| {name} | {h:.2f} | {cb} | {e:.2f} | {h / e:.2f} | {vs_cb} | {useful} / "
              f"{computed} | {100 * hit:.0f}% | {100 * share:.0f}% |", flush=True)
    eng.shutdown()
    end_peak = matmul_peak_gflops(threads)
    if end_peak > peak:
        print(f"(matmul peak measured again at the end: {end_peak:.0f} GFLOP/s; the "
              f"shares above are over {peak:.0f}: multiply them by {peak / end_peak:.2f})")


if __name__ == "__main__":
    main()
