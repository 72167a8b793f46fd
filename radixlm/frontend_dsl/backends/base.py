"""What the interpreter asks of a backend, and the shared code of the backends that speak
SGLang's native ``/generate`` shapes (the in-process Engine and the HTTP endpoint).

The native backends compute ``select`` the SGLang way: cache the prefix once
(``max_new_tokens: 0``), then one batched request scores prefix + every choice from its
prompt-token logprobs, which reuse the cached prefix.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from radixlm.frontend_dsl.chat_template import ChatTemplate
from radixlm.frontend_dsl.choices import ChoicesDecision, ChoicesSamplingMethod, Entries
from radixlm.frontend_dsl.global_config import global_config
from radixlm.frontend_dsl.tools import ToolCall, ToolSpec, constrained_params, parse_output


class BackendError(RuntimeError):
    """A backend call failed (HTTP error, server error, lost connection)."""


@dataclass
class Prompt:
    """What a backend sees of a program at a ``gen`` or ``select``."""

    text: str
    messages: list[dict[str, Any]] = field(default_factory=list)  # OpenAI shapes
    open_role: str | None = None  # role begun but not ended
    open_role_text: str = ""  # text since that role began
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    timeout: float | None = None  # seconds left before the program's deadline


class Backend(ABC):
    """A place to run a program's calls. Methods may be called from many threads."""

    @abstractmethod
    def get_chat_template(self) -> ChatTemplate: ...

    @abstractmethod
    def generate(
        self, prompt: Prompt, sampling_params: dict[str, Any], logprob_args: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        """(text, meta_info) of one generation."""

    @abstractmethod
    def generate_stream(
        self, prompt: Prompt, sampling_params: dict[str, Any], logprob_args: dict[str, Any]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(text increment, meta_info so far) pieces of one generation."""

    @abstractmethod
    def select(
        self,
        prompt: Prompt,
        choices: list[str],
        temperature: float,
        choices_method: ChoicesSamplingMethod,
    ) -> ChoicesDecision: ...

    def cache_prefix(self, prompt: Prompt) -> None:
        """Compute and cache the KV of ``prompt.text`` (no-op where unsupported)."""
        return None

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    add_generation_prompt: bool) -> str | None:
        """The model's chat template applied to ``messages`` (OpenAI's shapes, calls and
        tool results included) and ``tools``; None where the backend sends the messages
        themselves (the OpenAI API)."""
        raise NotImplementedError(
            f"the {type(self).__name__} backend cannot offer tools to gen()")

    def generate_tools(self, prompt: Prompt, sampling_params: dict[str, Any],
                       logprob_args: dict[str, Any], tools: ToolSpec | None
                       ) -> tuple[str, list[ToolCall], dict[str, Any]]:
        """(content, calls, meta_info) of one chat turn offered ``tools`` (None: a turn of
        a conversation that holds calls, offered none)."""
        raise NotImplementedError(
            f"the {type(self).__name__} backend cannot offer tools to gen()")

    def abort(self, rid: str) -> None:
        """Stop request ``rid`` early (best effort)."""
        return None

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        """Release what the backend owns (processes, clients)."""
        return None


def _with_detokenize_options(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """The sampling params with ``global_config``'s detokenizer options, as SGLang's
    frontend sends them with every generation."""
    return {
        "skip_special_tokens": global_config.skip_special_tokens_in_output,
        "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
        **sampling_params,
    }


class NativeBackend(Backend):
    """A backend whose requests are SGLang ``/generate`` payloads."""

    @abstractmethod
    def request(self, payload: dict[str, Any], timeout: float | None = None) -> Any:
        """The response of one ``/generate`` payload (a dict, or a list for a batch)."""

    @abstractmethod
    def request_stream(
        self, payload: dict[str, Any], timeout: float | None = None
    ) -> Iterator[dict[str, Any]]:
        """Chunks of a streamed ``/generate``; each chunk's ``text`` is the increment."""

    def tool_call_parser(self) -> str | None:
        """The ``--tool-call-parser`` name that reads ``tool_choice="auto"`` output."""
        return None

    def tool_special_tokens(self) -> frozenset[str]:
        """The served tokenizer's special tokens (which no grammar can produce)."""
        return frozenset()

    def generate_tools(self, prompt, sampling_params, logprob_args, tools):
        """As the chat route: the tools' grammar in the sampling params, the output read
        by the plan's parser (``prompt.text`` is already the template's rendering)."""
        if tools is None:
            text, meta = self.generate(prompt, sampling_params, logprob_args)
            return text, [], meta
        plan = tools.plan(self.tool_call_parser())
        params = constrained_params(plan, sampling_params, self.tool_special_tokens())
        text, meta = self.generate(prompt, params, logprob_args)
        content, calls = parse_output(plan, text)
        return content, calls, meta

    def generate(self, prompt, sampling_params, logprob_args):
        payload = {
            "text": prompt.text,
            "sampling_params": _with_detokenize_options(sampling_params),
            "rid": prompt.rid,
            **logprob_args,
        }
        out = self.request(payload, prompt.timeout)
        return out["text"], out["meta_info"]

    def generate_stream(self, prompt, sampling_params, logprob_args):
        payload = {
            "text": prompt.text,
            "sampling_params": _with_detokenize_options(sampling_params),
            "rid": prompt.rid,
            "stream": True,
            **logprob_args,
        }
        for chunk in self.request_stream(payload, prompt.timeout):
            yield chunk["text"], chunk["meta_info"]

    def cache_prefix(self, prompt: Prompt | str) -> None:
        """Cache the KV of a prompt (or of a string, SGLang's ``cache_prefix(prefix_str)``)."""
        if isinstance(prompt, str):
            prompt = Prompt(prompt)
        if prompt.text:
            self.request(
                {"text": prompt.text, "sampling_params": {"max_new_tokens": 0}}, prompt.timeout
            )

    def select(self, prompt, choices, temperature, choices_method):
        if temperature > 1e-5:
            raise ValueError(
                f"select computes logprobs greedily; temperature must be 0, got {temperature}"
            )
        entries = self.choice_logprobs(prompt, choices)
        for choice, ents in zip(choices, entries):
            if not ents:
                raise BackendError(f"no logprobs came back for choice {choice!r}")
        uncond = None
        if choices_method.requires_unconditional_logprobs:
            ids = [[e[1] for e in ents] for ents in entries]
            outs = self.request(
                {
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": True,
                    "logprob_start_len": 0,
                },
                prompt.timeout,
            )
            uncond = [o["meta_info"]["input_token_logprobs"] for o in outs]
        normalized = [sum(e[0] for e in ents) / len(ents) for ents in entries]
        return choices_method(
            choices=choices,
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=entries,
            output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=uncond,
        )

    def choice_logprobs(self, prompt: Prompt, choices: list[str]) -> list[Entries]:
        """For each choice, the logprob entries of its tokens after ``prompt.text``.

        Without a tokenizer at hand: cache the prefix (its token count P comes back),
        score from position P-1, and drop that first entry unless the choice merged into
        the prefix's last token (then it is the choice's first token)."""
        prefix = prompt.text
        n_prefix = 0
        if prefix:
            out = self.request(
                {"text": prefix, "sampling_params": {"max_new_tokens": 0}}, prompt.timeout
            )
            n_prefix = out["meta_info"]["prompt_tokens"]
        outs = self.request(
            {
                "text": [prefix + c for c in choices],
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True,
                "logprob_start_len": max(n_prefix - 1, 0),
                "return_text_in_logprobs": True,
            },
            prompt.timeout,
        )
        result = []
        for out in outs:
            ents = out["meta_info"]["input_token_logprobs"]
            if n_prefix and ents and isinstance(ents[0][2], str) and prefix.endswith(ents[0][2]):
                ents = ents[1:]
            result.append([e for e in ents if e[0] is not None])
        return result


# keys of a streamed chunk's meta_info that hold only that chunk's part (SGLang 0.5)
INCREMENTAL_META_KEYS = (
    "output_token_logprobs",
    "output_top_logprobs",
    "output_token_ids_logprobs",
)


def merge_stream_meta(earlier: dict[str, Any] | None, later: dict[str, Any]) -> dict[str, Any]:
    """``later`` with the incremental lists of ``earlier`` in front: the meta_info of two
    consecutive streamed chunks as if they were one."""
    if not earlier:
        return later
    merged = dict(later)
    for key in INCREMENTAL_META_KEYS:
        if key in earlier or key in later:
            merged[key] = list(earlier.get(key) or []) + list(later.get(key) or [])
    return merged
