"""Every quantized checkpoint format radixlm serves, side by side on the CPU: file size,
weights resident, single-stream decode, prompt and 8-stream speed, against bf16.

    .venv/bin/python benchmarks/quantized_formats.py --preset small --out small.json
    .venv/bin/python benchmarks/quantized_formats.py --preset 1b --quick

1. The float checkpoint (``--preset small``: the built-in small preset; ``1b``: the
   1B-class shape of ``llama-1b-class-v1``) is written once as a bf16 directory, and from
   it every format (``VARIANTS``) under ``~/.cache/radixlm/quant-bench/<model>/`` with our
   own writers (``radixlm.tiny_quant``): GGUF files and AWQ / GPTQ / compressed-tensors /
   FP8 directories. Each is written under a temporary name and renamed into place.
2. Each format runs in a subprocess of its own (this file with ``--worker``, the spec as
   JSON on stdin, one JSON result line on stdout: no pickle), one at a time, the formats
   alternating round by round (the order reversed every other round), bf16 in every round
   as the baseline. The worker measures its RSS after ``import torch, radixlm`` and again
   after the Engine loaded: the difference is what loading costs, the weights as the
   engine holds them (its packed and prepacked copies too) plus the KV pool (``--kv-tokens``,
   the same for every format; the engine's weight, prepacked and KV bytes are in the JSON).
   Then, in bf16 activations, greedy with EOS ignored, the cache flushed before each request:
   - 1-stream decode: a 64-token prompt, 64 output tokens, minus the time of a 1-token
     request on the same prompt (the prefill): 63 tokens over the difference;
   - prompt: a 512-token prompt, 1 output token: 512 tokens over its time;
   - 8-stream decode: 8 such 64-token prompts in one batch, likewise minus their prefill.
3. A markdown table (medians (min-max) of ``--rounds``, ratios of medians against bf16)
   with the host's CPU and its flags at the top.
4. vLLM's CPU build, when its venv exists (``benchmarks/vllm_side/venv.py`` makes it; it is
   not built here): whether it serves the GGUF Q8_0 / Q4_K_M files and the AWQ, GPTQ, FP8
   and W8A8 directories, and its 1-stream decode where it does, else its error's first line.

Timings on a shared machine move with the other work on it: the load average at the start
and the end is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# Only the standard library at the top: the worker modes import torch and radixlm (or vllm)
# themselves, because ``--vllm-worker`` runs this file under vLLM's venv, without radixlm.

RESULT_PREFIX = "QUANT_BENCH_RESULT "
METRICS = ("decode_1", "prompt", "decode_8")  # tok/s figures of the table
FLAGS = ("avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
VLLM_VENV = Path.home() / ".cache" / "radixlm" / "vllm-venv"
VLLM_BUDGET_S = 20 * 60


@dataclass(frozen=True)
class Variant:
    """One row: ``kind`` "float" (the bf16 directory), "gguf" (``fmt`` a GGUF type) or
    "hf" (``fmt`` a ``write_quantized`` format with ``options``)."""
    name: str
    kind: str
    fmt: str
    options: dict = field(default_factory=dict, hash=False)
    torchao: str = ""
    vllm_quant: str | None = None  # vLLM's --quantization where vLLM is tried

    @property
    def slug(self) -> str:
        """The file or directory name under the model's cache folder."""
        if self.kind == "gguf":
            return f"{self.fmt}.gguf"
        opts = "".join(f"-{k}{int(v) if isinstance(v, bool) else v}"
                       for k, v in sorted(self.options.items()))
        return f"{self.fmt}{opts}"


BASELINE = "bf16"
VARIANTS = (
    Variant(BASELINE, "float", "bf16"),
    Variant("bf16 + int8wo", "float", "bf16", torchao="int8wo"),
    Variant("GGUF BF16", "gguf", "BF16"),
    Variant("GGUF Q8_0", "gguf", "Q8_0", vllm_quant="gguf"),
    Variant("GGUF Q6_K", "gguf", "Q6_K"),
    Variant("GGUF Q4_K_M", "gguf", "Q4_K_M", vllm_quant="gguf"),
    Variant("GGUF Q4_0", "gguf", "Q4_0"),
    Variant("AWQ g128", "hf", "awq", {"group": 128}, vllm_quant="awq"),
    Variant("GPTQ g128", "hf", "gptq", {"group": 128, "desc_act": False}, vllm_quant="gptq"),
    Variant("GPTQ g128 act-order", "hf", "gptq", {"group": 128, "desc_act": True},
            vllm_quant="gptq"),
    Variant("w4a16 g128 (compressed-tensors)", "hf", "w4a16", {"group": 128}),
    Variant("W8A8 int8 (compressed-tensors)", "hf", "w8a8-int8",
            vllm_quant="compressed-tensors"),
    Variant("FP8 block 128x128", "hf", "fp8-block", vllm_quant="fp8"),
)


# ---------------------------------------------------------------- pure parts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=("small", "1b"), default="small")
    p.add_argument("--quick", action="store_true", help="one round (unless --rounds)")
    p.add_argument("--rounds", type=int, default=None, help="default 3 (1 with --quick)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each worker")
    p.add_argument("--formats", nargs="+", default=None, metavar="NAME",
                   help="a subset of the rows by name (bf16 always runs)")
    p.add_argument("--kv-tokens", type=int, default=8192, help="each engine's KV pool")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM's part")
    p.add_argument("--out", type=Path, default=None, help="write every figure as JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1 or args.threads < 1 or args.kv_tokens < 1024:
        p.error("--rounds and --threads must be >= 1, --kv-tokens >= 1024")
    names = {v.name for v in VARIANTS}
    unknown = sorted(set(args.formats or ()) - names)
    if unknown:
        p.error(f"--formats: unknown {unknown}; the rows are {sorted(names)}")
    return args


def selected(formats: list[str] | None) -> list[Variant]:
    """The rows to run, the baseline first."""
    return [v for v in VARIANTS if v.name == BASELINE or not formats or v.name in formats]


def round_order(variants: list[Variant], r: int) -> list[Variant]:
    """Round ``r``'s order: reversed every other round, so no format always runs first."""
    return list(variants) if r % 2 == 0 else list(variants)[::-1]


def rate(tokens: int, seconds: float, prefill_s: float = 0.0) -> float:
    """``tokens`` over ``seconds - prefill_s``; NaN where noise makes that not positive."""
    dt = seconds - prefill_s
    return tokens / dt if dt > 0 else float("nan")


def rss_kib(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, RssAnon and RssFile (KiB) of ``pid`` and its child processes, summed."""
    total = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    for p in [str(pid)] + _children(pid):
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:  # a child that exited meanwhile
            continue
        for line in lines:
            key, _, value = line.partition(":")
            if key in total:
                total[key] += int(value.split()[0])
    return total


def _children(pid: int | str) -> list[str]:
    out: list[str] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for kid in kids:
            out += [kid] + _children(kid)
    return out


def host_info(cpuinfo: str) -> dict:
    """The CPU's model name and which of FLAGS it has, from /proc/cpuinfo's text."""
    model, flags = "unknown", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {"cpu": model, "flags": {f: f in flags for f in FLAGS}}


def summarize(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Per row: each metric's median, min and max over the rounds where it ran, its median
    over the baseline's, the sizes, and the first error where every round failed."""
    names = list(dict.fromkeys(n for r in rounds for n in r))
    base = {m: _median([r[BASELINE].get(m) for r in rounds if BASELINE in r]) for m in METRICS}
    out: dict[str, dict] = {}
    for name in names:
        runs = [r[name] for r in rounds if name in r]
        ok = [x for x in runs if "error" not in x]
        row: dict = {"runs": len(runs), "ok": len(ok)}
        if not ok:
            out[name] = {**row, "error": runs[0]["error"]}
            continue
        for m in METRICS:
            vals = [x[m] for x in ok if x.get(m) == x.get(m)]  # NaN != NaN
            if vals:
                med = statistics.median(vals)
                row[m] = {"median": med, "min": min(vals), "max": max(vals),
                          "x_base": med / base[m] if base[m] else None}
        row["file_bytes"] = ok[0]["file_bytes"]
        row["resident_bytes"] = statistics.median(x["resident_bytes"] for x in ok)
        row["engine_bytes"] = {k: ok[0].get(k) for k in (
            "weight_bytes", "prepacked_weight_bytes", "kv_cache_bytes")}
        out[name] = row
    return out


def _median(vals: list) -> float | None:
    vals = [v for v in vals if v is not None and v == v]
    return statistics.median(vals) if vals else None


def _cell(row: dict, m: str) -> str:
    if m not in row:
        return "-"
    c = row[m]
    ratio = f", {c['x_base']:.2f}x" if c["x_base"] else ""
    return f"{c['median']:.1f} ({c['min']:.1f}-{c['max']:.1f}){ratio}"


def table(summary: dict[str, dict], vllm: dict[str, dict] | None = None) -> str:
    """The markdown table of ``summarize``'s rows (and vLLM's column where it ran)."""
    head = ["format", "file MB", "resident MB", "resident/file", "1-stream tok/s (x bf16)",
            "prompt tok/s (x bf16)", "8-stream tok/s (x bf16)"]
    if vllm is not None:
        head.append("vLLM CPU 1-stream tok/s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in summary.items():
        if "error" in row:
            cells = [name, "-", "-", "-", f"error: {row['error']}", "-", "-"]
        else:
            file_mb, res_mb = row["file_bytes"] / 1e6, row["resident_bytes"] / 1e6
            cells = [name, f"{file_mb:.1f}", f"{res_mb:.1f}", f"{res_mb / file_mb:.2f}",
                     *(_cell(row, m) for m in METRICS)]
        if vllm is not None:
            cells.append(_vllm_cell(vllm.get(name)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _vllm_cell(result: dict | None) -> str:
    if result is None:
        return "not tried"
    if "error" in result:
        return "refused: " + result["error"].replace("|", "/")
    return f"{result['decode_1']:.1f}"


def parse_result(stdout: str) -> dict:
    """The worker's result: the last line that starts with RESULT_PREFIX."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise ValueError("no result line in the worker's output")


def first_error_line(stderr: str) -> str:
    """The last line of a traceback (the exception and its message), else the last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln.split(":")[0] or "Exception" in ln.split(":")[0]:
            return ln[:300]
    return (lines[-1] if lines else "no output")[:300]


# ---------------------------------------------------------------- checkpoints


def source_model(preset: str) -> Path:
    """The float Hugging Face directory of ``preset``, built on first use."""
    from radixlm.tiny_model import (
        ModelShape,
        build_directory_once,
        cache_dir,
        default_tiny_model_path,
        make_tiny_model,
    )

    if preset == "small":
        return default_tiny_model_path(preset="small")
    shape = ModelShape(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64,
                       intermediate=8192, vocab=32000)  # as benchmarks/vllm_side/checkpoint.py
    return build_directory_once(cache_dir() / "llama-1b-class-v1",
                                lambda tmp: make_tiny_model(tmp, shape=shape))


def _write_bf16(src: Path, out: Path) -> None:
    """``src`` with every floating tensor in bf16 and config.json saying so."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors: dict = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v
               for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and "safetensors" not in f.name:
            shutil.copy2(f, out / f.name)


def checkpoint(v: Variant, src: Path) -> Path:
    """``v``'s checkpoint of ``src``, written once under quant-bench/<src name>/ from the
    bf16 directory (so the unquantized tensors are bf16 in every format, as shipped)."""
    from radixlm.tiny_model import build_directory_once, cache_dir
    from radixlm.tiny_quant.gguf_writer import write_gguf
    from radixlm.tiny_quant.hf_writer import write_quantized

    base = cache_dir() / "quant-bench" / src.name
    bf16 = build_directory_once(base / "bf16", lambda tmp: _write_bf16(src, tmp))
    path = base / v.slug
    if v.kind == "float" or path.exists():
        return bf16 if v.kind == "float" else path
    t0 = time.perf_counter()
    if v.kind == "gguf":
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        write_gguf(bf16, tmp, v.fmt)
        os.replace(tmp, path)
    else:
        build_directory_once(path, lambda tmp: write_quantized(bf16, tmp, v.fmt, **v.options))
    print(f"  wrote {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return path


def disk_bytes(path: Path) -> int:
    """The file's size, or the sum over a directory's files."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


# ---------------------------------------------------------------- workers


def workload(vocab: int, seed: int = 0) -> dict[str, list[list[int]]]:
    """The prompts: one of 64 tokens, one of 512, eight of 64 (random token ids)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]
    return {"short": [ids(64)], "long": [ids(512)], "many": [ids(64) for _ in range(8)]}


def timed_runs(generate, flush, spec: dict, clock=time.perf_counter) -> dict:
    """Seconds of each request set (cache flushed before each), and the tok/s figures."""
    w, n = workload(spec["vocab"]), spec["output_len"]

    def run(prompts: list[list[int]], new: int) -> float:
        flush()
        t0 = clock()
        got = generate(prompts, new)
        dt = clock() - t0
        assert all(len(g) == new for g in got), f"{[len(g) for g in got]} tokens, not {new}"
        return dt

    generate(w["short"], 4)  # warm-up
    s = {"short_full_s": run(w["short"], n), "short_prefill_s": run(w["short"], 1)}
    out = {**s, "decode_1": rate(n - 1, s["short_full_s"], s["short_prefill_s"])}
    if spec.get("only_decode_1"):
        return out
    out["long_s"] = run(w["long"], 1)
    out["prompt"] = rate(len(w["long"][0]), out["long_s"])
    out["many_full_s"], out["many_prefill_s"] = run(w["many"], n), run(w["many"], 1)
    out["decode_8"] = rate(len(w["many"]) * (n - 1), out["many_full_s"], out["many_prefill_s"])
    return out


def radixlm_worker(spec: dict) -> dict:
    """Load ``spec["model"]`` in an Engine; RSS before and after; the timed runs."""
    import torch

    import radixlm

    torch.set_num_threads(spec["threads"])
    bare = rss_kib()
    t0 = time.perf_counter()
    eng = radixlm.Engine(model_path=spec["model"], dtype="bfloat16", random_seed=0,
                         cpu_threads=spec["threads"], max_total_tokens=spec["kv_tokens"],
                         torchao_config=spec["torchao"])
    try:
        loaded = rss_kib()
        load_s = time.perf_counter() - t0
        info = eng.get_server_info()

        def generate(prompts: list[list[int]], new: int) -> list[list[int]]:
            sp = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
            return [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                          sampling_params=sp)]
        out = timed_runs(generate, eng.flush_cache, spec)
    finally:
        eng.shutdown()
    return {**out, "rss_bare_kib": bare, "rss_loaded_kib": loaded,
            "resident_bytes": (loaded["VmRSS"] - bare["VmRSS"]) * 1024,
            "load_s": load_s, **{k: info.get(k) for k in (
                "weight_bytes", "prepacked_weight_bytes", "kv_cache_bytes")}}


def vllm_worker(spec: dict) -> dict:
    """vLLM's CPU build on ``spec["model"]`` with ``spec["quantization"]``: 1-stream decode,
    or the first line of the error it raises."""
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(model=spec["model"], tokenizer=spec["tokenizer"], dtype="bfloat16",
                  quantization=spec["quantization"], max_model_len=1024, seed=0,
                  enable_prefix_caching=False)
    except Exception as e:  # noqa: BLE001 -- a refusal is the finding
        return {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:300]}

    def generate(prompts: list[list[int]], new: int) -> list[list[int]]:
        sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return timed_runs(generate, lambda: None, {**spec, "only_decode_1": True})


def run_worker(python: str, flag: str, spec: dict, timeout_s: float, env: dict) -> dict:
    """This file under ``python`` with ``flag``; its result, or ``{"error": line}``."""
    try:
        proc = subprocess.run([python, os.path.abspath(__file__), flag], input=json.dumps(spec),
                              capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    try:
        result = parse_result(proc.stdout)
    except ValueError:
        return {"error": f"exit {proc.returncode}: {first_error_line(proc.stderr)}"}
    if "error" in result:  # vLLM's engine core names the cause on stderr, not in the raise
        result["stderr_error"] = first_error_line(proc.stderr)
    return result


def worker_main(flag: str) -> int:
    spec = json.loads(sys.stdin.read())
    result = radixlm_worker(spec) if flag == "--worker" else vllm_worker(spec)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------- the run


def build_all(formats: list[str] | None, src: Path) -> tuple[dict[str, Path], dict]:
    """Each row's checkpoint, and ``{"error": ...}`` for a row whose writer failed."""
    paths, errors = {}, {}
    for v in selected(formats):
        try:
            paths[v.name] = checkpoint(v, src)
        except Exception as e:  # noqa: BLE001 -- one writer's failure is one row's
            errors[v.name] = {"error": f"writing failed: {type(e).__name__}: {e}"[:300]}
            print(f"  {v.name}: {errors[v.name]['error']}", file=sys.stderr, flush=True)
    return paths, errors


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def bench_rounds(args: argparse.Namespace, paths: dict[str, Path],
                 vocab: int) -> list[dict[str, dict]]:
    """``args.rounds`` rounds of every row, one worker at a time."""
    env = {"OMP_NUM_THREADS": str(args.threads)}
    rounds: list[dict[str, dict]] = []
    variants = [v for v in selected(args.formats) if v.name in paths]
    for r in range(args.rounds):
        got: dict[str, dict] = {}
        for v in round_order(variants, r):
            spec = {"model": str(paths[v.name]), "torchao": v.torchao, "vocab": vocab,
                    "threads": args.threads, "kv_tokens": args.kv_tokens, "output_len": 64}
            res = run_worker(sys.executable, "--worker", spec, 900, env)
            res["file_bytes"] = disk_bytes(paths[v.name])
            got[v.name] = res
            print(f"  round {r + 1} {v.name}: " + (res["error"] if "error" in res else
                  " ".join(f"{m} {res[m]:.1f}" for m in METRICS)
                  + f" resident {res['resident_bytes'] / 1e6:.0f} MB"),
                  file=sys.stderr, flush=True)
        rounds.append({v.name: got[v.name] for v in variants})
    return rounds


def vllm_part(args: argparse.Namespace, paths: dict[str, Path], src: Path,
              vocab: int) -> dict[str, dict] | None:
    """vLLM's 1-stream decode (or refusal) per format it is tried on; None without its
    venv. Stops starting new tries after VLLM_BUDGET_S."""
    python = VLLM_VENV / "bin" / "python"
    if args.no_vllm or not python.exists():
        return None
    env = {"OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}
    deadline = time.monotonic() + VLLM_BUDGET_S
    out: dict[str, dict] = {}
    for v in selected(args.formats):
        if v.vllm_quant is None or v.name not in paths:
            continue
        left = deadline - time.monotonic()
        if left < 60:
            out[v.name] = {"error": "not tried: the 20-minute budget was spent"}
            continue
        spec = {"model": str(paths[v.name]), "tokenizer": str(src), "vocab": vocab,
                "quantization": v.vllm_quant, "output_len": 64}
        out[v.name] = run_worker(str(python), "--vllm-worker", spec, min(left, 600), env)
        print(f"  vLLM {v.name}: {out[v.name]}", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker or args.vllm_worker:
        return worker_main("--worker" if args.worker else "--vllm-worker")
    host = {**host_info(Path("/proc/cpuinfo").read_text()), "cpus": os.cpu_count(),
            "load_start": load_average()}
    src = source_model(args.preset)
    vocab = int(json.loads((src / "config.json").read_text())["vocab_size"])
    paths, write_errors = build_all(args.formats, src)
    rounds = bench_rounds(args, paths, vocab)
    rounds = [{**r, **write_errors} for r in rounds]
    vllm = vllm_part(args, paths, src, vocab)
    host["load_end"] = load_average()
    summary = summarize(rounds)
    flags = ", ".join(f"{f} {'yes' if on else 'no'}" for f, on in host["flags"].items())
    print(f"host: {host['cpu']}, {host['cpus']} CPUs; {flags}; load average "
          f"{host['load_start']} at the start, {host['load_end']} at the end (shared machine)")
    print(f"model: {src} ({args.preset}); {args.threads} torch threads per worker, "
          f"{args.rounds} round(s), medians (min-max); bf16 activations")
    if vllm is None:
        print(f"vLLM: not run ({'--no-vllm' if args.no_vllm else f'no venv at {VLLM_VENV}'})")
    print()
    print(table(summary, vllm))
    if args.out:
        args.out.write_text(json.dumps({"host": host, "model": str(src), "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "paths": {k: str(p) for k, p in paths.items()}, "rounds": rounds,
            "summary": summary, "vllm": vllm}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
