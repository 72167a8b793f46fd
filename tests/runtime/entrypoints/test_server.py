"""The server as a subprocess: native and OpenAI APIs, streaming, equality with the
offline Engine, concurrency, client disconnects, errors, metrics and a clean exit."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import jsonschema
import openai
import pytest

from radixlm.runtime.entrypoints.server_process import ServerProcess, child_pids, pid_alive

FLAGS = ["--max-total-tokens", "16384", "--random-seed", "0", "--log-level", "warning"]
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Hello there, my"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(FLAGS, tmp_path_factory.mktemp("server") / "server.log")
    srv.wait_healthy()
    pids = child_pids(srv.proc.pid)
    info = httpx.get(srv.url + "/get_server_info").json()
    assert {info["pids"]["scheduler"], info["pids"]["detokenizer"]} <= set(pids)
    yield srv
    assert srv.stop() == 0, srv.log()
    time.sleep(0.2)
    assert [p for p in pids if pid_alive(p)] == [], "processes left after shutdown"


@pytest.fixture(scope="module")
def engine(make_module_engine):
    return make_module_engine(max_total_tokens=16384)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


def _sse(resp: httpx.Response) -> list:
    events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _info(server) -> dict:
    return httpx.get(server.url + "/get_server_info", timeout=30).json()


def _wait_idle(server, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = _info(server)
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
            return info
        assert time.monotonic() < deadline, f"not idle: {info}"
        time.sleep(0.05)


GREEDY = {"max_new_tokens": 24, "temperature": 0}


# --- native API ---------------------------------------------------------------------------------
def test_generate_equals_engine(server, engine):
    offline = engine.generate(PROMPTS, GREEDY)
    online = _post(server, "/generate", {"text": PROMPTS, "sampling_params": GREEDY}).json()
    assert [o["output_ids"] for o in online] == [o["output_ids"] for o in offline]
    assert [o["text"] for o in online] == [o["text"] for o in offline]
    one = _post(server, "/generate", {"text": PROMPTS[0], "sampling_params": GREEDY}).json()
    assert set(one) == {"text", "output_ids", "meta_info"}
    meta = one["meta_info"]
    for key in (
        "id",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "finish_reason",
        "e2e_latency",
    ):
        assert key in meta
    assert meta["cached_tokens"] > 0  # the batch above cached the prompt
    ids = engine.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    by_ids = _post(server, "/generate", {"input_ids": ids, "sampling_params": GREEDY}).json()
    assert by_ids["output_ids"] == offline[1]["output_ids"]


def test_generate_stream_and_logprobs(server, engine):
    body = {
        "text": "Once upon a time",
        "sampling_params": GREEDY,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
        "logprob_start_len": 0,
    }
    full = _post(server, "/generate", body).json()
    offline = engine.generate(
        "Once upon a time",
        GREEDY,
        return_logprob=True,
        top_logprobs_num=2,
        return_text_in_logprobs=True,
        logprob_start_len=0,
    )
    got, want = (r["meta_info"]["output_token_logprobs"] for r in (full, offline))
    assert [e[1:] for e in got] == [e[1:] for e in want]
    assert [e[0] for e in got] == pytest.approx([e[0] for e in want], abs=1e-4)
    with httpx.stream(
        "POST", server.url + "/generate", json={**body, "stream": True}, timeout=60
    ) as resp:
        chunks = _sse(resp)
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]
    streamed = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert [e[1] for e in streamed] == full["output_ids"]
    running = [c["meta_info"]["output_token_logprobs_length"] for c in chunks]
    assert running == sorted(running) and running[-1] == len(full["output_ids"])
    inp = full["meta_info"]["input_token_logprobs"]
    assert inp[0][0] is None and isinstance(inp[1][2], str)
    assert len(full["meta_info"]["output_top_logprobs"][0]) == 2


def test_prefill_only_and_n(server):
    out = _post(
        server, "/generate", {"text": "cache me please", "sampling_params": {"max_new_tokens": 0}}
    ).json()
    assert out["meta_info"]["completion_tokens"] == 0 and out["text"] == ""
    outs = _post(
        server,
        "/generate",
        {
            "text": "Tell me a story",
            "sampling_params": {"max_new_tokens": 5, "n": 3, "temperature": 1.0},
        },
    ).json()
    assert len(outs) == 3 and all(o["meta_info"]["completion_tokens"] == 5 for o in outs)


def test_side_routes(server, engine):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] and info["tokenizer_path"]
    assert httpx.get(server.url + "/model_info").json() == info  # SGLang 0.5's names too
    assert httpx.get(server.url + "/server_info").json()["max_total_num_tokens"] > 0
    toks = _post(server, "/tokenize", {"text": "hello world"}).json()
    assert toks["tokens"] == engine.tokenizer.encode("hello world", add_special_tokens=False)
    text = _post(server, "/detokenize", {"tokens": toks["tokens"]}).json()["text"]
    assert text == "hello world"
    _wait_idle(server)
    assert _post(server, "/flush_cache", {}).status_code == 200  # SGLang: a text body
    assert _info(server)["evictable_tokens"] == 0
    assert _post(server, "/abort_request", {"rid": "nobody"}).status_code == 200


# --- OpenAI API ---------------------------------------------------------------------------------
def test_openai_completions(client, engine):
    model = client.models.list().data[0].id
    kw = {"model": model, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    out = client.completions.create(**kw)
    offline = engine.generate("Once upon a time", {"max_new_tokens": 16, "temperature": 0})
    assert out.choices[0].text == offline["text"]
    assert out.usage.completion_tokens == offline["meta_info"]["completion_tokens"]
    pieces, usage = [], None
    for chunk in client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        pieces += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == out.choices[0].text
    assert usage.completion_tokens == out.usage.completion_tokens
    multi = client.completions.create(
        model=model,
        prompt=["a b", "c d"],
        max_tokens=4,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True, "top_k": 20},
    )
    assert len(multi.choices) == 4 and multi.usage.completion_tokens == 16
    lp = client.completions.create(**kw, logprobs=2, echo=True)
    assert lp.choices[0].text.startswith("Once upon a time")
    assert lp.choices[0].logprobs.token_logprobs[0] is None
    assert len(lp.choices[0].logprobs.top_logprobs[-1]) == 2
    ids = client.completions.create(
        model=model, prompt=[5, 6, 7], max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 3


def test_openai_chat(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    kw = {"model": "default", "messages": msgs, "temperature": 0, "max_completion_tokens": 20}
    out = client.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert out.usage.completion_tokens == len(choice.logprobs.content)
    assert len(choice.logprobs.content[0].top_logprobs) == 2
    pieces, usage = [], None
    for chunk in client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        pieces += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == choice.message.content
    assert usage.completion_tokens == out.usage.completion_tokens
    two = client.chat.completions.create(
        model="default",
        messages=msgs,
        max_tokens=4,
        n=2,
        stop=["\n"],
        seed=7,
        extra_body={"min_p": 0.05, "stop_token_ids": [0]},
    )
    assert len(two.choices) == 2


def test_64_concurrent_streams(server):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, dict]:
        body = {
            "model": "default",
            "prompt": f"Request number {i}:",
            "max_tokens": 12 + i % 5,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        text, usage = "", None
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    text += "".join(c["text"] for c in chunk["choices"])
                    usage = chunk.get("usage") or usage
        return text, usage

    async def run() -> list:
        async with httpx.AsyncClient(
            base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=100)
        ) as client:
            return await asyncio.gather(*[one(client, i) for i in range(64)])

    results = asyncio.run(run())
    for i, (text, usage) in enumerate(results):
        assert usage["completion_tokens"] == 12 + i % 5 and text
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


# --- disconnects ----------------------------------------------------------------------
def test_disconnect_frees_kv(server):
    idle = _wait_idle(server)
    body = {
        "text": "A very long story",
        "stream": True,
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
    }
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert _info(server)["num_running_reqs"] == 1
    after = _wait_idle(server, timeout=5)
    assert after["protected_tokens"] == 0 and after["used_tokens"] <= idle["used_tokens"] + 3000
    # non-streaming: the client gives up after 0.5 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json={**body, "stream": False}, timeout=0.5)
    after = _wait_idle(server, timeout=5)
    assert after["protected_tokens"] == 0
    assert after["free_tokens"] + after["evictable_tokens"] == after["max_total_num_tokens"]


# --- errors ---------------------------------------------------------------------------
def _error(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err["message"]


def test_errors(server, client):
    ctx = _info(server)["context_length"]
    msg = _error(_post(server, "/generate", {"input_ids": [5] * (ctx + 4)}), 400)
    assert f"maximum context length is {ctx} tokens. However, your request has {ctx + 4}" in msg
    assert "top_p" in _error(
        _post(server, "/generate", {"text": "x", "sampling_params": {"top_p": 7}}), 400
    )
    assert "temperature" in _error(
        _post(server, "/v1/completions", {"prompt": "x", "temperature": "hot"}), 400
    )
    bad_json = httpx.post(
        server.url + "/generate", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert "JSON" in _error(bad_json, 400)
    _error(httpx.get(server.url + "/no/such/route"), 404)
    _error(_post(server, "/v1/chat/completions", {"messages": "hi"}), 400)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="default", prompt=[5] * (ctx + 1), max_tokens=2)


def test_bad_request_does_not_disturb_others(server):
    async def run() -> list:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            good = c.post(
                "/generate",
                json={
                    "text": "fine",
                    "sampling_params": {"max_new_tokens": 30, "ignore_eos": True},
                },
            )
            bad = [
                c.post("/generate", json={"text": "bad", "sampling_params": {"n": -1}}),
                c.post("/generate", content=b"[1, 2"),
            ]
            return await asyncio.gather(good, *bad)

    good, *bad = asyncio.run(run())
    assert good.json()["meta_info"]["completion_tokens"] == 30
    assert [r.status_code for r in bad] == [400, 400]


def test_metrics(server):
    _post(server, "/generate", {"text": "metrics please", "sampling_params": GREEDY})
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        'request_success_total{finish_reason="length"}',
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_sum",
        "request_queue_time_seconds_count",
    ):
        assert f"radixlm:{name}" in text, name
    gen = [ln for ln in text.splitlines() if ln.startswith("radixlm:generation_tokens_total")]
    assert float(gen[0].split()[-1]) > 0


# --- constrained decoding through the APIs -------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 99}},
          "required": ["name", "age"]}


def test_constrained_native_and_openai(server, client):
    sp = {"max_new_tokens": 64, "temperature": 0.8, "seed": 3}
    out = _post(server, "/generate", {"text": "Person:", "sampling_params": {
        **sp, "json_schema": json.dumps(PERSON)}}).json()
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        jsonschema.validate(json.loads(out["text"]), PERSON)
    out = _post(server, "/generate", {"text": "Phone:", "sampling_params": {
        **sp, "regex": r"[0-9]{3}-[0-9]{4}"}}).json()
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out["text"])
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "A person"}], max_tokens=64,
        seed=1, response_format={"type": "json_schema",
                                 "json_schema": {"name": "p", "schema": PERSON}})
    if chat.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    comp = client.completions.create(model="default", prompt="Code:", max_tokens=16,
                                     extra_body={"regex": "[A-Z]{3}"})
    assert re.fullmatch("[A-Z]{3}", comp.choices[0].text)
    # SGLang's ebnf, natively and as an OpenAI extra field
    grammar = 'root ::= ("yes" | "no") ", " [0-9]'
    out = _post(server, "/generate", {"text": "Answer:", "sampling_params": {
        **sp, "ebnf": grammar}}).json()
    assert re.fullmatch(r"(yes|no), [0-9]", out["text"]), out
    comp = client.completions.create(model="default", prompt="Answer:", max_tokens=16,
                                     extra_body={"ebnf": grammar})
    assert re.fullmatch(r"(yes|no), [0-9]", comp.choices[0].text)
    obj = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "JSON"}], max_tokens=48,
        seed=2, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def _deep_schema_text(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"integer"}' + "}}" * depth


@pytest.mark.parametrize("sp, needle", [
    ({"regex": "(?=x)y"}, "lookahead"),
    ({"regex": r"(a)\1"}, "backreference"),
    ({"regex": r"\bz"}, "word boundary"),
    ({"regex": "(unclosed"}, "regex"),
    ({"json_schema": "{oops"}, "json"),
    ({"json_schema": _deep_schema_text(10_000)}, "deep"),
    ({"json_schema": json.dumps({"type": "array", "uniqueItems": True})}, "uniqueitems"),
    ({"regex": "a", "json_schema": "{}"}, "regex"),
    ({"ebnf": 'root ::= "unclosed'}, "ebnf"),
])
def test_bad_grammars_are_400(server, sp, needle):
    resp = _post(server, "/generate", {"text": "x", "sampling_params": {
        "max_new_tokens": 4, **sp}})
    assert needle in _error(resp, 400).lower()
    # as a stream: the same 400, before any event (the status waits for the first output)
    resp = _post(server, "/generate", {"text": "x", "stream": True, "sampling_params": {
        "max_new_tokens": 4, **sp}})
    assert needle in _error(resp, 400).lower()
    _wait_idle(server)


def test_deep_body_and_pathological_regex(server):
    body = ('{"text": "x", "sampling_params": {"json_schema": ' + _deep_schema_text(10_000)
            + "}}")
    resp = httpx.post(server.url + "/generate", content=body.encode(), timeout=60,
                      headers={"Content-Type": "application/json"})
    assert "deep" in _error(resp, 400)
    t0 = time.monotonic()
    resp = _post(server, "/generate", {"text": "x", "sampling_params": {
        "max_new_tokens": 8, "regex": "(a+)+b"}})
    assert resp.status_code == 200 and time.monotonic() - t0 < 30
    ok = _post(server, "/generate", {"text": "still fine", "sampling_params": GREEDY})
    assert ok.status_code == 200


def test_cache_salt_and_extra_key_isolate_tenants(server, client):
    prompt = "A long shared instruction for the isolation test. " * 30
    kw = {"model": "default", "prompt": prompt, "max_tokens": 2, "temperature": 0}

    def cached(**extra) -> int:
        out = client.completions.create(**kw, extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="alpha") == 0
    assert cached(cache_salt="beta") == 0
    assert cached(cache_salt="alpha") > 0
    native = {"text": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    first = _post(server, "/generate", {**native, "extra_key": "gamma"}).json()
    again = _post(server, "/generate", {**native, "extra_key": "gamma"}).json()
    assert first["meta_info"]["cached_tokens"] == 0 < again["meta_info"]["cached_tokens"]
    bad = _post(server, "/generate", {**native, "cache_salt": ""})
    assert "cache_salt must be a non-empty string" in _error(bad, 400)


def test_embeddings_on_a_generation_server_are_a_400(server, client):
    with pytest.raises(openai.BadRequestError, match="--is-embedding"):
        client.embeddings.create(model="default", input="hello")
    resp = _post(server, "/encode", {"text": "hello"})
    assert resp.status_code == 400 and "--is-embedding" in resp.json()["error"]["message"]
    assert httpx.get(server.url + "/get_model_info").json()["is_generation"] is True


# --- issue 55: OpenAI's rules for tool choices, n with seed, usage with n, top_logprobs ---
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
HI = [{"role": "user", "content": "Hi!"}]


@pytest.mark.parametrize("extra, param, where", [
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": ["f"]}}},
     "tool_choice", "tool_choice.function.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": {"n": 1}}}},
     "tool_choice", "tool_choice.function.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": "f"}},
     "tool_choice", "tool_choice.function"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice", "function"),
    ({"tools": [TOOL], "tool_choice": 3}, "tool_choice", "tool_choice"),
    ({"functions": [TOOL["function"]], "function_call": {"name": ["f"]}},
     "function_call", "function_call.name"),
    ({"functions": [TOOL["function"]], "function_call": [{"name": "f"}]},
     "function_call", "function_call"),
])
def test_malformed_tool_choice_is_a_400_naming_it(server, extra, param, where):
    resp = _post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, **extra})
    assert where in _error(resp, 400)
    assert resp.json()["error"]["param"] == param


def test_responses_tool_choice_shapes_are_400s(server):
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    for choice in ({"type": "function", "name": ["f"]}, {"type": "function", "name": {}},
                   {"type": "function", "function": {"name": ["f"]}}):
        resp = _post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2,
                                               "tools": [tool], "tool_choice": choice})
        _error(resp, 400)
        assert resp.json()["error"]["param"] == "tool_choice"


def test_n_with_seed_gives_distinct_choices_and_choice_0_is_the_seed(server, client, engine):
    """vLLM's rule: choice i is sampled with seed + i, so n seeded choices differ and a
    seeded n=1 request is reproducible and equals choice 0 (and n=1 with seed + i choice
    i)."""
    kw = {"model": "default", "max_tokens": 8, "temperature": 1.0,
          "extra_body": {"ignore_eos": True}}
    chat = client.chat.completions.create(messages=HI, n=3, seed=11, **kw)
    texts = [c.message.content for c in chat.choices]
    assert len(set(texts)) == 3, texts
    for i in (0, 1):
        one = client.chat.completions.create(messages=HI, seed=11 + i, **kw)
        assert one.choices[0].message.content == texts[i]
    cmpl = client.completions.create(prompt="Once upon a time", n=3, seed=5, **kw)
    texts = [c.text for c in cmpl.choices]
    assert len(set(texts)) == 3, texts
    one = client.completions.create(prompt="Once upon a time", seed=5, **kw)
    assert one.choices[0].text == texts[0]
    last = client.completions.create(prompt="Once upon a time", seed=2**63 - 1, n=2, **kw)
    assert len({c.text for c in last.choices}) == 2  # seed + 1 wraps, as int64
    sp = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "seed": 5}
    offline = engine.generate("Once upon a time", {**sp, "n": 3})
    assert len({o["text"] for o in offline}) == 3
    assert engine.generate("Once upon a time", sp)["text"] == offline[0]["text"]


def test_usage_counts_the_prompt_once_with_n(client):
    """With n choices the prompt is counted once (OpenAI, vLLM), its cached tokens too:
    what the prompt found cached, never more than its tokens."""
    kw = {"model": "default", "max_tokens": 2, "n": 3, "temperature": 1.0}
    fresh = [{"role": "user", "content": "A prompt for the usage test, unseen before."}]
    first = client.chat.completions.create(messages=fresh, **kw).usage
    again = client.chat.completions.create(messages=fresh, **kw).usage
    assert first.prompt_tokens == again.prompt_tokens
    # the first found only the template's opening cached; its samples ran after it
    assert (first.prompt_tokens_details.cached_tokens < again.prompt_tokens_details.cached_tokens
            < again.prompt_tokens)
    one = client.chat.completions.create(messages=fresh, **{**kw, "n": 1}).usage
    assert one.prompt_tokens_details.cached_tokens == again.prompt_tokens_details.cached_tokens
    cmpl = client.completions.create(prompt=["usage one", "usage two, longer"], **kw).usage
    assert cmpl.prompt_tokens_details.cached_tokens <= cmpl.prompt_tokens
    streamed = None
    for chunk in client.completions.create(prompt="usage one", stream=True,
                                           stream_options={"include_usage": True}, **kw):
        streamed = chunk.usage or streamed
    assert 0 < streamed.prompt_tokens_details.cached_tokens < streamed.prompt_tokens


def test_logprob_fields_are_checked_as_openai_does(server):
    """top_logprobs wants logprobs: true (OpenAI and vLLM: a 400, not ignored); the
    completions route's int logprobs and token-id prompts are named as the client sent
    them, not by the native API's names."""
    resp = _post(server, "/v1/chat/completions",
                 {"messages": HI, "max_tokens": 2, "top_logprobs": 2})
    assert "logprobs" in _error(resp, 400) and resp.json()["error"]["param"] == "top_logprobs"
    ok = _post(server, "/v1/chat/completions",
               {"messages": HI, "max_tokens": 2, "top_logprobs": 0}).json()
    assert ok["choices"][0]["logprobs"] is None  # 0 asks for nothing (vLLM)
    resp = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 10**6})
    assert _error(resp, 400).startswith("logprobs is 1000000")
    assert resp.json()["error"]["param"] == "logprobs"
    resp = _post(server, "/v1/completions", {"prompt": [5, 10**6], "max_tokens": 2})
    assert "vocabulary" in _error(resp, 400) and resp.json()["error"]["param"] == "prompt"
    resp = _post(server, "/v1/chat/completions",
                 {"messages": HI, "max_completion_tokens": 10**6})
    assert resp.json()["error"]["param"] == "max_completion_tokens", resp.text
    lp = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 0})
    assert len(lp.json()["choices"][0]["logprobs"]["token_logprobs"]) == 2
