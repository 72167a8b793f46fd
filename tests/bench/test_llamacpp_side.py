"""benchmarks/llamacpp_side: the parts that need no llama.cpp (arguments, prompts, figures and
tables from made-up results, the converter's patches, the server commands), and, when
llama.cpp's venv is there, greedy tokens of a Q8_0 file made by llama.cpp's own tools from
llama.cpp and from radixlm."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import llamacpp_side_by_side as side  # noqa: E402
from llamacpp_side import convert, report  # noqa: E402
from llamacpp_side.files import default_tools, gguf_file  # noqa: E402
from llamacpp_side.protocol import parse_result, result_line  # noqa: E402
from llamacpp_side.served import Served, client_command, server_command  # noqa: E402
from llamacpp_side.workers import run_llama_worker, run_radixlm_worker  # noqa: E402
from vllm_side.served import ServedLoad  # noqa: E402


def test_quick_sets_only_what_the_command_line_left():
    args = side.parse_args(["--quick", "--rounds", "3", "--models", "small"])
    assert args.rounds == 3 and args.models == ["small"]  # given: kept, even at the default
    assert (args.prompt_len, args.decode_len, args.serve_rates) == (128, 32, "1")
    full = side.parse_args([])
    assert (full.rounds, full.prompt_len, full.streams, full.formats) == (
        3, 512, [8, 32], ["BF16", "Q8_0", "Q4_K_M"])
    load = side.check(full)
    assert load == ServedLoad((0.5, 2.0), 16, 256, 64)


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds"), (["--decode-len", "1"], "--decode-len"),
    (["--streams", "8", "0"], "--streams"), (["--serve-rates", "1,x"], "--serve-rates"),
    (["--serve-rates", "0"], "positive")])
def test_bad_arguments_are_named(argv, message):
    with pytest.raises(ValueError, match=message):
        side.check(side.parse_args(argv))
    with pytest.raises(SystemExit):
        side.parse_args(["--formats", "Q5_K"])


def test_bench_spec_same_ids_for_both_and_every_round():
    args = side.parse_args(["--prompt-len", "20", "--streams", "2", "3",
                            "--stream-prompt-len", "5"])
    spec = side.bench_spec(args, 100)
    assert spec == side.bench_spec(args, 100)  # seeded: every round, both systems
    assert len(spec["single"]["prompt"]) == 20 and spec["single"]["decode"] == 128
    assert [len(s["prompts"]) for s in spec["streams"]] == [2, 3]
    every = spec["warmup"] + spec["single"]["prompt"] + [
        t for s in spec["streams"] for p in s["prompts"] for t in p]
    assert min(every) >= side.FIRST_ID and max(every) < 100
    assert len({tuple(p) for p in spec["streams"][1]["prompts"]}) == 3
    other = side.bench_spec(side.parse_args(["--seed", "1", "--prompt-len", "20"]), 100)
    assert other["single"] != spec["single"]


def _bench(prompt_s: float, total_s: float, stream_s: float) -> dict:
    return {"single": {"first_token_s": prompt_s, "seconds": total_s, "prompt_tokens": 100,
                       "output_tokens": 11, "output_ids": [[1, 2, 3]]},
            "streams_8": {"first_token_s": None, "seconds": stream_s, "prompt_tokens": 800,
                          "output_tokens": 80, "output_ids": [[4, 5], [6]]}}


def test_metrics_and_offline_table():
    # prompt 100 tokens in 0.5 s: 200 tok/s; 10 decode tokens in 1.5 - 0.5 s: 10 tok/s
    assert report.metrics(_bench(0.5, 1.5, 4.0)) == {
        "prompt tok/s": 200.0, "decode tok/s, 1 stream": 10.0,
        "8 streams, output tok/s": 20.0}
    results: dict = {}
    for ours, theirs in (((0.5, 1.5, 4.0), (1.0, 3.0, 8.0)), ((0.25, 1.25, 2.0),
                                                              (1.0, 2.0, 8.0))):
        report.add_offline(results, "small", "Q8_0", "radixlm", _bench(*ours))
        report.add_offline(results, "small", "Q8_0", "llamacpp", _bench(*theirs))
    table = report.offline_table(results, {"small": {"Q8_0": 128 * 2**20}}).splitlines()
    assert table[0] == ("| model | format | file MiB | metric | radixlm | llama.cpp | ratio | "
                        "round by round |")
    # prompt: ours 200, 400 (median 300); theirs 100, 100: 3.00x, round by round 2-4
    assert table[2] == ("| small | Q8_0 | 128 | prompt tok/s | 300.0 (200.0-400.0) | "
                        "100.0 (100.0-100.0) | 3.00x | 3.00 (2.00-4.00)x |")
    # decode: ours 10, 10; theirs 10/2 = 5, 10/1 = 10
    assert table[3] == ("| small | Q8_0 | 128 | decode tok/s, 1 stream | 10.0 (10.0-10.0) | "
                        "7.5 (5.0-10.0) | 1.33x | 1.50 (1.00-2.00)x |")
    assert table[4].startswith("| small | Q8_0 | 128 | 8 streams, output tok/s | 30.0 ")
    results["probe"] = {"small": {"Q8_0": {"radixlm": [40.0, 60.0], "llamacpp": [55.0]}}}
    assert report.probe_table(results).splitlines()[2] == "| small | Q8_0 | 50 (40-60) | 55 |"
    report.add_offline(results, "1b", "BF16", "llamacpp", _bench(1.0, 2.0, 8.0))
    assert report.offline_table(results).splitlines()[-1] == (
        "| 1b | BF16 | - | 8 streams, output tok/s | - | 10.0 | - | - |")  # one system


def test_token_match_and_served_tables():
    results: dict = {}
    report.add_token_match(results, "small", "BF16", {
        "radixlm": {"single": {"output_ids": [[1, 2, 3, 4]]}},
        "llamacpp": {"single": {"output_ids": [[1, 2, 9, 4]]}}})
    assert results["token_match"] == {"small": {"BF16": {"single": [0.5]}}}
    report.add_token_match(results, "small", "Q8_0", {"radixlm": {}})  # one system: none
    assert report.match_table(results).splitlines()[2] == "| small | BF16 | single | 50% |"
    record = {"output_throughput": 50.0, "median_ttft_ms": 20.0, "p99_ttft_ms": 40.0,
              "median_tpot_ms": 9.5, "p99_tpot_ms": None, "failed": 0, "duration": 3.0}
    report.add_served(results, "small", "Q8_0", "llamacpp", {"1": record})
    report.add_served(results, "small", "Q8_0", "radixlm",
                      {"1": {**record, "output_throughput": 90.0, "failed": 2}})
    served = report.served_table(results).splitlines()
    assert served[2] == "| small | Q8_0 | 1 | radixlm | 90.0 | 20 | 40 | 9.5 | - | 2 |"
    assert served[3] == "| small | Q8_0 | 1 | llama.cpp | 50.0 | 20 | 40 | 9.5 | - | 0 |"


def test_greedy_agreement():
    theirs = {"output_ids": [[5, 6, 7], [1, 2, 3]], "margins": [[3.0, 0.4, 2.0], [4, 4, 4]],
              "near": [[[5], [6, 8], [7]], [[1], [2], [3]]]}
    assert report.greedy_agreement(theirs, [[5, 6, 7], [1, 2, 3]], 1.0) == (6, [])
    # a near-tie parts them (margin 0.4, token 8 within the bound): nothing after compared
    assert report.greedy_agreement(theirs, [[5, 8, 0], [1, 2, 3]], 1.0) == (4, [])
    equal, problems = report.greedy_agreement(theirs, [[5, 6, 7], [1, 9, 3]], 1.0)
    assert equal == 4 and problems[0].startswith("prompt 1 token 1: radixlm 9, llama.cpp 2")
    # a token outside llama.cpp's near set fails even at a small margin
    assert report.greedy_agreement(theirs, [[5, 7, 7], [1, 2, 3]], 1.0)[1]
    assert "2 tokens" in report.greedy_agreement(theirs, [[5, 6], [1, 2, 3]], 1.0)[1][0]
    results: dict = {}
    report.add_tokens(results, "small", "Q8_0", theirs, [[5, 8, 0], [1, 9, 3]], 1.0)
    assert report.tokens_table(results).splitlines()[2] == "| small | Q8_0 | 2/6 | 0.40, 4.00 | 1 |"


class _TextModel:
    """Stands in for llama.cpp's conversion.base.TextModel."""

    def __init__(self, dir_model: Path, known: bool) -> None:
        self.dir_model, self.known = dir_model, known

    def get_vocab_base_pre(self, tokenizer) -> str:
        if not self.known:
            raise NotImplementedError("BPE pre-tokenizer was not recognized")
        return "llama-bpe"

    def _create_vocab_sentencepiece(self):
        return "read"


def test_convert_patches_only_the_refusals(tmp_path):
    convert.patch(_TextModel)
    assert _TextModel(tmp_path, known=True).get_vocab_base_pre(None) == "llama-bpe"
    assert _TextModel(tmp_path, known=False).get_vocab_base_pre(None) == "gpt-2"
    with pytest.raises(FileNotFoundError, match="tokenizer.model"):
        _TextModel(tmp_path, known=True)._create_vocab_sentencepiece()
    (tmp_path / "tokenizer.model").touch()
    assert _TextModel(tmp_path, known=True)._create_vocab_sentencepiece() == "read"


def test_result_line_and_host_info():
    assert parse_result(f"noise\n{result_line({'a': [1]})}\nmore\n") == {"a": [1]}
    with pytest.raises(ValueError, match="no result line"):
        parse_result("noise only\n")
    host = side.host_info()
    assert host["cpu"] and set(host["flags"]) <= set(side.CPU_FLAGS)


def test_server_and_client_commands(tmp_path):
    tools = default_tools(2)
    load = ServedLoad((1.0,), 8, 128, 32)
    theirs = server_command("llamacpp", Served(tools, 4096, None), tmp_path / "m.gguf", load,
                            5000)
    assert theirs[:3] == [str(tools.python), "-m", "llama_cpp.server"]
    assert theirs[theirs.index("--interrupt_requests") + 1] == "False"
    assert theirs[theirs.index("--n_ctx") + 1] == "224"
    ours = server_command("radixlm", Served(tools, 4096, "bfloat16"), tmp_path, load, 5000)
    assert ours[ours.index("--dtype") + 1] == "bfloat16" and "--cpu-threads" in ours
    assert "--dtype" not in server_command("radixlm", Served(tools, 4096, None), tmp_path,
                                           load, 5000)
    client = client_command("llamacpp", "http://x", tmp_path, load, 1.0, 1, tmp_path / "o")
    assert client[-2:] == ["--extra-request-body", '{"min_tokens": 32}']
    assert "--extra-request-body" not in client_command("radixlm", "http://x", tmp_path, load,
                                                        1.0, 1, tmp_path / "o")


TOOLS = default_tools(2)
# llama.cpp's Q8_0 path against exact float math over the same dequantized weights (the
# tiny preset, its Q8_0 weights dequantized by gguf.quants into an F32 file, 350 positions
# of 6 prompts teacher-forced): the top-2 margin moved by at most 1.20 logits (rms 0.27;
# logits' std 5.6), from rounding the activations to 8 bits per block of 32. radixlm's own
# rounding (bf16 activations, or int8 ones) is of the same size, so where llama.cpp's margin
# exceeds twice that the two must pick the same token.
MARGIN_BOUND = 2.5


@pytest.mark.skipif(not TOOLS.python.exists(),
                    reason=f"llama.cpp's venv is not at {TOOLS.venv}")
def test_q8_0_greedy_tokens_equal_llama_cpp_where_decisive(tmp_path, tiny_llama_dir):
    """The tiny preset's Q8_0 file, converted and quantized by llama.cpp's own tools: greedy
    tokens of 3 prompts x 16 from llama.cpp and from radixlm's Engine on the same file, equal
    up to each prompt's first difference, which may only come at a near-tie."""
    if not (TOOLS.llama_cpp_src / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not unpacked at {TOOLS.llama_cpp_src}")
    path = gguf_file(TOOLS, tiny_llama_dir, "Q8_0", tmp_path, tmp_path / "log")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (7, 19, 40)]
    spec = {"mode": "greedy", "model": str(path), "threads": 2, "prompts": prompts,
            "tokens": 16, "near": MARGIN_BOUND}
    theirs = run_llama_worker(TOOLS, spec, tmp_path / "log")
    ours = run_radixlm_worker(spec, tmp_path / "log")["output_ids"]
    equal, problems = report.greedy_agreement(theirs, ours, MARGIN_BOUND)
    assert not problems, problems
    decisive = sum(m > MARGIN_BOUND for ms in theirs["margins"] for m in ms)
    assert decisive >= 5, f"only {decisive} decisive positions: the check says little"
    assert equal >= 3, f"{equal} tokens equal before the first differences"
