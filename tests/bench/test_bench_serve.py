"""``radixlm bench serve`` end to end: against a fake OpenAI-compatible server that streams
with injected delays and reports planted usage (latency lower bounds, goodput, cache hit
rate, concurrency cap, request bodies, failures, plots, the result file), and against a
real ``radixlm serve`` on the tiny model for every backend (the client's token and cache
totals against the server's own counters)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import matplotlib.image
import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from radixlm import cli
from radixlm.bench.serve import build_parser, run_benchmark
from radixlm.runtime.entrypoints.server_process import ServerProcess, free_port

# what the fake server does per prompt kind: first-token delay, gap between tokens (s),
# and the usage it reports (prompt tokens, cached tokens)
TTFT_DELAY, TOKEN_GAP = 0.5, 0.1
KINDS = {
    "fast": (0.0, 0.0, (100, 60)),
    "slowfirst": (TTFT_DELAY, 0.0, (100, 0)),
    "slowtokens": (0.0, TOKEN_GAP, (100, 0)),
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class FakeOpenAI:
    """Starlette app on a free loopback port, in a thread; remembers bodies and the most
    requests it had in flight at once."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        routes = [Route("/v1/completions", self.handle, methods=["POST"]),
                  Route("/v1/chat/completions", self.handle, methods=["POST"]),
                  Route("/v1/models", self.models)]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(Starlette(routes=routes), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> FakeOpenAI:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive()

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model"}]})

    async def handle(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        kind = text.split()[0]
        if kind == "fail":
            return JSONResponse({"error": {"message": "planted failure"}}, status_code=400)
        first, gap, (prompt, cached) = KINDS.get(kind, KINDS["fast"])
        n = body["max_tokens"]

        def chunk(piece: str) -> bytes:
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0,
                                                                              "text": piece}
            return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()

        async def stream():
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(first)
                for i in range(n):
                    if i:
                        await asyncio.sleep(gap)
                    yield chunk(f"{kind} ")
                usage = {"prompt_tokens": prompt, "completion_tokens": n,
                         "total_tokens": prompt + n,
                         "prompt_tokens_details": {"cached_tokens": cached}}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def fake():
    with FakeOpenAI() as srv:
        yield srv


def _dataset(tmp_path, kinds: list[str]) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{k} request {i}", "output_len": 6}) + "\n"
                            for i, k in enumerate(kinds)))
    return str(path)


KIND_LIST = ["fast"] * 5 + ["slowfirst"] * 3 + ["slowtokens"] * 2


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_fake_server_latencies_goodput_and_cache(fake, tmp_path, backend):
    fake.max_in_flight = 0
    fake.bodies.clear()
    out_file = tmp_path / "results.jsonl"
    args = build_parser().parse_args([
        "--backend", backend, "--base-url", fake.url, "--dataset-name", "custom",
        "--dataset-path", _dataset(tmp_path, KIND_LIST), "--max-concurrency", "2",
        "--slo", f"ttft={TTFT_DELAY * 800:g},tpot={TOKEN_GAP * 800:g}", "--disable-tqdm",
        "--extra-request-body", '{"top_k": 3}', "--output-file", str(out_file),
        "--warmup-requests", "0"])
    [run] = run_benchmark(args, echo=lambda s: None)
    m = run.metrics
    assert (m.completed, m.failed) == (10, 0)
    assert fake.max_in_flight <= 2
    kinds = {id(o): o.generated_text.split()[0] for o in run.outputs}
    assert sorted(kinds.values()) == sorted(KIND_LIST)
    for o in run.outputs:
        assert o.output_len == 6 and o.prompt_len == 100
        if kinds[id(o)] == "slowfirst":
            assert o.ttft >= TTFT_DELAY
        if kinds[id(o)] == "slowtokens":
            assert o.latency >= 5 * TOKEN_GAP
            assert len(o.itl) == 5
    # three TTFTs of at least 500 ms among ten: p90 (rank 8.1) and p99 lie between them
    assert m.ttft.p90 >= TTFT_DELAY * 1000 and m.ttft.p99 >= TTFT_DELAY * 1000
    assert m.e2e.p99 >= 5 * TOKEN_GAP * 1000
    ttfts_ms = [o.ttft * 1000 for o in run.outputs]
    for p, got in ((50, m.ttft.p50), (90, m.ttft.p90), (99, m.ttft.p99)):
        assert got == pytest.approx(float(np.percentile(ttfts_ms, p)))
    itls_ms = [g * 1000 for o in run.outputs for g in o.itl]
    assert m.itl.p99 == pytest.approx(float(np.percentile(itls_ms, 99)))
    # goodput: only the five fast requests meet both SLOs; slowfirst meet the TPOT one
    g = m.goodput
    assert g is not None and g.good == 5
    assert g.request_goodput == pytest.approx(5 / m.duration_s)
    assert g.attainment_by_slo["ttft"] == pytest.approx(7 / 10)
    assert g.attainment_by_slo["tpot"] == pytest.approx(8 / 10)
    # planted usage: 5 x 60 cached of 10 x 100 prompt tokens
    assert m.total_cached_tokens == 300 and m.cache_hit_rate == pytest.approx(0.3)
    assert m.total_input_tokens == 1000 and m.total_output_tokens == 60
    body = fake.bodies[0]
    assert body["model"] == "fake-model" and body["top_k"] == 3 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert ("messages" in body) == (backend == "openai-chat")
    [rec] = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert rec["completed"] == 10 and rec["goodput_good"] == 5
    assert rec["p90_ttft_ms"] == pytest.approx(m.ttft.p90)
    assert rec["cache_hit_rate"] == pytest.approx(0.3)


def test_failures_are_counted_and_sweep_plots_written(fake, tmp_path):
    kinds = ["fast"] * 4 + ["fail"] * 2
    plots = tmp_path / "plots"
    out_file = tmp_path / "sweep.jsonl"
    code = cli.main([
        "bench", "serve", "--backend", "openai", "--base-url", fake.url,
        "--dataset-name", "custom", "--dataset-path", _dataset(tmp_path, kinds),
        "--request-rate", "200,400,inf", "--slo", "e2e=60000", "--disable-tqdm",
        "--plot", str(plots), "--output-file", str(out_file), "--output-details"])
    assert code == 0
    recs = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["request_rate"] for r in recs] == [200, 400, float("inf")]
    for r in recs:
        assert (r["completed"], r["failed"]) == (4, 2)
        assert r["goodput_good"] == 4 and r["goodput_attainment"] == pytest.approx(4 / 6)
        assert sum("HTTP 400" in e and "planted failure" in e for e in r["errors"]) == 2
    for name in ("latency_cdf.png", "rate_sweep.png"):
        data = (plots / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE
        image = matplotlib.image.imread(plots / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert image.std() > 0  # not a blank canvas


def test_unreachable_server_and_bad_flags_are_errors(capsys):
    port = free_port()
    assert cli.main(["bench", "serve", "--port", str(port), "--num-prompts", "1",
                     "--disable-tqdm"]) == 2
    assert "warm-up request" in capsys.readouterr().out
    assert cli.main(["bench", "serve", "--request-rate", "0"]) == 2
    assert "--request-rate" in capsys.readouterr().out
    assert cli.main(["bench", "serve", "--extra-request-body", "[1]"]) == 2
    assert "JSON object" in capsys.readouterr().out


# --- against radixlm serve (tiny model) ------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(["--max-total-tokens", "16384", "--random-seed", "0", "--log-level",
                         "warning", "--cpu-threads", "1"],
                        tmp_path_factory.mktemp("server") / "server.log")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def _counters(server) -> tuple[int, int]:
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    return info["prompt_tokens"], info["cached_tokens"]


@pytest.mark.parametrize("backend", ["radixlm", "sglang", "openai", "openai-chat", "vllm"])
def test_against_radixlm_server(server, backend):
    args = build_parser().parse_args([
        "--backend", backend, "--base-url", server.url, "--dataset-name",
        "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
        "--gsp-system-prompt-len", "64", "--gsp-question-len", "8", "--gsp-output-len", "5",
        "--max-concurrency", "1", "--warmup-requests", "0", "--flush-cache", "--disable-tqdm"])
    before = _counters(server)
    [run] = run_benchmark(args, echo=lambda s: None)
    after = _counters(server)
    m = run.metrics
    assert (m.completed, m.failed) == (6, 0), [o.error for o in run.outputs]
    assert all(o.output_len == 5 and o.ttft > 0 and o.latency >= o.ttft for o in run.outputs)
    assert all(len(o.itl) >= 1 for o in run.outputs)
    # the client's totals are the server's own counters
    assert m.total_input_tokens == after[0] - before[0]
    assert m.total_cached_tokens == after[1] - before[1]
    # one at a time after a flush: the 2nd and 3rd prompt of each group reuse its prefix
    assert m.total_cached_tokens >= 2 * 2 * 60


def test_multi_turn_chat_reuses_the_conversation(server):
    args = build_parser().parse_args([
        "--backend", "openai-chat", "--base-url", server.url, "--dataset-name", "multi-turn",
        "--num-prompts", "2", "--multi-turn-num-turns", "3", "--multi-turn-system-prompt-len",
        "32", "--multi-turn-user-len", "8", "--multi-turn-output-len", "4",
        "--max-concurrency", "1", "--warmup-requests", "0", "--flush-cache",
        "--disable-tqdm"])
    before = _counters(server)
    [run] = run_benchmark(args, echo=lambda s: None)
    after = _counters(server)
    assert run.metrics.completed == 6
    assert run.metrics.total_cached_tokens == after[1] - before[1]
    lens = sorted(o.prompt_len for o in run.outputs)
    assert lens[-1] > lens[0]  # later turns carry the history
    # every later turn finds at least the previous turn's prompt in the cache
    assert run.metrics.cache_hit_rate > 0.5
