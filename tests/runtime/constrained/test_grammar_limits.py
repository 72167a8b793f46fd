"""What a request brings through a grammar or a stop_regex is bounded, and a grammar that
matches nothing is refused: without a model, through GrammarCompiler (with and without its
compile worker) and stop_regex's automaton. Memory limits are reached by grammars that
really blow up or by the worker's allocation hook, time limits by its delay hook; nothing
here depends on the machine's speed."""

from __future__ import annotations

import os

import pytest
import torch

from radixlm.runtime.config import GRAMMAR_BACKENDS, ServerArgs
from radixlm.runtime.constrained import GrammarCompiler, create_grammar_backend
from radixlm.runtime.constrained.compile_worker import rss_bytes
from radixlm.runtime.constrained.probe import allows_nothing
from radixlm.runtime.executor.sampling_params import SamplingParams
from radixlm.runtime.executor.stop_regex import (
    MAX_STOP_REGEX_SIZE,
    MAX_STOP_REGEX_STATES,
    contains_match,
    stop_automaton,
)
from radixlm.runtime.tokenizer import load_tokenizer
from radixlm.tiny_model import default_tiny_model_path

VOCAB = 2000
SELF_REF = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                            "required": ["c"]}}, "$ref": "#/$defs/n"}
MUTUAL = {"$defs": {
    "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
    "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
    "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}
ARRAY_REF = {"type": "object", "required": ["x"], "properties": {
    "x": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}}}
# recursive, but each has a finite instance: a tree with optional children, a nullable link
FINITE = [
    {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}},
     "$ref": "#/$defs/n"},
    {"$defs": {"n": {"type": "object", "required": ["c"], "properties": {
        "c": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}}, "$ref": "#/$defs/n"},
    {"type": "object", "required": ["kids"], "properties": {
        "kids": {"type": "array", "items": {"$ref": "#"}}}},
    {**SELF_REF, "$ref": "#/$defs/m", "$defs": {**SELF_REF["$defs"], "m": {"type": "integer"}}},
]
EMPTY_REGEX = "[^\\x00-\\U0010FFFF]"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(default_tiny_model_path("llama")))


@pytest.fixture(scope="module", params=GRAMMAR_BACKENDS)
def compiler(request, tokenizer):
    backend = create_grammar_backend(request.param, tokenizer, VOCAB, [tokenizer.eos_token_id])
    compiler = GrammarCompiler(backend, timeout_s=60)
    yield compiler
    compiler.shutdown()


@pytest.mark.parametrize("schema, where", [(SELF_REF, "#/$defs/n"), (MUTUAL, "#/$defs/"),
                                           (ARRAY_REF, "property 'x'")])
def test_schema_without_a_finite_instance_is_refused(compiler, schema, where):
    with pytest.raises(ValueError, match="admits no finite instance") as e:
        compiler.compile("json_schema", schema)
    assert where in str(e.value) and "cycle" in str(e.value)


@pytest.mark.parametrize("schema", FINITE)
def test_recursive_schema_with_a_finite_instance_compiles(compiler, schema):
    matcher = compiler.compile("json_schema", schema).new_matcher()
    assert len(matcher.forced_string()) < 100


def test_regex_that_matches_nothing_is_refused(compiler):
    # outlines-core refuses it itself, in its own words
    needle = "incompatible" if compiler.backend.name == "outlines" else "matches no string"
    with pytest.raises(ValueError, match=needle):
        compiler.compile("regex", EMPTY_REGEX)
    compiler.compile("regex", "(?:)")  # the empty string only: a match, not an error


def test_a_row_whose_mask_allows_nothing_is_detected(compiler, tokenizer):
    """What the scheduler checks when a sampled token is refused (a 400, not a 500)."""
    matcher = compiler.compile("regex", "ab?").new_matcher()
    row = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    assert allows_nothing(matcher, row[0], [tokenizer.eos_token_id])
    matcher.fill_bitmask(row, 0)
    assert not allows_nothing(matcher, row[0], [tokenizer.eos_token_id])


# --- the compile worker -----------------------------------------------------------------
def _isolated(tokenizer, name: str = "xgrammar", memory_mb: int = 256, timeout_s: float = 120,
              step_budget_ms: float = 0.0, **hooks) -> GrammarCompiler:
    backend = create_grammar_backend(name, tokenizer, VOCAB, [tokenizer.eos_token_id])
    return GrammarCompiler(backend, timeout_s=timeout_s, memory_mb=memory_mb,
                           worker_hooks=hooks or None, step_budget_ms=step_budget_ms)


def test_worker_kills_a_grammar_that_blows_up_and_serves_the_next(tokenizer):
    """xgrammar builds a 200,000-value enum with several GB (on main: in the scheduler).
    The worker dies at its limit, the scheduler's process never compiles it, and a fresh
    worker compiles the next spec."""
    compiler = _isolated(tokenizer)
    try:
        before = rss_bytes(os.getpid())
        with pytest.raises(ValueError, match=r"memory limit of 256 MB \(--grammar-compile-memory"):
            compiler.compile("json_schema", {"enum": list(range(200_000))})
        assert rss_bytes(os.getpid()) - before < 200 << 20
        assert compiler.compile("regex", "[0-9]+").new_matcher() is not None
    finally:
        compiler.shutdown()


@pytest.mark.parametrize("ebnf, rule", [('root ::= "a" root', "root"),
                                        ('root ::= "x" | "y" r\nr ::= "a" r', "r"),
                                        ('root ::= x*\nx ::= "a" x', "x")])
def test_xgrammar_rule_that_never_ends_is_refused(tokenizer, ebnf, rule):
    """Its jump-forward string would be endless: xgrammar's grew past 3 GB on main."""
    backend = create_grammar_backend("xgrammar", tokenizer, VOCAB, [tokenizer.eos_token_id])
    compiler = GrammarCompiler(backend, timeout_s=60)
    try:
        with pytest.raises(ValueError, match=f"rule '{rule}' derives no finite string"):
            compiler.compile("ebnf", ebnf)
        matcher = compiler.compile("ebnf", 'root ::= "[" ("a" | root)* "]"').new_matcher()
        assert matcher.forced_string() == "["
    finally:
        compiler.shutdown()


def test_worker_memory_limit_by_allocation_hook(tokenizer):
    compiler = _isolated(tokenizer, "llguidance", memory_mb=128, alloc_mb=512)
    try:
        with pytest.raises(ValueError, match="memory limit of 128 MB"):
            compiler.compile("regex", "[a-z]+")
    finally:
        compiler.shutdown()


def test_worker_time_limit_kills_it(tokenizer):
    compiler = _isolated(tokenizer, "outlines", timeout_s=0.5, delay_s=600.0)
    try:
        with pytest.raises(ValueError, match=r"time limit of 0.5 s \(--grammar-compile-timeout"):
            compiler.compile("regex", "[a-z]+")
        assert compiler.worker.kills == 1
    finally:
        compiler.shutdown()


@pytest.mark.parametrize("name", GRAMMAR_BACKENDS)
def test_worker_refuses_a_grammar_whose_first_steps_are_over_the_budget(tokenizer, name):
    """The probe walks a new grammar's first decode steps (mask, advance, jump-forward) in
    the worker; one that costs more than the budget (here by the step hook) is a 400 naming
    --grammar-step-budget-ms, without killing the worker."""
    backend = create_grammar_backend(name, tokenizer, VOCAB, [tokenizer.eos_token_id])
    compiler = GrammarCompiler(backend, timeout_s=120, memory_mb=256, step_budget_ms=20,
                               worker_hooks={"step_delay_s": 0.05})
    try:
        with pytest.raises(ValueError, match=r"per-step budget of 20 ms "
                                             r"\(--grammar-step-budget-ms\)"):
            compiler.compile("regex", "[ab]{3}")
        assert compiler.worker.kills == 0 and compiler.worker._proc.poll() is None
    finally:
        compiler.shutdown()


def test_costly_forced_text_is_refused_without_a_worker(tokenizer):
    """No compile worker (memory_mb 0): the probe of the steps runs on the compile thread;
    (a{600}){600} forces 360,000 characters, far over 5 ms of work on any machine."""
    backend = create_grammar_backend("xgrammar", tokenizer, VOCAB, [tokenizer.eos_token_id])
    compiler = GrammarCompiler(backend, timeout_s=120, step_budget_ms=5)
    try:
        with pytest.raises(ValueError, match="--grammar-step-budget-ms"):
            compiler.compile("regex", "x(a{600}){600}")
        assert compiler.compile("regex", "x(a{6}){6}").new_matcher() is not None
    finally:
        compiler.shutdown()


def test_a_regex_longer_than_any_output_is_refused_before_the_probe(tokenizer):
    """(a{2600}){2600}'s shortest match has 6.76M characters: refused by its parse, in
    microseconds, not by the seconds its forced text would take the worker to find."""
    backend = create_grammar_backend("xgrammar", tokenizer, VOCAB, [tokenizer.eos_token_id])
    compiler = GrammarCompiler(backend, timeout_s=120, memory_mb=256,
                               max_match_chars=4096 * 16)
    try:
        with pytest.raises(ValueError, match="shortest match has 6760003 characters, more "
                                             "than an output can hold \\(65536"):
            compiler.compile("regex", "x7q(a{2600}){2600}")
        assert compiler.worker._proc is None  # never probed: the worker did not even start
        assert compiler.compile("regex", "x7q((a{2600}){2600}|b)") is not None  # short one
    finally:
        compiler.shutdown()


def test_step_budget_flag_is_validated():
    assert ServerArgs().grammar_step_budget_ms == 50
    with pytest.raises(ValueError, match="grammar_step_budget_ms"):
        ServerArgs(grammar_step_budget_ms=-1)


def test_memory_flag_is_validated():
    assert ServerArgs().grammar_compile_memory_mb == 1024
    with pytest.raises(ValueError, match="grammar_compile_memory_mb"):
        ServerArgs(grammar_compile_memory_mb=1)


# --- stop_regex -------------------------------------------------------------------------
@pytest.mark.parametrize("pattern, limit", [
    ("(a{1000}){1000}", str(MAX_STOP_REGEX_SIZE)),
    ("((a{10}){10}){10}", str(MAX_STOP_REGEX_SIZE)),
    ("(a|b)*a(a|b){60}", str(MAX_STOP_REGEX_STATES)),  # the subset construction explodes
    ("(.*a.*b.*c.*d.*e.*f.*g){5}", str(MAX_STOP_REGEX_STATES)),
])
def test_stop_regex_beyond_the_limits_is_refused(pattern, limit):
    with pytest.raises(ValueError, match=f"stop_regex.*{limit}"):
        SamplingParams(stop_regex=pattern).verify(VOCAB, 4096)


def test_stop_regex_size_is_bounded_over_all_patterns():
    with pytest.raises(ValueError, match=f"in all.*limit {MAX_STOP_REGEX_SIZE}"):
        SamplingParams(stop_regex=["x{200}", "y{200}"]).verify(VOCAB, 4096)
    SamplingParams(stop_regex=["x{100}", "y{100}"]).verify(VOCAB, 4096)


def test_stop_regex_within_the_limits_keeps_its_meaning():
    assert contains_match("(ab|cd){3}", "xxabcdab")
    assert not contains_match("(ab|cd){3}", "xxabcda")
    assert contains_match("(a|b)*a(a|b){6}", "zzabbbbbb")
    assert stop_automaton("(x{16}){16}") is not None


def test_scheduler_finishes_a_row_whose_mask_allowed_nothing_as_400(compiler, tokenizer):
    """OutputProcessor._rejected: a refused sampled token is a 400 when the mask allowed
    nothing (sampling then had to pick a forbidden token), a 500 (a backend bug) else."""
    from types import SimpleNamespace

    from radixlm.runtime.managers.scheduler.output_processor import OutputProcessor

    stub = SimpleNamespace(vocab_size=VOCAB, eos_ids=[tokenizer.eos_token_id])
    matcher = compiler.compile("regex", "ab").new_matcher()
    nothing = SimpleNamespace(fill_bitmask=lambda bitmask, row: bitmask[row].zero_(),
                              is_accepting=lambda: False)
    assert OutputProcessor._rejected(stub, nothing, 0)["status_code"] == 400
    assert OutputProcessor._rejected(stub, matcher, 0)["status_code"] == 500


def test_worker_dies_with_its_parent(tokenizer, tmp_path):
    """A SIGKILLed scheduler leaves no compile worker behind (PR_SET_PDEATHSIG): the
    worker's parent is killed while the worker is busy (a probe held by the delay hook),
    so it would not read the closed pipe for minutes."""
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "worker.pid"
    script = (
        "import sys, time\n"
        "from radixlm.runtime.constrained.compile_worker import CompileWorker, WorkerConfig\n"
        f"w = CompileWorker(WorkerConfig('xgrammar', {str(default_tiny_model_path('llama'))!r}, "
        f"{len(tokenizer)}, [0], 1024, delay_s=600.0), 900.0)\n"
        "proc = w.ensure_started()\n"
        "import threading; threading.Thread(target=w.probe, args=('regex', 'a+')).start()\n"
        "time.sleep(1.0)  # the probe is sent: the worker sleeps in it, not reading\n"
        f"open({str(pid_file)!r}, 'w').write(str(proc.pid))\n")
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        for _ in range(1200):  # the worker's start-up: seconds
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.1)
        worker = int(pid_file.read_text())
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    for _ in range(100):
        try:
            with open(f"/proc/{worker}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):  # dead, not reaped
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise AssertionError(f"compile worker {worker} outlived its parent")
