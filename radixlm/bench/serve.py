"""``radixlm bench serve``: send a dataset to a running server at a request rate and report
throughput, TTFT / TPOT / ITL / E2E at mean, p50, p90 and p99, goodput under ``--slo``
and the server's cache hit rate. Option names follow SGLang's ``bench_serving``.

    radixlm bench serve --backend radixlm --base-url http://127.0.0.1:30000 \\
        --dataset-name generated-shared-prefix --request-rate 2,4,8 --plot plots/

Arrivals: ``--request-rate inf`` sends everything at once; a finite rate draws the gaps
between conversations from a gamma distribution of mean 1 / rate and shape
``--burstiness`` (1: Poisson; below 1 burstier, above 1 more even), as vLLM does.
``--max-concurrency`` caps the requests in flight. Several comma-separated rates make a
sweep: one run per rate, the same requests each time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from radixlm.bench.backends import BACKENDS, ChatBackend, make_backend
from radixlm.bench.datasets import DATASETS, Conversation, Turn, render_chat, sample_conversations
from radixlm.bench.metrics import BenchMetrics, format_report, parse_slo, summarize
from radixlm.bench.request import RequestInput, RequestOutput

WARMUP_PROMPT = "Hello, this is a warm-up request."


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", default="",
                   help="JSONL of prompts or chat conversations (custom, multi-turn)")
    p.add_argument("--num-prompts", type=int, default=200,
                   help="requests (conversations for multi-turn; lines read for a file)")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128,
                   help="also the output length of file turns that give none")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * ratio, len] (SGLang's meaning)")
    g = p.add_argument_group("generated-shared-prefix dataset")
    g.add_argument("--gsp-num-groups", type=int, default=8)
    g.add_argument("--gsp-prompts-per-group", type=int, default=16)
    g.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    g.add_argument("--gsp-question-len", type=int, default=64)
    g.add_argument("--gsp-output-len", type=int, default=64)
    g = p.add_argument_group("multi-turn dataset (chat; each turn resends the history)")
    g.add_argument("--multi-turn-num-turns", type=int, default=4)
    g.add_argument("--multi-turn-system-prompt-len", type=int, default=512,
                   help="one system prompt shared by every conversation (0: none)")
    g.add_argument("--multi-turn-user-len", type=int, default=64)
    g.add_argument("--multi-turn-output-len", type=int, default=64)
    g = p.add_argument_group("long-document dataset (document + question)")
    g.add_argument("--long-doc-num-docs", type=int, default=4)
    g.add_argument("--long-doc-len", type=int, default=3000)
    g.add_argument("--long-doc-question-len", type=int, default=32)
    g.add_argument("--long-doc-output-len", type=int, default=32)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, default="radixlm")
    p.add_argument("--base-url", default=None, help="default http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None,
                   help="model name sent to OpenAI APIs (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (default: --model if a directory, else the "
                        "built-in tiny model's)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    _add_dataset_args(p)
    p.add_argument("--request-rate", default="inf",
                   help="requests per second, or several comma-separated for a sweep")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft=200,tpot=50")
    p.add_argument("--extra-request-body", default=None,
                   help="JSON object merged into every request body")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--flush-cache", action="store_true",
                   help="POST /flush_cache before each run (radixlm and SGLang servers)")
    p.add_argument("--output-file", default=None, help="append one JSON record per run")
    p.add_argument("--output-details", action="store_true",
                   help="per-request latencies and lengths in the record")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots to DIR")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--log-level", default="warning", help="of this client's logging")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixlm bench serve", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_cli_args(p)
    return p


def parse_request_rates(text: str) -> list[float]:
    rates = []
    for part in filter(None, (t.strip() for t in str(text).split(","))):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--request-rate {part!r} is not a number or inf") from None
        if not rate > 0:
            raise ValueError(f"--request-rate {part!r} must be positive (inf: all at once)")
        rates.append(rate)
    if not rates:
        raise ValueError("--request-rate is empty")
    return rates


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s after the start) of ``n`` arrivals: gamma gaps of mean 1 / rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        offsets.append(t)
    return offsets


@dataclass
class RunResult:
    request_rate: float
    outputs: list[RequestOutput]
    metrics: BenchMetrics


class BenchClient:
    """One benchmark's fixed parts: backend, server, tokenizer, model name, body extras."""

    def __init__(self, args: argparse.Namespace, tokenizer: Any) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.backend = make_backend(args.backend)
        self.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
        self.extra = parse_extra_body(args.extra_request_body)
        self.slos = parse_slo(args.slo) if args.slo else None
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.model: str | None = args.model

    def client(self, connections: int) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=connections + 4,
                              max_keepalive_connections=connections + 4)
        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers, limits=limits,
                                 timeout=httpx.Timeout(6 * 3600.0, connect=30.0))

    def request(self, conv: Conversation, history: list[dict[str, str]],
                turn: Turn) -> RequestInput:
        user = {"role": "user", "content": turn.text}
        if not conv.chat:
            return RequestInput(turn.text, [user], turn.output_len, self.extra)
        messages = [*history, user]
        chat = isinstance(self.backend, ChatBackend)
        prompt = "" if chat else render_chat(self.tokenizer, messages)
        return RequestInput(prompt, messages, turn.output_len, self.extra)

    def fill_lengths(self, req: RequestInput, out: RequestOutput) -> None:
        """Client-side token counts where the server reported none."""
        if not out.success:
            return
        if out.prompt_len == 0:
            text = req.prompt or render_chat(self.tokenizer, req.messages)
            out.prompt_len = len(self.tokenizer.encode(text))
        if out.output_len == 0:
            out.output_len = len(self.tokenizer.encode(out.generated_text,
                                                       add_special_tokens=False))

    async def resolve_model(self, client: httpx.AsyncClient) -> None:
        if self.model is not None or self.backend.path == "/generate":
            return
        try:
            resp = await client.get("/v1/models")
            data = resp.json().get("data") or []
            self.model = data[0]["id"] if resp.status_code == 200 and data else None
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            self.model = None

    async def prepare(self, client: httpx.AsyncClient) -> None:
        await self.resolve_model(client)
        for _ in range(self.args.warmup_requests):
            req = RequestInput(WARMUP_PROMPT, [{"role": "user", "content": WARMUP_PROMPT}], 4,
                               self.extra)
            out = await self.backend.send(client, req, self.model)
            if not out.success:
                raise RuntimeError(f"warm-up request to {self.base_url} failed: {out.error}")
        if self.args.flush_cache:
            resp = await client.post("/flush_cache")
            if resp.status_code != 200:
                raise RuntimeError(f"--flush-cache: POST /flush_cache answered "
                                   f"{resp.status_code}: {resp.text[:200]}")

    async def conversation(self, client: httpx.AsyncClient, conv: Conversation, start: float,
                           sem: asyncio.Semaphore | None, outputs: list[RequestOutput],
                           pbar: tqdm) -> None:
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        history = list(conv.history)
        for i, turn in enumerate(conv.turns):
            req = self.request(conv, history, turn)
            if sem is None:
                out = await self.backend.send(client, req, self.model)
            else:
                async with sem:
                    out = await self.backend.send(client, req, self.model)
            self.fill_lengths(req, out)
            outputs.append(out)
            pbar.update(1)
            if not out.success:
                skipped = len(conv.turns) - i - 1
                outputs += [RequestOutput(error="an earlier turn failed") for _ in range(skipped)]
                pbar.update(skipped)
                return
            history += [req.messages[-1], {"role": "assistant", "content": out.generated_text}]

    async def run(self, convs: list[Conversation], rate: float) -> RunResult:
        n_req = sum(c.num_requests for c in convs)
        cap = self.args.max_concurrency
        async with self.client(min(cap or n_req, n_req)) as client:
            await self.prepare(client)
            offsets = arrival_offsets(len(convs), rate, self.args.burstiness, self.args.seed)
            sem = asyncio.Semaphore(cap) if cap else None
            outputs: list[RequestOutput] = []
            with tqdm(total=n_req, disable=self.args.disable_tqdm, desc=f"rate {rate:g}") as bar:
                t0 = time.perf_counter()
                await asyncio.gather(*(self.conversation(client, c, t0 + off, sem, outputs, bar)
                                       for c, off in zip(convs, offsets)))
                duration = time.perf_counter() - t0
        return RunResult(rate, outputs, summarize(outputs, duration, self.slos))


def parse_extra_body(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-request-body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("--extra-request-body must be a JSON object")
    return body


def check_args(args: argparse.Namespace) -> list[float]:
    rates = parse_request_rates(args.request_rate)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if not args.burstiness > 0:
        raise ValueError("--burstiness must be positive (1: Poisson arrivals)")
    if args.warmup_requests < 0:
        raise ValueError("--warmup-requests must be at least 0")
    return rates


def bench_tokenizer(args: argparse.Namespace) -> Any:
    from radixlm.runtime.tokenizer import load_tokenizer, resolve_model_path  # transformers

    path = args.tokenizer
    if path is None and args.model and os.path.isdir(args.model):
        path = args.model
    return load_tokenizer(resolve_model_path(path))


def run_record(args: argparse.Namespace, result: RunResult, model: str | None) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "backend": args.backend,
        "base_url": args.base_url or f"http://{args.host}:{args.port}", "model": model,
        "dataset_name": args.dataset_name, "dataset_path": args.dataset_path or None,
        "num_prompts": args.num_prompts, "request_rate": result.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "seed": args.seed, **result.metrics.to_record(),
    }
    if args.output_details:
        outs = result.outputs
        rec.update(ttfts=[o.ttft for o in outs], itls=[o.itl for o in outs],
                   e2e_latencies=[o.latency for o in outs], input_lens=[o.prompt_len for o in outs],
                   output_lens=[o.output_len for o in outs],
                   cached_tokens=[o.cached_tokens for o in outs], errors=[o.error for o in outs])
    return rec


def run_benchmark(args: argparse.Namespace,
                  echo: Callable[[str], None] = print) -> list[RunResult]:
    """Every run of the sweep; each is reported through ``echo`` and appended to
    ``--output-file`` as it finishes; plots are written at the end."""
    rates = check_args(args)
    bench = BenchClient(args, bench_tokenizer(args))
    convs = sample_conversations(args, bench.tokenizer)
    results = []
    for rate in rates:
        result = asyncio.run(bench.run(convs, rate))
        results.append(result)
        title = (f"{args.backend} {bench.base_url}, {args.dataset_name}, rate {rate:g}, "
                 f"max concurrency {args.max_concurrency or 'unlimited'}")
        echo(format_report(title, result.metrics))
        errors = sorted({o.error for o in result.outputs if not o.success})
        if errors:
            echo(f"errors ({len(errors)} distinct): " + " | ".join(errors[:3]))
        if args.output_file:
            with open(args.output_file, "a") as f:
                f.write(json.dumps(run_record(args, result, bench.model)) + "\n")
    if args.plot:
        from radixlm.bench.plots import write_plots  # matplotlib only when plotting

        for path in write_plots(Path(args.plot), results):
            echo(f"wrote {path}")
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(args)


def run_cli(args: argparse.Namespace) -> int:
    try:
        results = run_benchmark(args)
    except (ValueError, RuntimeError) as e:
        print(f"radixlm bench serve: error: {e}")
        return 2
    return 0 if all(r.metrics.completed for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
