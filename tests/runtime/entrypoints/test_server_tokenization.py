"""Pathological tokenization and detokenization against `radixlm serve`: a text that
cannot fit the context is refused before it is tokenized, batches and chats past the caps
are 400s naming the flag, a huge /detokenize is served, and the server keeps answering."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from radixlm.runtime.entrypoints.server_process import ServerProcess

CONTEXT = 256
CAP = 8
FLAGS = ["--context-length", str(CONTEXT), "--max-total-tokens", "1024", "--max-batch-prompts",
         str(CAP), "--max-chat-messages", str(CAP), "--log-level", "warning"]
HUGE = "a" * 2_000_000  # one word: one pre-token for BPE


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(FLAGS, tmp_path_factory.mktemp("tokenization") / "server.log")
    srv.wait_healthy()
    yield srv
    assert srv.stop() == 0, srv.log()


def post(srv: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, content=json.dumps(body), timeout=120,
                      headers={"Content-Type": "application/json"})


def chat(content: str, count: int = 1) -> dict:
    return {"messages": [{"role": "user", "content": content}] * count, "max_tokens": 1}


@pytest.mark.parametrize("path, body, param", [
    ("/generate", {"text": HUGE, "sampling_params": {"max_new_tokens": 1}}, "text"),
    ("/generate", {"text": ["hi", HUGE]}, "text"),
    ("/tokenize", {"text": HUGE}, "text"),
    ("/tokenize", {"prompt": [HUGE]}, "prompt"),
    ("/v1/completions", {"prompt": HUGE, "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", chat(HUGE), "messages"),
])
def test_text_that_cannot_fit_the_context_is_400_before_tokenizing(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert f"context of {CONTEXT} tokens" in err["message"] and "characters" in err["message"]


@pytest.mark.parametrize("path, body, param, flag", [
    ("/generate", {"text": ["hi"] * (CAP + 1)}, "text", "--max-batch-prompts"),
    ("/generate", {"input_ids": [[5, 6]] * (CAP + 1)}, "input_ids", "--max-batch-prompts"),
    ("/tokenize", {"text": ["hi"] * (CAP + 1)}, "text", "--max-batch-prompts"),
    ("/v1/completions", {"prompt": ["hi"] * (CAP + 1), "max_tokens": 1}, "prompt",
     "--max-batch-prompts"),
    ("/v1/completions", {"prompt": [[5, 6]] * (CAP + 1), "max_tokens": 1}, "prompt",
     "--max-batch-prompts"),
    ("/v1/chat/completions", chat("hi", CAP + 1), "messages", "--max-chat-messages"),
])
def test_batches_and_chats_past_the_caps_are_400(server, path, body, param, flag):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and flag in err["message"] and str(CAP) in err["message"]


def test_at_the_caps_requests_are_served(server):
    counts = post(server, "/tokenize", {"text": ["hi"] * CAP}).json()["count"]
    assert len(counts) == CAP and len(set(counts)) == 1
    r = post(server, "/v1/chat/completions", chat("hi", CAP))
    assert r.status_code == 200, r.text


def test_huge_detokenize_is_served_and_health_keeps_answering(server):
    ids = [i % 1990 + 3 for i in range(1_000_000)]
    with httpx.Client(timeout=120) as client:
        r = client.post(server.url + "/detokenize", json={"tokens": ids})
        assert r.status_code == 200
        want = client.post(server.url + "/detokenize", json={"tokens": ids[:1990]}).json()
        assert r.json()["text"].startswith(want["text"])
        assert client.get(server.url + "/health").status_code == 200


def test_aborted_logprob_streams_leave_no_state(server):
    """Streams with prompt logprobs, left after their first chunk: nothing stays in
    flight in the tokenizer manager (``tm.states``)."""
    body = {"input_ids": [7] * 200, "stream": True, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 8, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}}
    for _ in range(3):
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as resp:
            first = next(line for line in resp.iter_lines() if line.startswith("data: "))
        assert len(json.loads(first[6:])["meta_info"]["input_top_logprobs"]) == 200
    deadline = time.monotonic() + 60  # a guard: the aborts arrive within moments
    while time.monotonic() < deadline:
        info = httpx.get(server.url + "/get_server_info", timeout=10).json()
        if info["num_inflight_requests"] == 0:
            break
        time.sleep(0.1)
    assert info["num_inflight_requests"] == 0
