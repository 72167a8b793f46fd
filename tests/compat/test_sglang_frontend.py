"""SGLang's own frontend (``sglang.lang`` from the 0.5 wheel) against ``radixlm serve``.

SGLang's ``RuntimeEndpoint`` runs programs on a radixlm server: chat roles in both forms,
select, fork/join, streaming with logprobs, regex and dtype gens, JSON from a regex. The
oracles: the regexes themselves; the server's native ``/generate`` at temperature 0 (same
text, same tokens); the same program run unforked; radixlm's own select scoring. Then the
same programs, written once, run with ``import radixlm as sgl`` against the same server
and must give the same text, variables and messages.

SGLang's frontend needs ``requests`` and ``pybase64`` (in the ``test`` extra). Two of its
imports are never used on these paths and are heavy, so they are stubbed when missing:
``IPython.display`` (``sglang.utils`` imports it for notebook printing only) and
``aiohttp`` (``runtime_endpoint`` imports it for ``Runtime.async_generate`` only).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import sys
import time
import types

import httpx
import pytest

import radixlm
from radixlm.runtime.entrypoints.server_process import ServerProcess, child_pids, pid_alive
from tests.compat.sglang_wheel import import_sglang_lang

FLAGS = ["--max-total-tokens", "16384", "--random-seed", "0", "--log-level", "warning"]
CODE_RE = r"[A-Z]{2}-[0-9]{3}"
PERSON_RE = r'\{"name": "[a-z]{2,8}", "age": [1-9][0-9]\}'
COLORS = ["red", "green", "blue"]


def _stub_if_missing(name: str, **submodules: dict[str, object]) -> None:
    """An empty module ``name`` (and ``name.sub`` with the given attributes) unless the
    real package is installed. Returns the names it put in ``sys.modules``."""
    if name in sys.modules or importlib.util.find_spec(name) is not None:
        return []
    sys.modules[name] = types.ModuleType(name)
    for sub, attrs in submodules.items():
        module = types.ModuleType(f"{name}.{sub}")
        module.__dict__.update(attrs)
        sys.modules[f"{name}.{sub}"] = module
    return [name, *(f"{name}.{sub}" for sub in submodules)]


@pytest.fixture(scope="module")
def sglang():
    """SGLang's frontend API module (``sglang.lang.api``) and its ``RuntimeEndpoint``."""
    stubs = [*_stub_if_missing("IPython", display={"HTML": None, "display": None}),
             *_stub_if_missing("aiohttp")]
    try:
        import_sglang_lang()
        api = importlib.import_module("sglang.lang.api")
        endpoint = importlib.import_module("sglang.lang.backend.runtime_endpoint")
        yield types.SimpleNamespace(api=api, RuntimeEndpoint=endpoint.RuntimeEndpoint)
    finally:  # later tests (matplotlib looks for IPython) see the real world again
        for name in stubs:
            sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(FLAGS, tmp_path_factory.mktemp("sglang_frontend") / "server.log")
    try:
        srv.wait_healthy()
        pids = child_pids(srv.proc.pid)
        yield srv
    finally:
        code = srv.stop()
    assert code == 0, srv.log()
    deadline = time.monotonic() + 30  # bounded: children exit just after the server
    while [p for p in pids if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if pid_alive(p)] == [], "processes left after shutdown"


@pytest.fixture(scope="module")
def sgl_backend(sglang, server):
    backend = sglang.RuntimeEndpoint(server.url)
    # SGLang picks a template by model path; the tiny model's path matches none
    assert backend.get_chat_template().name == "default"
    return backend


@pytest.fixture(scope="module")
def rlm_backend(server):
    backend = radixlm.RuntimeEndpoint(server.url, chat_template_name="default")
    yield backend
    backend.shutdown()


def programs(m):
    """The same programs for SGLang's module ``m`` (``sglang.lang.api``) or ``radixlm``."""

    @m.function
    def chat(s, question):
        s += m.system("You answer briefly.")
        with s.user():
            s += question
        s += m.assistant(m.gen("answer", max_tokens=8))
        s.user("Say it again, shorter.")
        with s.assistant():
            s += m.gen("again", max_tokens=6, stop_regex=r"[.!?]")

    @m.function
    def pick(s, question):
        s += m.user(question)
        s += m.assistant(m.select("color", choices=COLORS))

    @m.function
    def typed(s):
        s += "Age: " + m.gen("age", dtype=int, max_tokens=6) + "\n"
        s += "Code: " + m.gen("code", regex=CODE_RE, max_tokens=10) + "\n"
        s += "Person: " + m.gen("person", regex=PERSON_RE, max_tokens=48)

    @m.function
    def ideas(s, k):
        s += "A list of ideas:\n"
        forks = s.fork(k)
        for i in range(k):
            forks[i] += f"{i + 1}." + m.gen("idea", max_tokens=6)
        forks.join()

    @m.function
    def one_idea(s, i):
        s += "A list of ideas:\n" + f"{i + 1}." + m.gen("idea", max_tokens=6)

    @m.function
    def story(s):
        s += "Once upon a time" + m.gen("story", max_tokens=12)

    return types.SimpleNamespace(
        chat=chat, pick=pick, typed=typed, ideas=ideas, one_idea=one_idea, story=story
    )


def _native(server, text: str, **sampling) -> dict:
    body = {"text": text, "sampling_params": {"temperature": 0, **sampling}}
    resp = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _same_outputs(a, b, names: list[str]) -> None:
    assert a.text() == b.text()
    assert a.messages() == b.messages()
    for name in names:
        assert a[name] == b[name], name


def test_chat_roles_in_both_forms(sglang, sgl_backend, rlm_backend, server):
    prog = programs(sglang.api).chat
    s = prog.run(question="What is a radix tree?", temperature=0, backend=sgl_backend)
    assert s.error() is None
    roles = [m["role"] for m in s.messages()]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    prompt = "SYSTEM:You answer briefly.\nUSER:What is a radix tree?\nASSISTANT:"
    assert s.text().startswith(prompt)
    assert s["answer"] == _native(server, prompt, max_new_tokens=8)["text"]
    assert re.search(r"[.!?]", s["again"][:-1]) is None  # stop_regex ended it at the first
    ours = programs(radixlm).chat.run(
        question="What is a radix tree?", temperature=0, backend=rlm_backend
    )
    _same_outputs(s, ours, ["answer", "again"])


def test_select_agrees_with_radixlm_scoring(sglang, sgl_backend, rlm_backend):
    s = programs(sglang.api).pick.run(
        question="Name a color.", temperature=0, backend=sgl_backend
    )
    assert s["color"] in COLORS
    ours = programs(radixlm).pick.run(question="Name a color.", backend=rlm_backend)
    _same_outputs(s, ours, ["color"])
    # SGLang scores from two tokens before the prefix's end ("token healing"), radixlm
    # from the first token of the choice: SGLang's entries end with radixlm's, same values
    theirs = s.get_meta_info("color")["input_token_logprobs"]
    ours_entries = ours.get_meta_info("color")["input_token_logprobs"]
    for their_entries, our_entries in zip(theirs, ours_entries, strict=True):
        tail = their_entries[len(their_entries) - len(our_entries) :]
        assert [e[1] for e in tail] == [e[1] for e in our_entries]
        assert [e[0] for e in tail] == pytest.approx([e[0] for e in our_entries], abs=1e-4)
    ours_scores = ours.get_meta_info("color")["normalized_prompt_logprobs"]
    assert ours["color"] == COLORS[max(range(3), key=lambda i: ours_scores[i])]


def test_regex_dtype_and_json_gens(sglang, sgl_backend, rlm_backend, server):
    s = programs(sglang.api).typed.run(temperature=0, backend=sgl_backend)
    assert re.fullmatch(r"[-+]?[0-9]+", s["age"]), s["age"]
    assert re.fullmatch(CODE_RE, s["code"]), s["code"]
    assert re.fullmatch(PERSON_RE, s["person"]), s["person"]
    person = json.loads(s["person"])
    assert set(person) == {"name", "age"} and 10 <= person["age"] <= 99
    prefix = f"Age: {s['age']}\nCode: {s['code']}\nPerson: "
    assert _native(server, prefix, max_new_tokens=48, regex=PERSON_RE)["text"] == s["person"]
    ours = programs(radixlm).typed.run(temperature=0, backend=rlm_backend)
    _same_outputs(s, ours, ["age", "code", "person"])


def test_fork_join_equals_unforked_runs(sglang, sgl_backend, rlm_backend):
    progs = programs(sglang.api)
    s = progs.ideas.run(k=3, temperature=0, backend=sgl_backend)
    assert s.error() is None and len(s["idea"]) == 3
    singles = [progs.one_idea.run(i=i, temperature=0, backend=sgl_backend) for i in range(3)]
    assert s["idea"] == [one["idea"] for one in singles]
    ours = programs(radixlm).ideas.run(k=3, temperature=0, backend=rlm_backend)
    assert ours["idea"] == s["idea"]
    assert ours.text() == s.text() == "A list of ideas:\n"


def _stream(state, var_name: str) -> list:
    async def collect():
        return [x async for x in state.text_async_iter(var_name, return_meta_data=True)]

    return asyncio.run(collect())


def _is_subsequence(part: list, whole: list) -> bool:
    it = iter(whole)
    return all(x in it for x in part)


def test_streaming_with_logprobs(sglang, sgl_backend, rlm_backend, server):
    """Streamed pieces join to the native greedy text. radixlm's frontend returns every
    token's logprob entry; SGLang's keeps only the latest chunk's meta per wake-up, so
    the entries it yields are an in-order subset of the tokens."""
    logprobs = {"return_logprob": True, "top_logprobs_num": 2, "temperature": 0}
    body = {"text": "Once upon a time", "sampling_params": {"temperature": 0, "max_new_tokens": 12}}
    native = httpx.post(
        server.url + "/generate", json={**body, "return_logprob": True}, timeout=120
    ).json()
    for module, backend in ((sglang.api, sgl_backend), (radixlm, rlm_backend)):
        state = programs(module).story.run(stream=True, backend=backend, **logprobs)
        chunks = _stream(state, "story")
        assert state.error() is None
        assert "".join(piece for piece, _ in chunks) == state["story"] == native["text"]
        entries = [e for _, meta in chunks for e in meta["output_token_logprobs"]]
        tops = [t for _, meta in chunks for t in meta["output_top_logprobs"]]
        assert len(tops) == len(entries) and all(len(t) == 2 for t in tops)
        ids = [e[1] for e in entries]
        assert ids and _is_subsequence(ids, native["output_ids"]), module.__name__
        if module is radixlm:
            assert ids == native["output_ids"]
            want = [e[0] for e in native["meta_info"]["output_token_logprobs"]]
            assert [e[0] for e in entries] == pytest.approx(want, abs=1e-4)
