"""The OpenAI backend: any OpenAI-compatible server through the official ``openai`` client.

Chat models (``is_chat_model=True``, the default) get the program's messages through
``/v1/chat/completions``; a ``gen`` must then be the first thing inside an
``assistant(...)`` role, since the API cannot continue a half-written assistant turn.
Completion models get the program text through ``/v1/completions``.

What the OpenAI API cannot do, this backend refuses with a message that says so:
``select`` needs prompt logprobs, which only the completions API returns (``echo`` with
``logprobs``), so it works for completion models only; ``regex`` and sampling options
outside the OpenAI schema (``top_k``, ``min_p``, ``ignore_eos``, ...) are sent in
``extra_body``, which radixlm and SGLang accept and other servers may ignore.
"""

from __future__ import annotations

import json
from typing import Any

import openai as openai_client

from radixlm.frontend_dsl.backends.base import Backend, BackendError, Prompt
from radixlm.frontend_dsl.chat_template import ChatTemplate, get_chat_template
from radixlm.frontend_dsl.choices import ChoicesDecision, ChoicesSamplingMethod, Entries
from radixlm.frontend_dsl.tools import ToolCall

_OPENAI_FIELDS = {
    "max_new_tokens": "max_tokens",
    "stop": "stop",
    "temperature": "temperature",
    "top_p": "top_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "n": "n",
}


class OpenAI(Backend):
    """``OpenAI(model_name, base_url=..., api_key=...)``."""

    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        is_chat_model: bool = True,
        chat_template: str = "chatml",
        timeout: float | None = 600.0,
        **client_args: Any,
    ) -> None:
        self.model_name = model_name
        self.is_chat_model = is_chat_model
        self.client = openai_client.OpenAI(
            base_url=base_url,
            api_key=api_key or "EMPTY",
            timeout=timeout,
            max_retries=0,
            **client_args,
        )
        # role markers only shape the program's own text; the server applies its template
        self.chat_template = get_chat_template(chat_template)

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def _request_args(
        self, prompt: Prompt, sampling_params: dict[str, Any], stream: bool
    ) -> dict[str, Any]:
        args: dict[str, Any] = {"model": self.model_name, "stream": stream}
        extra: dict[str, Any] = {}
        for key, value in sampling_params.items():
            if key in _OPENAI_FIELDS:
                args[_OPENAI_FIELDS[key]] = value
            elif key == "json_schema" and self.is_chat_model:
                schema = json.loads(value) if isinstance(value, str) else value
                args["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "output", "schema": schema},
                }
            else:
                extra[key] = value
        if extra:
            args["extra_body"] = extra
        if stream:
            args["stream_options"] = {"include_usage": True}
        if prompt.timeout is not None:
            args["timeout"] = prompt.timeout
        if self.is_chat_model:
            self._check_chat_prompt(prompt)
            args["messages"] = prompt.messages
        else:
            args["prompt"] = prompt.text
        return args

    def _check_chat_prompt(self, prompt: Prompt) -> None:
        if prompt.open_role != "assistant" or prompt.open_role_text:
            raise ValueError(
                "with an OpenAI chat model, gen() must come first inside "
                "assistant(...): the chat API cannot continue other text. "
                "Use is_chat_model=False for a completion model."
            )

    def _create(self, args: dict[str, Any]) -> Any:
        api = self.client.chat.completions if self.is_chat_model else self.client.completions
        try:
            return api.create(**args)
        except openai_client.APITimeoutError as e:
            raise TimeoutError(f"the OpenAI request timed out: {e}") from e
        except openai_client.OpenAIError as e:
            raise BackendError(f"the OpenAI request failed: {e}") from e

    def generate(self, prompt, sampling_params, logprob_args):
        resp = self._create(self._request_args(prompt, sampling_params, stream=False))
        choice = resp.choices[0]
        text = choice.message.content if self.is_chat_model else choice.text
        return text or "", _meta(resp, choice.finish_reason)

    def generate_stream(self, prompt, sampling_params, logprob_args):
        stream = self._create(self._request_args(prompt, sampling_params, stream=True))
        finish = None
        try:
            for chunk in stream:
                piece = ""
                if chunk.choices:
                    c = chunk.choices[0]
                    finish = c.finish_reason or finish
                    piece = (c.delta.content if self.is_chat_model else c.text) or ""
                yield piece, _meta(chunk, finish)
        except openai_client.OpenAIError as e:
            raise BackendError(f"the OpenAI stream failed: {e}") from e

    def render_chat(self, messages, tools, add_generation_prompt):
        return None  # the server's template renders the messages this backend sends

    def generate_tools(self, prompt, sampling_params, logprob_args, tools):
        """Tools and tool_choice go to ``/v1/chat/completions`` as they are; the calls
        come back in ``message.tool_calls``."""
        if not self.is_chat_model:
            raise ValueError("gen(tools=...) needs a chat model: the completions API has "
                             "no tools (OpenAI(..., is_chat_model=True))")
        args = self._request_args(prompt, sampling_params, stream=False)
        if tools is not None:
            args.update(tools.openai_args())
        resp = self._create(args)
        choice = resp.choices[0]
        calls = [ToolCall(c.id, c.function.name, c.function.arguments)
                 for c in choice.message.tool_calls or []]
        return choice.message.content or "", calls, _meta(resp, choice.finish_reason)

    def cache_prefix(self, prompt: Prompt) -> None:
        """Only completion models can send a bare prefix (``max_tokens: 0``)."""
        if not self.is_chat_model and prompt.text:
            self._create({"model": self.model_name, "prompt": prompt.text, "max_tokens": 0})

    def select(
        self,
        prompt: Prompt,
        choices: list[str],
        temperature: float,
        choices_method: ChoicesSamplingMethod,
    ) -> ChoicesDecision:
        if self.is_chat_model:
            raise NotImplementedError(
                "select() needs the logprobs of prompt tokens, which the OpenAI chat API does "
                "not return; use a completion model (OpenAI(..., is_chat_model=False)) or "
                "gen(..., regex='(a|b)') on a server that supports regex"
            )
        if choices_method.requires_unconditional_logprobs:
            raise NotImplementedError(
                "unconditional_likelihood_normalized needs logprobs "
                "of token ids, which the OpenAI API cannot score"
            )
        entries = self._score(prompt, choices)
        normalized = [sum(e[0] for e in ents) / len(ents) for ents in entries]
        return choices_method(
            choices=choices,
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=entries,
            output_token_logprobs=[[] for _ in choices],
        )

    def _score(self, prompt: Prompt, choices: list[str]) -> list[Entries]:
        """Prompt logprobs of prefix + choice (``echo=True, logprobs=0, max_tokens=0``);
        the choice's tokens are those that end after the prefix."""
        n = len(prompt.text)
        resp = self._create(
            {
                "model": self.model_name,
                "prompt": [prompt.text + c for c in choices],
                "max_tokens": 0,
                "echo": True,
                "logprobs": 0,
                "temperature": 0,
            }
        )
        by_index = sorted(resp.choices, key=lambda c: c.index)
        out = []
        for choice, c in zip(choices, by_index):
            lp = c.logprobs
            if lp is None or not lp.token_logprobs or lp.text_offset is None:
                raise NotImplementedError(
                    "select() needs echo=True with logprobs from /v1/completions, which this "
                    "server does not return"
                )
            ents = [
                [v, None, t]
                for t, v, off in zip(lp.tokens, lp.token_logprobs, lp.text_offset)
                if off + len(t) > n and v is not None
            ]
            if not ents:
                raise BackendError(f"no logprobs came back for choice {choice!r}")
            out.append(ents)
        return out

    def shutdown(self) -> None:
        self.client.close()


def _meta(resp: Any, finish_reason: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"id": getattr(resp, "id", None), "finish_reason": finish_reason}
    usage = getattr(resp, "usage", None)
    if usage is not None:
        meta["prompt_tokens"] = usage.prompt_tokens
        meta["completion_tokens"] = usage.completion_tokens
        details = getattr(usage, "prompt_tokens_details", None)
        if details is not None and getattr(details, "cached_tokens", None) is not None:
            meta["cached_tokens"] = details.cached_tokens
    return meta
