"""Offline output throughput: radixlm.Engine vs transformers ``generate`` (static batch).

Workload "generated shared prefix" (SGLang's bench_serving naming): G groups x P prompts,
each group sharing a random system prompt of S tokens, then a Q-token question; O output
tokens per request with EOS ignored, greedy. Both run the same model (the tiny one, or
``--preset small`` / ``--model-path DIR``) in this process,
one after the other. Also prints how much of a batch-32 decode step's wall time is spent
outside the model forward (scheduling, batch building, sampling, bookkeeping).

    .venv/bin/python benchmarks/offline_throughput.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

import radixlm
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.managers.scheduler.scheduler import Scheduler
from radixlm.tiny_model import add_model_args, resolve_model


def make_workload(vocab: int, groups: int, per_group: int, sys_len: int, q_len: int,
                  seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(groups):
        system = torch.randint(10, vocab, (sys_len,), generator=g).tolist()
        for _ in range(per_group):
            prompts.append(system + torch.randint(10, vocab, (q_len,), generator=g).tolist())
    return prompts


def load_hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run_hf(model, prompts: list[list[int]], out_len: int, threads: int) -> float:
    torch.set_num_threads(threads)
    ids = torch.tensor(prompts)  # equal lengths: a static batch needs no padding here
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False,
              pad_token_id=0)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        dt = time.perf_counter() - t0
    assert out.shape == (len(prompts), ids.shape[1] + out_len), out.shape
    return dt


def run_engine(eng, prompts: list[list[int]], sp: dict) -> float:
    eng.flush_cache()  # every round starts from an empty cache
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=sp)
    dt = time.perf_counter() - t0
    assert all(o["meta_info"]["completion_tokens"] == sp["max_new_tokens"] for o in outs)
    return dt


class StepTimer:
    """Wall time of decode steps at a given batch size, and of their model forwards."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.step_time = self.forward_time = 0.0
        self.steps = 0

    def install(self) -> None:
        timer = self
        step, forward = Scheduler.step, ModelRunner.forward

        def timed_forward(self, batch, req_to_token):
            t0 = time.perf_counter()
            out = forward(self, batch, req_to_token)
            if batch.is_decode and len(batch) == timer.batch_size:
                timer.forward_time += time.perf_counter() - t0
                timer._hit = True
            return out

        def timed_step(self):
            timer._hit = False
            t0 = time.perf_counter()
            out = step(self)
            if timer._hit:
                timer.step_time += time.perf_counter() - t0
                timer.steps += 1
            return out

        ModelRunner.forward, Scheduler.step = timed_forward, timed_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    add_model_args(ap)
    args = ap.parse_args()
    path = resolve_model(args.model_path, args.preset)
    hf_threads = torch.get_num_threads()  # transformers keeps torch's default
    n = args.groups * args.per_group
    timer = StepTimer(batch_size=n)
    timer.install()
    eng = radixlm.Engine(model_path=path, random_seed=0, page_size=args.page_size)
    prompts = make_workload(eng.model_config.vocab_size, args.groups, args.per_group,
                            args.system_len, args.question_len)
    sp = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    hf = load_hf(path)
    warm = make_workload(eng.model_config.vocab_size, 2, 2, 64, 8, seed=1)
    run_engine(eng, warm, sp)
    run_hf(hf, warm, 4, hf_threads)
    # alternate the two runners so that machine noise hits both alike; report medians
    t_engine, t_hf = [], []
    for _ in range(args.rounds):
        timer.step_time = timer.forward_time = 0.0
        timer.steps = 0
        t_engine.append(run_engine(eng, prompts, sp))
        t_hf.append(run_hf(hf, prompts, args.output_len, hf_threads))
    info = eng.get_server_info()
    eng.shutdown()
    dt_engine, dt_hf = statistics.median(t_engine), statistics.median(t_hf)
    tokens = n * args.output_len
    outside = 1 - timer.forward_time / max(timer.step_time, 1e-9)
    print(f"workload: {args.groups} groups x {args.per_group} prompts, system "
          f"{args.system_len} + question {args.question_len} tokens, {args.output_len} "
          f"output tokens; torch threads: transformers {hf_threads}, radixlm "
          f"{eng.server_args.cpu_threads or hf_threads}; median of "
          f"{args.rounds} alternating rounds")
    print("| runner | time (s) | output tok/s | ratio |")
    print("|---|---|---|---|")
    print(f"| transformers generate (static batch {n}) | {dt_hf:.2f} | {tokens / dt_hf:.1f} "
          f"| 1.00 |")
    print(f"| radixlm Engine | {dt_engine:.2f} | {tokens / dt_engine:.1f} | "
          f"{dt_hf / dt_engine:.2f} |")
    print(f"cache hit rate {100 * info['cache_hit_rate']:.1f}% (all rounds); "
          f"decode steps at batch {n}: "
          f"{timer.steps}, wall time outside the model forward {100 * outside:.1f}%")


if __name__ == "__main__":
    main()
