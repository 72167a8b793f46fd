"""Prompts from a JSONL file: the server's request log (``--log-requests-file``) or any JSONL
of prompts or chat conversations.

One JSON value per line: a string (a prompt), or an object with ``text`` or ``prompt`` (a
string or a list of strings), ``messages`` (OpenAI chat), ``conversations`` /
``conversation`` (ShareGPT: ``from``/``value`` or ``role``/``content``), or ``input_ids``
(decoded with the tokenizer, skipped without one). ``namespace`` (the request log's) keeps
requests that cannot share a cache apart.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# request_log.TRUNCATION_MARK at the end of a cut prompt (tests/runtime/entrypoints/
# test_request_log.py checks the two agree)
TRUNCATION_RE = re.compile(r"\.\.\.\[truncated \d+ chars\]$")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant"}


@dataclass
class Prompt:
    """One request's prompt as the cache sees it."""

    index: int  # order in the file
    text: str
    namespace: str = "default"
    truncated: bool = False  # cut by the request log: its end is unknown
    prompt_tokens: int | None = None  # what the server reported, when the log has it
    cached_tokens: int | None = None


def render_chat(messages: list[dict[str, Any]], tokenizer: Any = None) -> str:
    """The prompt text of a conversation: the tokenizer's chat template when it has one,
    else ``<|role|>\\ncontent\\n`` per message."""
    conv = [{"role": str(m.get("role", "user")), "content": _content(m.get("content"))}
            for m in messages]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in conv)


def _content(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _sharegpt(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for t in turns:
        role = t.get("role", t.get("from", "user"))
        out.append({"role": SHAREGPT_ROLES.get(str(role), str(role)),
                    "content": t.get("content", t.get("value", ""))})
    return out


def texts_of(value: Any, tokenizer: Any = None) -> list[tuple[str, bool]] | None:
    """The prompts of one JSONL value as (text, truncated); None if it holds none."""
    if isinstance(value, str):
        return [(value, False)]
    if not isinstance(value, dict):
        return None
    cut = bool(value.get("truncated"))
    for key in ("text", "prompt"):
        v = value.get(key)
        if isinstance(v, str):
            return [(_strip_mark(v, cut), cut)]
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            return [(x, False) for x in v]
    messages = value.get("messages")
    if messages is None:
        turns = value.get("conversations", value.get("conversation"))
        messages = _sharegpt(turns) if isinstance(turns, list) else None
    if isinstance(messages, list) and messages:
        if cut:
            last = dict(messages[-1])
            last["content"] = _strip_mark(_content(last.get("content")), True)
            messages = [*messages[:-1], last]
        return [(render_chat(messages, tokenizer), cut)]
    ids = value.get("input_ids")
    if isinstance(ids, list) and ids and tokenizer is not None:
        return [(tokenizer.decode(ids), cut)]
    return None


def _strip_mark(text: str, cut: bool) -> str:
    return TRUNCATION_RE.sub("", text) if cut else text


def load_prompts(path: str | Path, tokenizer: Any = None, max_requests: int | None = None
                 ) -> tuple[list[Prompt], int]:
    """The prompts of ``path`` in file order, and how many lines held none (skipped).
    ValueError naming the line on a line that is not JSON."""
    prompts: list[Prompt] = []
    skipped = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            found = texts_of(value, tokenizer)
            if not found:
                skipped += 1
                continue
            meta = value if isinstance(value, dict) else {}
            for text, cut in found:
                prompts.append(Prompt(len(prompts), text, str(meta.get("namespace", "default")),
                                      cut, meta.get("prompt_tokens"), meta.get("cached_tokens")))
            if max_requests is not None and len(prompts) >= max_requests:
                return prompts[:max_requests], skipped
    return prompts, skipped
