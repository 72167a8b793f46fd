"""--log-requests-file: one JSON record per finished request, on every generating route,
with the prompt (cut past --log-requests-max-chars), the tenant but never a salt, token
counts, finish reason and latencies; --log-requests (SGLang's flag) on the console."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from radixlm.runtime.entrypoints.server_process import ServerProcess
from radixlm.runtime.managers.tokenizer_manager.request_log import TRUNCATION_MARK

KEY = "sk-alice-123"
SALT = "s3cr3t-salt-value-0xdeadbeef"
MAX_CHARS = 300
LONG = "The quick brown fox jumps over the lazy dog. " * 20  # 900 characters
SP = {"max_new_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    d = tmp_path_factory.mktemp("request_log")
    (d / "keys.txt").write_text(f"{KEY} alice\n")
    log_file = d / "requests.jsonl"
    srv = ServerProcess(["--api-key", str(d / "keys.txt"), "--log-requests-file", str(log_file),
                         "--log-requests-max-chars", str(MAX_CHARS), "--log-requests",
                         "--log-requests-level", "0", "--max-total-tokens", "8192"],
                        d / "server.log")
    try:
        srv.wait_healthy(headers=HEADERS)
        expected = _send_all(srv.url)
        records = _read(log_file, expected)
    finally:
        srv.stop()
    return records, log_file.read_text(), srv.log()


HEADERS = {"Authorization": f"Bearer {KEY}"}


def _post(url: str, path: str, body: dict) -> httpx.Response:
    resp = httpx.post(url + path, json=body, headers=HEADERS, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp


def _send_all(url: str) -> int:
    """Every kind of request once; returns how many records they make."""
    _post(url, "/generate", {"text": "Hello there", "sampling_params": SP, "rid": "plain"})
    _post(url, "/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": SP, "rid": "ids"})
    _post(url, "/generate", {"text": ["batch one", "batch two"], "sampling_params": SP,
                             "rid": ["b1", "b2"]})
    _post(url, "/generate", {"text": LONG, "sampling_params": SP, "rid": "long"})
    _post(url, "/generate", {"text": "salted prompt", "sampling_params": SP, "rid": "salted",
                             "cache_salt": SALT})
    _post(url, "/generate", {"text": "two samples", "rid": "nn",
                             "sampling_params": {**SP, "n": 2, "temperature": 1.0,
                                                 "ignore_eos": True}})
    with httpx.stream("POST", url + "/generate", headers=HEADERS, timeout=120, json={
            "text": "streamed", "sampling_params": SP, "rid": "stream", "stream": True}) as r:
        assert r.status_code == 200
        r.read()
    # sampled at the API's temperature 1: ignore_eos, so every record ends by its length
    _post(url, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3,
                                   "ignore_eos": True})
    _post(url, "/v1/chat/completions", {"max_tokens": 3, "ignore_eos": True, "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi"}]})
    return 11


def _read(path, expected: int, timeout: float = 60.0) -> list[dict]:
    """The records, once ``expected`` of them are written (the writer is a thread)."""
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= expected:
            break
        time.sleep(0.1)
    return [json.loads(line) for line in lines]


def _by_rid(records: list[dict]) -> dict[str, dict]:
    return {r["rid"]: r for r in records}


def test_one_record_per_finished_request(logged):
    records, _, _ = logged
    assert len(records) == 11, [r["rid"] for r in records]
    rids = _by_rid(records)
    assert {"plain", "ids", "b1", "b2", "long", "salted", "nn-0", "nn-1", "stream"} <= set(rids)
    routes = sorted(r["route"] for r in records)
    assert routes.count("/generate") == 9
    assert routes.count("/v1/completions") == routes.count("/v1/chat/completions") == 1


def test_records_hold_the_fields(logged):
    records, _, _ = logged
    for r in records:
        assert isinstance(r["time"], float) and r["time"] > 1.6e9
        assert r["prompt_tokens"] > 0 and 0 <= r["cached_tokens"] < r["prompt_tokens"]
        assert r["completion_tokens"] in (3, 4)
        assert r["finish_reason"]["type"] == "length"
        lat = r["latency"]
        assert 0 < lat["ttft"] <= lat["e2e"] and lat["tpot"] >= 0
        assert r["tenant"] == "alice" and r["namespace"] == "tenant:alice"
        assert r["truncated"] is (r["rid"] == "long")
    rids = _by_rid(records)
    assert rids["plain"]["text"] == "Hello there"
    assert rids["ids"]["input_ids"] == [5, 6, 7, 8] and "text" not in rids["ids"]
    assert rids["b2"]["text"] == "batch two"
    assert rids["stream"]["stream"] is True and rids["plain"]["stream"] is False
    assert rids["nn-0"]["text"] == rids["nn-1"]["text"] == "two samples"
    assert rids["plain"]["sampling_params"]["max_new_tokens"] == 4
    chat = next(r for r in records if r["route"] == "/v1/chat/completions")
    assert chat["messages"] == [{"role": "system", "content": "You are terse."},
                                {"role": "user", "content": "Say hi"}]
    completion = next(r for r in records if r["route"] == "/v1/completions")
    assert completion["text"] == "Once upon a time"


def test_a_long_prompt_is_cut_and_marked(logged):
    records, _, _ = logged
    long = _by_rid(records)["long"]
    mark = TRUNCATION_MARK.format(n=len(LONG) - MAX_CHARS)
    assert long["text"] == LONG[:MAX_CHARS] + mark
    assert long["prompt_tokens"] > MAX_CHARS // 10  # the server saw the whole prompt


def test_no_salt_or_key_is_written(logged):
    records, text, console = logged
    assert SALT not in text and KEY not in text
    assert SALT not in console and KEY not in console
    assert _by_rid(records)["salted"]["namespace"] == "tenant:alice"


def test_console_records_at_level_0_hold_no_prompt(logged):
    _, _, console = logged
    lines = [json.loads(line.split("request ", 1)[1]) for line in console.splitlines()
             if "radixlm.runtime.managers.tokenizer_manager.request_log: request {" in line]
    assert len(lines) == 11
    for view in lines:
        assert not {"text", "messages", "input_ids", "sampling_params"} & set(view)
        assert view["prompt_tokens"] > 0 and view["latency"]["e2e"] > 0


def test_prefix_report_reads_the_log(logged, tmp_path):
    from radixlm.analysis.prefix_report import prefix_report
    from radixlm.analysis.prompts import load_prompts

    _, text, _ = logged
    path = tmp_path / "requests.jsonl"
    path.write_text(text)
    prompts, skipped = load_prompts(path)
    assert skipped == 1  # the input_ids record: no tokenizer to decode it
    assert len(prompts) == 10
    long = next(p for p in prompts if p.truncated)
    assert long.text == LONG[:MAX_CHARS]  # the mark is not part of the prompt
    assert any(p.text == "<|system|>\nYou are terse.\n<|user|>\nSay hi\n" for p in prompts)
    assert all(p.namespace == "tenant:alice" for p in prompts)
    report = prefix_report(prompts)
    assert report["requests"] == 10 and report["truncated_prompts"] == 1
    assert report["observed_hit_rate"] is not None


def test_engine_writes_the_same_records(make_engine, tmp_path, caplog):
    """The offline Engine honours --log-requests / --log-requests-file too (route
    ``Engine.generate``): text or ids, stream or not, batches one record per prompt."""
    path = tmp_path / "engine.jsonl"
    eng = make_engine(log_requests_file=str(path), log_requests=True, log_requests_level=1,
                      log_requests_max_chars=MAX_CHARS)
    with caplog.at_level("INFO", logger="radixlm.runtime.managers.tokenizer_manager.request_log"):
        eng.generate("Hello there", SP, rid="eng-text")
        eng.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=SP, rid=["eng-a", "eng-b"])
        list(eng.generate(LONG, SP, stream=True, rid="eng-stream"))
        eng.shutdown()  # writes what is queued
    records = {r["rid"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert set(records) == {"eng-text", "eng-a", "eng-b", "eng-stream"}
    for r in records.values():
        assert r["route"] == "Engine.generate" and r["completion_tokens"] == 4
        assert r["finish_reason"]["type"] == "length"
        assert r["sampling_params"]["max_new_tokens"] == 4
        assert r["latency"]["ttft"] is not None and r["latency"]["e2e"] >= r["latency"]["ttft"]
    assert records["eng-text"]["text"] == "Hello there" and not records["eng-text"]["stream"]
    assert records["eng-a"]["input_ids"] == [5, 6, 7] and records["eng-b"]["input_ids"] == [8, 9]
    stream = records["eng-stream"]
    assert stream["stream"] and stream["truncated"]
    assert TRUNCATION_MARK.split("{")[0] in stream["text"]
    console = [m for m in caplog.messages if m.startswith("request ")]
    assert len(console) == 4 and all('"text"' not in m for m in console)  # level 1: no prompt
