"""Tools in programs through ``radixlm serve`` (tiny Qwen2, a tools-aware template,
``--tool-call-parser qwen25``): the native HTTP backend (``RuntimeEndpoint``: the template
from /get_model_info, the parser from /get_server_info) and the OpenAI backend (tools and
tool_choice passed to /v1/chat/completions through the official client). Forced calls
validate against their schemas; the round trip's next prompt is transformers'
``apply_chat_template`` of the same messages (the OpenAI backend: its prompt_tokens)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

import radixlm as sgl
from tests.frontend_dsl.tool_programs import (
    QUESTION,
    TOOLS,
    check_calls,
    equivalent_messages,
    round_trip,
)
from tests.runtime.entrypoints.function_call.tools_model import tools_model_dir


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_dir, tmp_path_factory):
    return tools_model_dir(tiny_qwen2_dir, tmp_path_factory.mktemp("dsl_tools_srv") / "m")


@pytest.fixture(scope="module")
def server(module_server, model_dir):
    return module_server(["--model-path", str(model_dir), "--max-total-tokens", "4096",
                          "--tool-call-parser", "qwen25", "--log-level", "warning",
                          "--random-seed", "0"], "dsl_tools")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def _template(tokenizer, msgs, **kw) -> str:
    schemas = [sgl.function_tool(f) for f in TOOLS]
    return tokenizer.apply_chat_template(msgs, tools=schemas, tokenize=False, **kw)


class SpyEndpoint(sgl.RuntimeEndpoint):
    def __init__(self, url: str, **kw):
        super().__init__(url, **kw)
        self.prompts: list[str] = []

    def generate(self, prompt, sampling_params, logprob_args):
        self.prompts.append(prompt.text)
        return super().generate(prompt, sampling_params, logprob_args)


def test_native_http_round_trip(server, tokenizer):
    backend = SpyEndpoint(server.url)
    try:
        state = round_trip.run(question=QUESTION, choice="get_weather", backend=backend)
        check_calls(state.tool_calls("call"), {"get_weather"})
        msgs = equivalent_messages(state)
        assert backend.prompts[0] == _template(tokenizer, msgs[:1], add_generation_prompt=True)
        assert backend.prompts[1] == _template(tokenizer, msgs, add_generation_prompt=True)
        assert backend.tool_call_parser() == "qwen25"  # the server's flag
    finally:
        backend.shutdown()


def test_native_http_auto_uses_the_servers_parser(server):
    """Random weights rarely call on their own: auto must run (the parser comes from the
    server) and every call it makes must validate."""
    backend = sgl.RuntimeEndpoint(server.url)

    @sgl.function
    def auto(s):
        s += sgl.user(QUESTION)
        s += sgl.assistant(sgl.gen("c", tools=TOOLS, max_tokens=12, temperature=0))

    try:
        state = auto.run(backend=backend)
        calls = state.tool_calls("c")
        if calls:
            check_calls(calls, {"get_weather", "get_time"})
        assert isinstance(state["c"], str)
    finally:
        backend.shutdown()


def test_openai_backend_round_trip(server, tokenizer):
    backend = sgl.OpenAI("default", base_url=server.url + "/v1")
    try:
        state = round_trip.run(question=QUESTION, choice="required", backend=backend)
        check_calls(state.tool_calls("call"), {"get_weather", "get_time"})
        assert state.get_meta_info("call")["finish_reason"] == "tool_calls"
        msgs = equivalent_messages(state)
        prompt = _template(tokenizer, msgs, add_generation_prompt=True)
        n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        assert state.get_meta_info("answer")["prompt_tokens"] == n  # the tool output was in
        assert state.messages()[2]["role"] == "tool"
    finally:
        backend.shutdown()


def test_openai_completion_model_refuses_tools(server):
    backend = sgl.OpenAI("default", base_url=server.url + "/v1", is_chat_model=False)

    @sgl.function
    def tools(s):
        s += sgl.user("hi")
        s += sgl.assistant(sgl.gen("c", tools=TOOLS, tool_choice="required"))

    try:
        with pytest.raises(ValueError, match="needs a chat model"):
            tools.run(backend=backend).sync()
    finally:
        backend.shutdown()
