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
        **engine_args: Any,
    ) -> None:
        self.owns_engine = engine is None
        if engine is None:
            from radixlm.runtime.entrypoints.engine.engine import (
                Engine,  # the one lazy import (docs/design.md)
            )

            engine = Engine(model_path=model_path, **engine_args)
        self.engine = engine
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
