"""Native API parity with SGLang 0.5, checked against SGLang's own source (the wheel).

Every field of SGLang's ``GenerateReqInput`` and ``SamplingParams`` is read with ``ast``
(nothing of SGLang is imported) and must be either accepted by radixlm or refused with a
400 that names it, so a field SGLang adds later fails here until it is decided.
``token_ids_logprob`` is checked against transformers' log_softmax on the tiny model,
``custom_labels`` on ``/metrics``, and stop trimming against SGLang's own
``trim_matched_stop`` (its source, compiled from the wheel).
"""

from __future__ import annotations
import __future__

import ast
import inspect
import re
import textwrap
import time
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from radixlm.runtime.entrypoints.engine.engine import Engine
from radixlm.runtime.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingParamsIn,
)
from radixlm.runtime.entrypoints.refused_fields import (
    REFUSED_REQUEST_FIELDS,
    REFUSED_SAMPLING_FIELDS,
)
from radixlm.runtime.entrypoints.server_process import ServerProcess
from radixlm.runtime.managers.detokenizer import IncrementalDetokenizer
from radixlm.runtime.metrics import MAX_CUSTOM_LABEL_SETS, OTHER_LABEL, ServerMetrics
from tests.compat.sglang_wheel import sglang_dir

FLAGS = ["--max-total-tokens", "8192", "--random-seed", "0", "--log-level", "warning",
         "--tokenizer-metrics-allowed-custom-labels", "team", "app"]
PROMPT = "The capital of France is"
GREEDY = {"max_new_tokens": 6, "temperature": 0}
ASKED = [5, 17, 100, 1999]  # token ids whose logprobs are asked for


# --- SGLang's fields, read from its source ----------------------------------------------------
def _class(path: str, name: str) -> ast.ClassDef:
    tree = ast.parse((sglang_dir() / path).read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _fields(cls: ast.ClassDef) -> list[str]:
    """A dataclass's / msgspec Struct's annotated fields, or ``__init__``'s parameters."""
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef)
                 and n.name == "__init__"), None)
    if init is not None:
        args = init.args
        return [a.arg for a in args.args[1:] + args.kwonlyargs]
    return [n.target.id for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def sglang_request_fields() -> list[str]:
    return _fields(_class("srt/managers/io_struct.py", "GenerateReqInput"))


def sglang_sampling_fields() -> list[str]:
    return _fields(_class("srt/sampling/sampling_params.py", "SamplingParams"))


def test_sglang_source_is_read():
    """The parse finds the fields everyone knows, so the sweeps below are not empty."""
    assert {"text", "input_ids", "sampling_params", "token_ids_logprob",
            "custom_labels", "lora_path"} <= set(sglang_request_fields())
    assert {"max_new_tokens", "stop_regex", "no_stop_trim",
            "sampling_seed"} <= set(sglang_sampling_fields())


@pytest.mark.parametrize("fields,model,refused", [
    (sglang_request_fields, GenerateRequest, REFUSED_REQUEST_FIELDS),
    (sglang_sampling_fields, SamplingParamsIn, REFUSED_SAMPLING_FIELDS),
], ids=["GenerateReqInput", "SamplingParams"])
def test_every_sglang_field_is_decided(fields, model, refused):
    undecided = [f for f in fields() if f not in model.model_fields and f not in refused]
    assert undecided == [], f"SGLang fields radixlm neither accepts nor refuses: {undecided}"
    both = [f for f in model.model_fields if f in refused]
    assert both == [], f"fields both accepted and refused: {both}"


def test_openai_requests_take_sglangs_routing_fields():
    """SGLang's OpenAI requests carry the PD and DP routing fields a router injects."""
    routing = _fields(_class("srt/entrypoints/openai/protocol.py", "PDRoutingFields"))
    assert {"bootstrap_room", "routed_dp_rank"} <= set(routing)
    for model in (CompletionRequest, ChatCompletionRequest):
        assert [f for f in routing if f not in model.model_fields] == [], model.__name__


# the PD fields: SGLang's Engine takes them; radixlm's offline Engine has no PD mode and
# refuses any value but null (refused_fields.refuse_options)
ENGINE_PD_ARGS = {"bootstrap_host", "bootstrap_port", "bootstrap_room", "disagg_prefill_dp_rank"}


@pytest.mark.parametrize("name", ["generate", "async_generate"])
def test_every_sglang_engine_argument_is_decided(name):
    cls = _class("srt/entrypoints/engine.py", "Engine")
    fn = next(n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
              and n.name == name)
    theirs = [a.arg for a in fn.args.args[1:] + fn.args.kwonlyargs]
    ours = inspect.signature(Engine.generate).parameters  # async_generate takes the same
    undecided = [a for a in theirs
                 if a not in ours and a not in REFUSED_REQUEST_FIELDS and a not in ENGINE_PD_ARGS]
    assert "routed_dp_rank" in theirs and undecided == [], undecided


# --- the server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(FLAGS, tmp_path_factory.mktemp("parity") / "server.log")
    srv.wait_healthy()
    yield srv
    assert srv.stop() == 0, srv.log()


def _post(server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=body, timeout=120)


def _other_value(neutral: tuple[Any, ...]) -> Any:
    """A value that asks for the feature (not one of the field's neutral values)."""
    return True if False in neutral else 7 if 0 in neutral else "on"


def test_refused_request_fields_are_400_naming_them(server):
    for name in sglang_request_fields():
        if name not in REFUSED_REQUEST_FIELDS:
            continue
        neutral, why = REFUSED_REQUEST_FIELDS[name]
        r = _post(server, {"text": "hi", "sampling_params": GREEDY,
                           name: _other_value(neutral)})
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert err["param"] == name and name in err["message"] and why in err["message"]


def test_refused_sampling_fields_are_400_naming_them(server):
    for name in sglang_sampling_fields():
        if name not in REFUSED_SAMPLING_FIELDS:
            continue
        neutral, why = REFUSED_SAMPLING_FIELDS[name]
        sp = {**GREEDY, name: _other_value(neutral)}
        r = _post(server, {"text": "hi", "sampling_params": sp})
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert err["param"] == f"sampling_params.{name}" and why in err["message"]
        # in a batch, the path says which item
        r = _post(server, {"text": ["a", "b"], "sampling_params": [GREEDY, sp]})
        assert r.status_code == 400 and f"sampling_params.1.{name}" in r.json()["error"]["message"]


def test_neutral_values_of_refused_fields_are_accepted(server):
    """What SGLang's clients send when they do not use a feature (its defaults, nulls)."""
    top = {name: neutral[-1] for name, (neutral, _) in REFUSED_REQUEST_FIELDS.items()}
    sp = {name: neutral[-1] for name, (neutral, _) in REFUSED_SAMPLING_FIELDS.items()}
    plain = _post(server, {"text": PROMPT, "sampling_params": GREEDY}).json()
    r = _post(server, {"text": PROMPT, "sampling_params": {**GREEDY, **sp}, **top})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == plain["output_ids"]


def test_unknown_fields_stay_400(server):
    for body in ({"text": "hi", "no_such_field": 1},
                 {"text": "hi", "sampling_params": {"no_such_param": 1}}):
        r = _post(server, body)
        assert r.status_code == 400 and "no_such" in r.json()["error"]["message"]


def test_what_sglang_frontend_sends_is_accepted(server):
    """The body of SGLang's ``RuntimeEndpoint.generate`` (``lang/backend``) and of its
    ``Runtime.generate``, with the defaults its ``SglSamplingParams`` fills in."""
    sp = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
          "max_new_tokens": 6, "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [],
          "stop_regex": None, "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
          "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False,
          "regex": None, "json_schema": None}
    r = _post(server, {"text": PROMPT, "sampling_params": sp, "return_logprob": True,
                       "logprob_start_len": 0, "top_logprobs_num": 2,
                       "return_text_in_logprobs": True})
    assert r.status_code == 200, r.text
    r = _post(server, {"text": PROMPT, "sampling_params": GREEDY, "return_logprob": False,
                       "logprob_start_len": None, "top_logprobs_num": None,
                       "lora_path": None, "session_id": None})
    assert r.status_code == 200, r.text


def test_return_prompt_token_ids(server):
    ids = httpx.post(server.url + "/tokenize", json={"text": PROMPT}).json()["tokens"]
    out = _post(server, {"text": PROMPT, "sampling_params": GREEDY,
                         "return_prompt_token_ids": True}).json()
    assert out["prompt_token_ids"] == ids


# --- token_ids_logprob ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(make_module_engine):
    return make_module_engine(max_total_tokens=4096, random_seed=0)


def _hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_token_ids_logprob_equals_transformers(engine):
    out = engine.generate(PROMPT, GREEDY, return_logprob=True, logprob_start_len=0,
                          token_ids_logprob=ASKED)
    meta = out["meta_info"]
    prompt = [t for _, t, _ in meta["input_token_logprobs"]]
    seq = prompt + out["output_ids"]
    ref = _hf_logprobs(engine.model_path, seq)
    inputs, outputs = meta["input_token_ids_logprobs"], meta["output_token_ids_logprobs"]
    assert len(inputs) == len(prompt) and inputs[0] is None
    assert len(outputs) == len(out["output_ids"]) == GREEDY["max_new_tokens"]
    for pos, entries in list(enumerate(inputs))[1:]:  # the logits before each prompt token
        assert [t for _, t, _ in entries] == ASKED
        torch.testing.assert_close(torch.tensor([lp for lp, _, _ in entries]),
                                   ref[pos - 1, ASKED], atol=1e-4, rtol=1e-4)
    for k, entries in enumerate(outputs):  # the logits each output token was sampled from
        assert [t for _, t, _ in entries] == ASKED
        torch.testing.assert_close(torch.tensor([lp for lp, _, _ in entries]),
                                   ref[len(prompt) - 1 + k, ASKED], atol=1e-4, rtol=1e-4)


def test_token_ids_logprob_agrees_with_top_logprobs(engine):
    """At temperature 0 the sampled token is the top one: asking for it by id gives the
    same logprob as the top-1 entry and as output_token_logprobs."""
    first = engine.generate(PROMPT, GREEDY)["output_ids"]
    out = engine.generate(PROMPT, GREEDY, return_logprob=True, top_logprobs_num=1,
                          token_ids_logprob=[first[0]])["meta_info"]
    asked = out["output_token_ids_logprobs"][0][0]
    top = out["output_top_logprobs"][0][0]
    chosen = out["output_token_logprobs"][0]
    assert asked[1] == top[1] == chosen[1] == first[0]
    assert asked[0] == pytest.approx(top[0], abs=1e-6) == pytest.approx(chosen[0], abs=1e-6)


def test_token_ids_logprob_needs_return_logprob_and_checks_ids(engine):
    meta = engine.generate(PROMPT, GREEDY, token_ids_logprob=ASKED)["meta_info"]
    assert "output_token_ids_logprobs" not in meta  # SGLang: only with return_logprob
    with pytest.raises(ValueError, match="token_ids_logprob"):
        engine.generate(PROMPT, GREEDY, return_logprob=True, token_ids_logprob=[10**6])


def test_token_ids_logprob_over_http(server, engine):
    """Batch form (one list per item), text in the entries, and the same numbers as the
    Engine; a single prompt with a list of lists is a 400."""
    body = {"text": [PROMPT, "Once upon a time"], "sampling_params": GREEDY,
            "return_logprob": True, "return_text_in_logprobs": True,
            "token_ids_logprob": [ASKED, [7]]}
    r = _post(server, body)
    assert r.status_code == 200, r.text
    a, b = r.json()
    local = engine.generate(PROMPT, GREEDY, return_logprob=True, token_ids_logprob=ASKED)
    got = a["meta_info"]["output_token_ids_logprobs"]
    want = local["meta_info"]["output_token_ids_logprobs"]
    assert [[e[1] for e in row] for row in got] == [ASKED] * len(got)
    assert all(isinstance(e[2], str) for row in got for e in row)
    torch.testing.assert_close(torch.tensor([[e[0] for e in row] for row in got]),
                               torch.tensor([[e[0] for e in row] for row in want]),
                               atol=1e-4, rtol=1e-4)
    assert [[e[1] for e in row] for row in b["meta_info"]["output_token_ids_logprobs"]] == \
        [[7]] * GREEDY["max_new_tokens"]
    bad = _post(server, {"text": PROMPT, "return_logprob": True,
                         "token_ids_logprob": [[1], [2]]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "token_ids_logprob"
    bad = _post(server, {"text": PROMPT, "return_logprob": True,
                         "token_ids_logprob": list(range(65))})
    assert bad.status_code == 400 and "--max-top-logprobs-num" in bad.json()["error"]["message"]


# --- custom_labels ---------------------------------------------------------------------------
def _samples(server, metric: str) -> dict[tuple, float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == metric:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_custom_labels_on_metrics(server):
    body = {"text": PROMPT, "sampling_params": GREEDY,
            "custom_labels": {"team": "blue", "app": "chat"}}
    assert _post(server, body).status_code == 200
    assert _post(server, {**body, "custom_labels": {"team": "red"}}).status_code == 200
    success = _samples(server, "radixlm:request_success_total")
    blue = (("app", "chat"), ("finish_reason", "length"), ("team", "blue"))
    red = (("app", ""), ("finish_reason", "length"), ("team", "red"))
    assert success[blue] >= 1 and success[red] >= 1
    e2e = _samples(server, "radixlm:e2e_request_latency_seconds_count")
    assert e2e[(("app", "chat"), ("team", "blue"))] >= 1
    ttft = _samples(server, "radixlm:time_to_first_token_seconds_count")
    assert ttft[(("app", ""), ("team", "red"))] >= 1


def test_custom_labels_header_on_openai_routes(server):
    """SGLang's OpenAI routes read the labels from a header; names the server does not
    allow are dropped, as SGLang drops them."""
    headers = {"x-custom-labels": '{"team": "oai", "tenant": "dropped"}'}
    r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=120,
                   json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    key = (("app", ""), ("finish_reason", "length"), ("team", "oai"))
    assert _samples(server, "radixlm:request_success_total")[key] >= 1


def test_log_metrics_false_is_not_counted(server):
    labels = {"team": "quiet"}
    body = {"text": PROMPT, "sampling_params": GREEDY, "custom_labels": labels}
    assert _post(server, {**body, "log_metrics": False}).status_code == 200
    key = (("app", ""), ("finish_reason", "length"), ("team", "quiet"))
    assert key not in _samples(server, "radixlm:request_success_total")
    assert _post(server, body).status_code == 200
    deadline = time.monotonic() + 10  # the metric is recorded as the last output arrives
    while key not in _samples(server, "radixlm:request_success_total"):
        assert time.monotonic() < deadline


def test_bad_custom_labels_are_400(server):
    r = _post(server, {"text": "hi", "custom_labels": {"tenant": "x"}})
    assert r.status_code == 400 and "'tenant'" in r.json()["error"]["message"]
    assert "--tokenizer-metrics-allowed-custom-labels" in r.json()["error"]["message"]
    r = _post(server, {"text": "hi", "custom_labels": {"team": "x" * 200}})
    assert r.status_code == 400 and "custom_labels.team" in r.json()["error"]["message"]
    r = _post(server, {"text": "hi", "custom_labels": {"team": 3}})
    assert r.status_code == 400 and "custom_labels.team" in r.json()["error"]["message"]


def test_custom_label_values_are_bounded():
    m = ServerMetrics(("team",))
    for i in range(MAX_CUSTOM_LABEL_SETS + 50):
        labels = m.label_values({"team": f"t{i}"})
        m.on_finish({"type": "length"}, 0.1, labels)
    assert m.label_values({"team": "t3"}) == ("t3",)  # a known set keeps its values
    values = {s.labels["team"] for fam in m.registry.collect() for s in fam.samples
              if s.name == "radixlm:request_success_total"}
    assert len(values) == MAX_CUSTOM_LABEL_SETS + 1 and OTHER_LABEL in values
    with pytest.raises(ValueError, match="'other'"):
        m.check_labels({"other": "x"})
    assert ServerMetrics().label_values(None) == ()


# --- stop trimming as SGLang's detokenizer does it ---------------------------------------------
def _sglang_trim():
    """SGLang's ``DetokenizerManager.trim_matched_stop``, compiled from the wheel's source."""
    cls = _class("srt/managers/detokenizer_manager.py", "DetokenizerManager")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef)
              and n.name == "trim_matched_stop")
    namespace: dict[str, Any] = {}
    code = ast.Module(body=[fn], type_ignores=[])
    exec(compile(code, "trim_matched_stop", "exec",  # annotations stay unevaluated
                 flags=__future__.annotations.compiler_flag), namespace)

    class Self:
        is_tool_call_parser_gpt_oss = False
        tool_close_token_ids: tuple = ()

    return lambda output, reason, no_stop_trim: namespace["trim_matched_stop"](
        Self(), output, reason, no_stop_trim)


def _sglang_text(tokenizer, ids: list[int], reason: dict, no_stop_trim: bool) -> str:
    trim = _sglang_trim()
    text = tokenizer.decode(trim(list(ids), reason, no_stop_trim), skip_special_tokens=True)
    return trim(text, reason, no_stop_trim)


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_stop_trimming_matches_sglang(engine, no_stop_trim):
    tok = engine.tokenizer
    base = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 16})
    text, ids = base["text"], base["output_ids"]
    assert len(text) > 6, textwrap.shorten(text, 40)
    word = text.split()[1][:2]
    cases = [
        {"stop": [text[3:5]]},  # a stop string inside a token's text
        {"stop_token_ids": [ids[4]]},  # an ordinary token as a stop token
        {"stop_regex": ["[ ]" + re.escape(word)]},  # a pattern, not the text it matched
        {"stop_regex": [word]},  # a pattern found literally: SGLang trims it as a string
    ]
    for extra in cases:
        sp = {**GREEDY, "max_new_tokens": 16, "no_stop_trim": no_stop_trim, **extra}
        out = engine.generate(PROMPT, sp)
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "stop", (extra, reason)
        assert out["text"] == _sglang_text(tok, out["output_ids"], reason, no_stop_trim), extra


@pytest.mark.parametrize("matched", ["lo w", "o", "[a-z]+", 7])
@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_final_text_matches_sglang_trim(engine, matched, no_stop_trim):
    """The detokenizer's last text for every kind of match, on fixed ids."""
    tok = engine.tokenizer
    ids = tok.encode("hello world, and more", add_special_tokens=False) + [7]
    detok = IncrementalDetokenizer(tok, stop=["lo w", "o"], no_stop_trim=no_stop_trim)
    detok.add(ids)
    reason = {"type": "stop", "matched": matched}
    assert detok.final_text(matched) == _sglang_text(tok, ids, reason, no_stop_trim)
