"""The in-process backend: a ``radixlm.Engine`` in this process, no sockets.

``LocalBackend(engine)`` wraps an existing Engine; ``LocalBackend(model_path, **args)``
builds one (and shuts it down with ``shutdown()``). ``set_default_backend(engine)``
wraps an Engine automatically.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from radixlm.frontend_dsl.backends.base import NativeBackend, Prompt
from radixlm.frontend_dsl.chat_template import ChatTemplate, resolve_chat_template
from radixlm.frontend_dsl.choices import Entries
from radixlm.frontend_dsl.tools import check_parser_name, template_messages

_REQUEST_KEYS = (
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "stream",
    "rid",
    "return_text_in_logprobs",
)


class LocalBackend(NativeBackend):
    """Runs programs on an in-process Engine."""

    def __init__(
        self,
        engine: Any = None,
        model_path: str | None = None,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
        **engine_args: Any,
    ) -> None:
        """``tool_call_parser``: the format ``gen(tool_choice="auto")`` reads (SGLang's
        ``--tool-call-parser`` names); by default the Engine's own flag."""
        self.owns_engine = engine is None
        if engine is None:
            if tool_call_parser is not None:
                engine_args["tool_call_parser"] = tool_call_parser
            from radixlm.runtime.entrypoints.engine.engine import (
                Engine,  # the one lazy import (docs/design.md)
            )

            engine = Engine(model_path=model_path, **engine_args)
        self.engine = engine
        server_args = getattr(engine, "server_args", None)
        self._tool_call_parser = check_parser_name(
            tool_call_parser or getattr(server_args, "tool_call_parser", None))
        tok = engine.tokenizer
        self.chat_template = resolve_chat_template(
            None if chat_template else getattr(tok, "chat_template", None),
            getattr(engine, "model_path", None),
            tok.bos_token or "",
            tok.eos_token or "",
            fallback=chat_template,
        )

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def tool_call_parser(self) -> str | None:
        return self._tool_call_parser

    def tool_special_tokens(self) -> frozenset[str]:
        tok = self.engine.tokenizer
        added = getattr(tok, "added_tokens_decoder", {}) or {}
        return frozenset({*(getattr(tok, "all_special_tokens", []) or []),
                          *(t.content for t in added.values() if getattr(t, "special", False))})

    def render_chat(self, messages, tools, add_generation_prompt):
        """The tokenizer's own template, as the server's chat route applies it."""
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("gen(tools=...) needs the model's own chat template; this "
                             "tokenizer has none")
        try:
            return tok.apply_chat_template(template_messages(messages), tools=tools,
                                           tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template error comes from the program
            raise ValueError(f"the model's chat template failed on this conversation: {e}"
                             ) from e

    def request(self, payload: dict[str, Any], timeout: float | None = None) -> Any:
        unknown = set(payload) - set(_REQUEST_KEYS)
        if unknown:
            raise ValueError(f"unknown request field(s) {sorted(unknown)}")
        args = dict(payload)
        if isinstance(args.get("text"), list) and isinstance(args.get("rid"), str):
            args.pop("rid")
        return self.engine.generate(prompt=args.pop("text", None), **args)

    def request_stream(
        self, payload: dict[str, Any], timeout: float | None = None
    ) -> Iterator[dict[str, Any]]:
        return self.request({**payload, "stream": True}, timeout)

    def choice_logprobs(self, prompt: Prompt, choices: list[str]) -> list[Entries]:
        """Exact token alignment: the choice's tokens start where the tokenization of
        prefix + choice first differs from the prefix's (which covers merges)."""
        tok = self.engine.tokenizer
        prefix_ids = tok.encode(prompt.text, add_special_tokens=False)
        full = [tok.encode(prompt.text + c, add_special_tokens=False) for c in choices]
        if prefix_ids:
            self.request({"input_ids": prefix_ids, "sampling_params": {"max_new_tokens": 0}})
        starts = [min(_common_prefix_len(prefix_ids, ids), len(ids) - 1) for ids in full]
        first = min(starts)
        outs = self.request(
            {
                "input_ids": full,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True,
                "logprob_start_len": first,
                "return_text_in_logprobs": True,
            }
        )
        result = []
        for start, out in zip(starts, outs):
            ents = out["meta_info"]["input_token_logprobs"][start - first :]
            result.append([e for e in ents if e[0] is not None])
        return result

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        if self.owns_engine:
            self.engine.shutdown()


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
