"""radixlm against llama.cpp (``llama-cpp-python`` 0.3.36, built here), on the same GGUF files.

    .venv/bin/python benchmarks/llamacpp_side_by_side.py --quick
    .venv/bin/python benchmarks/llamacpp_side_by_side.py --models 1b --formats Q4_K_M \
        --rounds 3 --out llamacpp_1b.json

Builds or reuses (llamacpp_side/files.py) the small preset and a 1B-class Llama shape,
each as BF16, Q8_0 and Q4_K_M GGUF files made by llama.cpp's own converter and quantizer,
then runs, the systems alternating round by round, each in a subprocess of its own with
``--threads`` threads (greedy, EOS ignored, the same token ids):

- one stream: a ``--prompt-len`` prompt, then ``--decode-len`` tokens: the prompt's tokens
  per second (to its first token) and the decode's;
- ``--streams`` N concurrent streams (N prompts of ``--stream-prompt-len``, each
  ``--stream-decode-len`` out, all at once): output tokens per second, prompts included.
  llama.cpp: one context of N sequences batched together (llama-server's N slots);
  radixlm: one ``Engine.generate`` of N prompts;
- served (``--modes served``): ``radixlm serve`` against the binding's server
  (``llama_cpp.server``, one request at a time), ``radixlm bench serve`` at
  ``--serve-rates``: TTFT and TPOT p50 / p99;
- tokens (``--modes tokens``): greedy tokens of 3 prompts x 16 from both on each file,
  equal up to each prompt's first difference, which may only come where llama.cpp's top-2
  margin is under ``--token-bound``.

radixlm loads the GGUF file itself (``Engine(model_path="file.gguf")``); with
``--radixlm-source hf`` it loads the Hugging Face directory the file was made from, in
bfloat16, instead (to check the harness where GGUF loading is missing). Prints the host's
CPU, llama.cpp's build flags and markdown tables of medians (min-max), radixlm over
llama.cpp; writes every round's figures to ``--out`` (JSON) after each round.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # llamacpp_side, run as a script

from llamacpp_side.files import (  # noqa: E402
    FORMATS,
    MODELS,
    MORE_FORMATS,
    default_tools,
    gguf_dir,
    gguf_file,
    hf_model,
    vocab_size,
)
from llamacpp_side.report import (  # noqa: E402
    SYSTEMS,
    add_offline,
    add_served,
    add_token_match,
    add_tokens,
    match_table,
    offline_table,
    probe_table,
    served_table,
    tokens_table,
)
from llamacpp_side.served import Served, run_served  # noqa: E402
from llamacpp_side.workers import Tools, run_llama_worker, run_radixlm_worker  # noqa: E402
from vllm_side.probe import machine_probe  # noqa: E402
from vllm_side.served import ServedLoad  # noqa: E402

MODES = ("offline", "served", "tokens")
FIRST_ID = 3  # after the built-in tokenizer's special tokens (0-2)
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
QUICK = {"rounds": 1, "prompt_len": 128, "decode_len": 32, "stream_prompt_len": 64,
         "stream_decode_len": 16, "serve_prompts": 8, "serve_rates": "1",
         "serve_input_len": 128, "serve_output_len": 32}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--formats", nargs="+", choices=FORMATS + MORE_FORMATS,
                    default=list(FORMATS))
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--quick", action="store_true",
                    help="a short run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="compute threads for each system")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-len", type=int, default=128)
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--stream-prompt-len", type=int, default=128)
    ap.add_argument("--stream-decode-len", type=int, default=64)
    ap.add_argument("--serve-rates", default="0.5,2", help="request rates (req/s), "
                    "comma-separated")
    ap.add_argument("--serve-prompts", type=int, default=16)
    ap.add_argument("--serve-input-len", type=int, default=256)
    ap.add_argument("--serve-output-len", type=int, default=64)
    ap.add_argument("--kv-tokens", type=int, default=16384, help="radixlm's KV pool")
    ap.add_argument("--radixlm-source", choices=("gguf", "hf"), default="gguf",
                    help="hf: the Hugging Face directory in bfloat16 instead of the file")
    ap.add_argument("--kv-unified", action="store_true",
                    help="llama.cpp's N streams in one unified KV buffer (default: one "
                         "stream each)")
    ap.add_argument("--token-bound", type=float, default=2.5,
                    help="tokens mode: llama.cpp's top-2 logit margin under which the two "
                         "may pick different tokens")
    ap.add_argument("--seed", type=int, default=0, help="of the prompts' token ids")
    ap.add_argument("--out", type=Path, default=Path("llamacpp_side_by_side.json"))
    ap.add_argument("--log", type=Path,
                    default=Path.home() / ".cache" / "radixlm" / "llamacpp-side" / "run.log",
                    help="the subprocesses' output (appended)")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments; with ``--quick``, QUICK's values for those not given."""
    ap = build_parser()
    if ap.parse_known_args(argv)[0].quick:
        ap.set_defaults(**QUICK)
    return ap.parse_args(argv)


def check(args: argparse.Namespace) -> ServedLoad:
    for name in ("rounds", "threads", "prompt_len", "decode_len", "stream_prompt_len",
                 "stream_decode_len", "serve_prompts", "serve_input_len", "serve_output_len",
                 "kv_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.decode_len < 2:
        raise ValueError("--decode-len must be at least 2 (a decode rate needs two tokens)")
    if any(n < 1 for n in args.streams):
        raise ValueError("--streams must be at least 1 each")
    return ServedLoad.from_args(args)


def prompts(rng: random.Random, vocab: int, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(length)] for _ in range(n)]


def bench_spec(args: argparse.Namespace, vocab: int) -> dict:
    """The token ids both systems get (the same for every round and format)."""
    rng = random.Random(args.seed)
    return {"mode": "bench", "threads": args.threads, "kv_tokens": args.kv_tokens,
            "kv_unified": args.kv_unified, "warmup": prompts(rng, vocab, 1, 16)[0],
            "single": {"prompt": prompts(rng, vocab, 1, args.prompt_len)[0],
                       "decode": args.decode_len},
            "streams": [{"prompts": prompts(rng, vocab, n, args.stream_prompt_len),
                         "decode": args.stream_decode_len} for n in args.streams]}


def host_info() -> dict:
    """The CPU's name, family and model (a VM may hide the rest of the name) and the flags
    that matter to these kernels, from the first processor in /proc/cpuinfo."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip() and fields:
                break  # the first processor's block ends
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = (f"{fields.get('model name', 'unknown')} family {fields.get('cpu family', '?')} "
           f"model {fields.get('model', '?')}")
    flags = set(fields.get("flags", "").split())
    return {"cpu": cpu, "flags": [f for f in CPU_FLAGS if f in flags]}


def run_system(system: str, args: argparse.Namespace, tools: Tools, spec: dict,
               probes: list[float]) -> dict:
    """One offline bench of ``system``; the machine probe taken before it (GFLOP/s of a
    float32 matmul on the same threads: a low figure marks a slow spell of a shared host)
    appended to ``probes``."""
    before = machine_probe(args.threads)
    probes.append(before)
    t0 = time.perf_counter()
    if system == "llamacpp":
        out = run_llama_worker(tools, spec, args.log)
    else:
        out = run_radixlm_worker(spec, args.log)
    logging.warning("%s %s: %.0f s with loading (probe %.0f GFLOP/s before)", system,
                    Path(spec["model"]).name, time.perf_counter() - t0, before)
    return out


def model_round(args: argparse.Namespace, tools: Tools, load: ServedLoad, model: str,
                hf: Path, files: dict[str, Path], r: int, results: dict) -> None:
    order = list(args.systems) if r % 2 == 0 else list(reversed(args.systems))
    base = bench_spec(args, vocab_size(hf))
    hf_dtype = "bfloat16" if args.radixlm_source == "hf" else None
    for fmt, path in files.items():
        radixlm_model = str(hf if hf_dtype else path)
        if "offline" in args.modes:
            benches = {}
            for system in order:
                spec = {**base, "model": str(path) if system == "llamacpp" else radixlm_model,
                        "dtype": None if system == "llamacpp" else hf_dtype}
                probes = results.setdefault("probe", {}).setdefault(model, {}).setdefault(
                    fmt, {}).setdefault(system, [])
                benches[system] = run_system(system, args, tools, spec, probes)
                add_offline(results, model, fmt, system, benches[system])
            add_token_match(results, model, fmt, benches)
        if "served" in args.modes:
            served = Served(tools, args.kv_tokens, hf_dtype)
            for system in order:
                target = path if system == "llamacpp" else Path(radixlm_model)
                per_rate = run_served(system, served, target, hf, load, args.log)
                add_served(results, model, fmt, system, per_rate)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


def compare_tokens(args: argparse.Namespace, tools: Tools, model: str, hf: Path,
                   files: dict[str, Path], results: dict) -> None:
    """Greedy tokens of 3 prompts x 16 from both systems on each file, compared up to each
    prompt's first difference (report.greedy_agreement)."""
    rng = random.Random(args.seed + 1)
    spec = {"mode": "greedy", "threads": args.threads, "tokens": 16,
            "prompts": prompts(rng, vocab_size(hf), 3, 32), "near": args.token_bound}
    for fmt, path in files.items():
        theirs = run_llama_worker(tools, {**spec, "model": str(path)}, args.log)
        ours = run_radixlm_worker({**spec, "model": str(hf), "dtype": "bfloat16"}
                                  if args.radixlm_source == "hf"
                                  else {**spec, "model": str(path)}, args.log)
        add_tokens(results, model, fmt, theirs, ours["output_ids"], args.token_bound)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


def run(args: argparse.Namespace) -> dict:
    load = check(args)
    tools = default_tools(args.threads)
    tools.check()
    if "served" in args.modes and "llamacpp" in args.systems:
        tools.check_server()
    info = run_llama_worker(tools, {"mode": "info"}, args.log)
    results: dict = {"config": {k: str(v) for k, v in vars(args).items()},
                     "host": host_info(), "llamacpp": info, "files": {}}
    for model in args.models:
        hf = hf_model(model)
        files = {fmt: gguf_file(tools, hf, fmt, gguf_dir(hf), args.log)
                 for fmt in args.formats}
        results["files"][model] = {fmt: p.stat().st_size for fmt, p in files.items()}
        if "tokens" in args.modes:
            compare_tokens(args, tools, model, hf, files, results)
        for r in range(args.rounds):
            model_round(args, tools, load, model, hf, files, r, results)
    return results


def print_report(args: argparse.Namespace, results: dict) -> None:
    host, info = results["host"], results["llamacpp"]
    print(f"\nhost: {host['cpu']}, flags {' '.join(host['flags'])}; llama-cpp-python "
          f"{info['version']}: {info['system_info'].strip()}")
    print(f"{args.threads} threads each; median (min-max) of {args.rounds} alternating "
          f"rounds; radixlm from the {args.radixlm_source.upper()} "
          f"{'file' if args.radixlm_source == 'gguf' else 'directory (bfloat16)'}\n")
    if "offline" in results:
        print(f"offline: one stream {args.prompt_len} in / {args.decode_len} out; "
              f"N streams {args.stream_prompt_len} in / {args.stream_decode_len} out each\n")
        print(offline_table(results, results["files"]) + "\n")
        print(match_table(results) + "\n")
        print(f"machine probe before each offline run (float32 matmul GFLOP/s on "
              f"{args.threads} threads; the host is shared: a low figure marks a slow "
              "spell)\n\n" + probe_table(results) + "\n")
    if "tokens" in results:
        print(f"greedy tokens, 3 prompts of 32 x 16 tokens, each compared up to its first "
              f"difference (allowed where llama.cpp's margin <= {args.token_bound})\n")
        print(tokens_table(results) + "\n")
    if "served" in results:
        print(f"served: random {args.serve_input_len} in / {args.serve_output_len} out, "
              f"{args.serve_prompts} requests per rate; llama.cpp: the binding's server, "
              "one request at a time\n")
        print(served_table(results) + "\n")
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    try:
        results = run(args)
    except (ValueError, RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"llamacpp_side_by_side: error: {e}", file=sys.stderr)
        return 2
    print_report(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
