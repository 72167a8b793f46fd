"""stop_regex: an automaton search (no backtracking), through the Engine: the request stops
at the first step whose output tail contains a match, bad patterns are ValueErrors."""

from __future__ import annotations

import re

import pytest

from radixlm.runtime.executor.stop_regex import contains_match


@pytest.mark.parametrize("pattern,text,found", [
    (r"\n\n", "one\n\ntwo", True),
    (r"[0-9]{3}", "ab12c", False),
    (r"[0-9]{3}", "ab123", True),
    (r"The (end|fin)\.", "... The fin.", True),
    (r"(a+)+b", "a" * 5000, False),  # catastrophic for a backtracking engine
    (r"(a+)+b", "a" * 5000 + "b", True),
])
def test_contains_match_agrees_with_re(pattern, text, found):
    assert contains_match(pattern, text) is found
    if len(text) < 100:  # Python's re backtracks: on the long ones it would never return
        assert (re.search(pattern, text) is not None) is found


@pytest.fixture(scope="module")
def eng(make_module_engine):
    return make_module_engine(model_path=None, max_total_tokens=8192)


def test_engine_stops_at_a_regex_match(eng):
    sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    free = eng.generate("Once upon a time", sp)
    text = free["text"]
    # a pattern that matches the free run's text somewhere after its first characters
    target = text[8:11]
    pattern = re.escape(target[0]) + "." + re.escape(target[2])
    out = eng.generate("Once upon a time", {**sp, "stop_regex": [pattern, "zzzq+"]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert out["output_ids"] == free["output_ids"][: len(out["output_ids"])]
    assert len(out["output_ids"]) < len(free["output_ids"])
    assert re.search(pattern, out["text"])  # kept: a regex match is not trimmed


@pytest.mark.parametrize("pattern,match", [(r"(a)\1", "stop_regex"), ("", "non-empty"),
                                           (r"\bx", "stop_regex")])
def test_bad_stop_regex_is_a_value_error(eng, pattern, match):
    with pytest.raises(ValueError, match=match):
        eng.generate("x", {"max_new_tokens": 4, "stop_regex": pattern})


def test_server_builds_stop_automata_off_the_event_loop(monkeypatch):
    """The tokenizer manager builds a request's automata on a worker thread (bounded, but
    pure Python): the event loop's thread never runs interegular's construction."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from radixlm.runtime.executor import stop_regex
    from radixlm.runtime.executor.sampling_params import SamplingParams
    from radixlm.runtime.managers.api_error import ApiError
    from radixlm.runtime.managers.tokenizer_manager.tokenizer_manager import TokenizerManager

    builders: list[threading.Thread] = []
    real = stop_regex.stop_automaton.__wrapped__

    def recording(pattern: str):
        builders.append(threading.current_thread())
        return real(pattern)

    monkeypatch.setattr("radixlm.runtime.executor.sampling_params.stop_automaton", recording)

    async def run(pattern: str) -> None:
        params = SamplingParams.from_dict({"stop_regex": pattern})
        params.verify(100, 1024, build_stop_automata=False)
        await TokenizerManager._build_stop_automata([SimpleNamespace(params=params)])

    asyncio.run(run("ab+c"))
    assert builders and threading.main_thread() not in builders
    with pytest.raises(ApiError) as e:
        asyncio.run(run("(a|b)*a(a|b){20}"))
    assert e.value.status == 400 and "states" in str(e.value.body())
