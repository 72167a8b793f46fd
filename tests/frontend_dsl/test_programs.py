"""The same DSL programs on the three backends: the in-process Engine, the radixlm server
through its native API, and the server's own ``/v1`` through the OpenAI client.

One ``radixlm serve`` subprocess per module serves the HTTP and OpenAI cases. The tiny
model writes gibberish, so the checks are about structure: roles and messages, streamed
pieces concatenating, fork branches reporting the shared prefix as cached, ``select``
agreeing with an independent logprob computation, errors raised.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

import radixlm as sgl

BACKENDS = ["local", "http", "openai"]


@pytest.fixture(scope="module")
def engine(make_module_engine):
    return make_module_engine(model_path=None, max_total_tokens=16384)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    port = _free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixlm.launch_server",
            "--port",
            str(port),
            "--max-total-tokens",
            "16384",
            "--random-seed",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "0"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(
                    f"radixlm serve exited ({proc.returncode}):\n"
                    f"{log.read().decode(errors='replace')[-3000:]}"
                )
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("radixlm serve did not become healthy in 120 s")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _model_name(url: str) -> str:
    data = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    return data[0]["id"]


def _make_backend(kind: str, request, engine, chat: bool = True):
    if kind == "local":
        return sgl.LocalBackend(engine)
    url = request.getfixturevalue("server_url")
    if kind == "http":
        return sgl.RuntimeEndpoint(url)
    return sgl.OpenAI(_model_name(url), base_url=url + "/v1", api_key="none", is_chat_model=chat)


@pytest.fixture(params=BACKENDS)
def backend(request, engine):
    be = _make_backend(request.param, request, engine)
    yield be
    be.shutdown()


@pytest.fixture
def completion_backend(request, engine):
    """Text in, text out: the OpenAI backend in completion mode (select, fork)."""
    kind = request.param
    be = _make_backend(kind, request, engine, chat=False)
    yield be
    be.shutdown()


def _dsl_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("radixlm-dsl")]


@sgl.function
def chat(s, question):
    s += sgl.system("You answer briefly.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))


def test_roles_and_messages(backend):
    state = chat.run(question="What is a radix tree?", temperature=0, backend=backend)
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    assert msgs[1]["content"] == "What is a radix tree?"
    assert msgs[2]["content"] == state["answer"].lstrip()  # SGLang strips a message's left
    tpl = backend.get_chat_template()
    assert state.text().startswith(tpl.prefix("system") + "You answer briefly.")
    assert state.text().endswith(state["answer"] + tpl.suffix("assistant"))
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] <= 8
    assert not _dsl_threads()


def test_stream_pieces_concatenate(backend):
    state = chat.run(question="Tell me a story.", temperature=0, stream=True, backend=backend)
    pieces = list(state.text_iter())
    assert len(pieces) > 1
    assert "".join(pieces) == state.text()
    again = chat.run(question="Tell me a story.", temperature=0, stream=True, backend=backend)
    assert "".join(again.text_iter("answer")) == again["answer"] == state["answer"]


@sgl.function
def drafts(s, topic):
    s += "You write short notes about many topics. " * 8 + f"Topic: {topic}."
    forks = s.fork(3)
    forks += lambda i: f" Draft {i}:" + sgl.gen("draft", max_tokens=6)
    forks.join()


@pytest.mark.parametrize("completion_backend", BACKENDS, indirect=True)
def test_fork_branches_share_cached_prefix(completion_backend, engine):
    state = drafts.run(topic="caches", temperature=0, backend=completion_backend)
    prefix = "You write short notes about many topics. " * 8 + "Topic: caches."
    n_prefix = len(engine.tokenizer.encode(prefix, add_special_tokens=False))
    assert len(state["draft"]) == 3
    for meta in state.get_meta_info("draft"):
        assert meta["cached_tokens"] >= n_prefix, meta


CHOICES = [" billing", " shipping", " technical support", " other"]


@sgl.function
def classify(s, ticket):
    s += f"Ticket: {ticket}\nTeam:" + sgl.select("team", choices=CHOICES)


def _independent_best(engine, prefix: str, choices: list[str]) -> str:
    """Mean logprob of each choice's tokens after the prefix, straight from the Engine."""
    tok = engine.tokenizer
    n = len(tok.encode(prefix, add_special_tokens=False))
    scores = []
    for c in choices:
        assert tok.encode(prefix + c, add_special_tokens=False)[:n] == tok.encode(
            prefix, add_special_tokens=False
        )
        out = engine.generate(
            prefix + c, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=n
        )
        lps = [e[0] for e in out["meta_info"]["input_token_logprobs"]]
        scores.append(sum(lps) / len(lps))
    return choices[max(range(len(choices)), key=lambda i: (scores[i], -i))]


@pytest.mark.parametrize("completion_backend", BACKENDS, indirect=True)
def test_select_matches_independent_logprobs(completion_backend, engine):
    for ticket in ("My parcel never arrived", "I was charged twice", "The app crashes"):
        state = classify.run(ticket=ticket, backend=completion_backend)
        expected = _independent_best(engine, f"Ticket: {ticket}\nTeam:", CHOICES)
        assert state["team"] == expected
        assert state.text().endswith("Team:" + expected)


@sgl.function
def short(s, i):
    s += sgl.system("Shared instructions for every program in the batch. " * 4)
    s += sgl.user(f"Item {i}") + sgl.assistant(sgl.gen("out", max_tokens=4))


def test_run_batch_64_with_progress_bar(backend, engine, capsys):
    states = short.run_batch(
        [{"i": i} for i in range(64)], temperature=0, progress_bar=True, backend=backend
    )
    assert len(states) == 64
    assert all(s.error() is None and isinstance(s["out"], str) for s in states)
    assert "64/64" in capsys.readouterr().err
    assert not _dsl_threads()
    if not isinstance(backend, sgl.OpenAI):  # the traced prefix was cached before the batch
        prefix = short.trace(backend=backend)
        assert prefix.endswith(backend.get_chat_template().suffix("system"))
        n_prefix = len(engine.tokenizer.encode(prefix, add_special_tokens=False))
        assert all(s.get_meta_info("out")["cached_tokens"] >= n_prefix for s in states)


def test_failed_backend_call_raises(backend):
    @sgl.function
    def bad(s):
        s += "Hello" + sgl.gen("x", max_tokens=4, temperature=-1.0)
        s += "never reached"

    with pytest.raises((ValueError, sgl.BackendError)):
        bad.run(backend=backend)
    states = bad.run_batch([{}, {}], backend=backend, raise_errors=False)
    assert all(s.error() is not None for s in states)
    assert not _dsl_threads()


def test_openai_chat_select_says_it_cannot(request, engine):
    be = _make_backend("openai", request, engine, chat=True)
    with pytest.raises(NotImplementedError, match="chat API"):
        classify.run(ticket="x", backend=be)
    be.shutdown()
