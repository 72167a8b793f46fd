"""benchmarks/quantized_formats.py: its pure parts (arguments, rounds, rates from a fake
clock, the summary and table from made-up results, the result line, the host line) and the
RSS probe against memory this test touches itself. No model is loaded."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import quantized_formats as qf  # noqa: E402

MIB = 1 << 20


def test_defaults_quick_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    args = qf.parse_args([])
    assert (args.preset, args.rounds, args.threads, args.out) == ("small", 3, 2, None)
    assert qf.parse_args(["--quick"]).rounds == 1
    assert qf.parse_args(["--quick", "--rounds", "2"]).rounds == 2  # given: kept
    for bad in (["--rounds", "0"], ["--preset", "7b"], ["--formats", "GGUF Q9"]):
        with pytest.raises(SystemExit):
            qf.parse_args(bad)
    assert "GGUF Q9" in capsys.readouterr().err


def test_rows_the_baseline_first_and_alternating_rounds() -> None:
    rows = qf.selected(["AWQ g128", "GGUF Q8_0"])
    assert [v.name for v in rows] == ["bf16", "GGUF Q8_0", "AWQ g128"]
    assert qf.round_order(rows, 0) == rows and qf.round_order(rows, 1) == rows[::-1]
    every = qf.selected(None)
    assert len(every) == len(qf.VARIANTS) and every[0].name == qf.BASELINE
    slugs = [v.slug for v in every if v.kind != "float"]
    assert len(set(slugs)) == len(slugs), slugs  # no two formats share a cache path
    names = {v.name for v in every}
    for required in ("GGUF BF16", "GGUF Q8_0", "GGUF Q4_0", "GGUF Q4_K_M", "GGUF Q6_K",
                     "bf16 + int8wo", "GPTQ g128", "GPTQ g128 act-order"):
        assert required in names


def test_rate_subtracts_the_prefill_and_refuses_noise() -> None:
    assert qf.rate(63, 3.5, 0.35) == pytest.approx(20.0)
    assert qf.rate(512, 2.0) == 256.0
    assert math.isnan(qf.rate(63, 0.3, 0.35))


def test_timed_runs_on_a_fake_engine() -> None:
    """A fake clock: a prefill costs 0.01 s per prompt token, a decode step 0.1 s per
    batch; each request set must be flushed before it runs."""
    clock = [0.0]
    flushed = []

    def generate(prompts: list[list[int]], new: int) -> list[list[int]]:
        assert flushed and flushed.pop(), "not flushed before the request"
        clock[0] += 0.01 * sum(map(len, prompts)) + 0.1 * (new - 1)
        return [[1] * new for _ in prompts]

    def flush() -> None:
        flushed.append(True)

    flushed.append(True)  # the warm-up runs unflushed
    out = qf.timed_runs(generate, flush, {"vocab": 1000, "output_len": 64},
                        clock=lambda: clock[0])
    assert out["decode_1"] == pytest.approx(10.0)  # 63 tokens in 6.3 s after the prefill
    assert out["prompt"] == pytest.approx(100.0)
    assert out["decode_8"] == pytest.approx(80.0)  # 8 streams at 0.1 s a step


def test_workload_shapes_and_seed() -> None:
    w = qf.workload(500)
    assert [len(p) for p in w["short"] + w["long"]] == [64, 512]
    assert [len(p) for p in w["many"]] == [64] * 8
    assert all(10 <= t < 500 for p in w["many"] for t in p)
    assert qf.workload(500) == w and qf.workload(500, seed=1) != w


def _result(d1: float, prompt: float, d8: float, resident_mb: float = 300) -> dict:
    return {"decode_1": d1, "prompt": prompt, "decode_8": d8, "file_bytes": 250e6,
            "resident_bytes": resident_mb * 1e6}


def test_summary_and_table_from_made_up_rounds() -> None:
    rounds = [
        {"bf16": _result(10, 100, 40), "GGUF Q4_K_M": _result(20, 80, 60, 100),
         "AWQ g128": {"error": "exit 1: ValueError: bad"}},
        {"bf16": _result(12, 110, 44), "GGUF Q4_K_M": _result(float("nan"), 90, 70, 110),
         "AWQ g128": {"error": "exit 1: ValueError: bad"}},
        {"bf16": _result(11, 90, 42), "GGUF Q4_K_M": _result(24, 70, 80, 90),
         "AWQ g128": {"error": "exit 1: ValueError: bad"}},
    ]
    s = qf.summarize(rounds)
    q = s["GGUF Q4_K_M"]
    assert q["decode_1"]["median"] == 22 and q["decode_1"]["x_base"] == pytest.approx(2.0)
    assert (q["decode_8"]["min"], q["decode_8"]["max"]) == (60, 80)
    assert q["prompt"]["x_base"] == pytest.approx(0.8)
    assert q["resident_bytes"] == 100e6 and s["AWQ g128"]["error"].endswith("bad")
    text = qf.table(s, {"GGUF Q4_K_M": {"decode_1": 7.25}, "AWQ g128": {"error": "a | b"}})
    lines = text.splitlines()
    assert lines[0].startswith("| format | file MB | resident MB")
    assert len({line.count("|") for line in lines}) == 1, text  # every row has every column
    row = next(line for line in lines if line.startswith("| GGUF Q4_K_M"))
    assert "| 250.0 | 100.0 | 0.40 |" in row and "22.0 (20.0-24.0), 2.00x" in row
    assert row.endswith("| 7.2 |")
    assert "refused: a / b" in text and "| bf16 |" in text and "not tried" in text
    assert "vLLM" not in qf.table(s)


def test_result_line_and_error_line() -> None:
    out = "log\n" + qf.RESULT_PREFIX + '{"decode_1": 1.5}\nmore log\n'
    assert qf.parse_result(out) == {"decode_1": 1.5}
    with pytest.raises(ValueError):
        qf.parse_result("no result\n")
    err = "Traceback (most recent call last):\n  File x\nValueError: no such format\n\n"
    assert qf.first_error_line(err) == "ValueError: no such format"
    assert qf.first_error_line("") == "no output"


def test_host_info_reads_the_first_cpu() -> None:
    cpuinfo = ("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx512_vnni "
               "avx512_bf16\n\nprocessor\t: 1\nmodel name\t: other\nflags\t: amx_tile\n")
    info = qf.host_info(cpuinfo)
    assert info["cpu"] == "AMD EPYC 9R14"
    assert info["flags"]["avx512_vnni"] and info["flags"]["avx512_bf16"]
    assert not info["flags"]["amx_tile"]


def test_rss_probe_sees_memory_touched_here() -> None:
    before = qf.rss_kib()
    assert before["VmRSS"] >= before["RssAnon"] > 0
    buf = bytearray(96 * MIB)  # zero-filled: every page touched
    after = qf.rss_kib()
    assert after["RssAnon"] - before["RssAnon"] >= 80 * 1024, (before, after)
    del buf


def test_rss_probe_counts_the_children() -> None:
    code = "import sys; b = bytearray(64 << 20); print('ready', flush=True); sys.stdin.read()"
    alone = qf.rss_kib()
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with_child = qf.rss_kib()
        own = qf.rss_kib(child.pid)
    finally:
        child.communicate("")
    assert own["RssAnon"] >= 60 * 1024, own
    assert with_child["VmRSS"] - alone["VmRSS"] >= 60 * 1024, (alone, with_child)


def test_disk_bytes_of_a_file_and_a_directory(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 100)
    (tmp_path / "b").write_bytes(b"x" * 23)
    assert qf.disk_bytes(tmp_path / "a") == 100 and qf.disk_bytes(tmp_path) == 123


def test_a_worker_that_dies_is_one_error_line(tmp_path: Path) -> None:
    res = qf.run_worker(sys.executable, "--worker", {"model": str(tmp_path / "missing")},
                        120, {})
    assert "error" in res and res["error"].startswith("exit 1: "), res
