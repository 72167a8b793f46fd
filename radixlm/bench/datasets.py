"""What ``radixlm bench serve`` sends: every dataset becomes a list of ``Conversation``s.

A conversation is what the arrival process starts; its turns go out one after another.
Single-request datasets are one-turn conversations. In a chat conversation each turn
carries the history: the earlier user turns and the server's own replies, so a server
with prefix caching reuses the whole conversation so far (the agent workload).

- ``random``: prompts of random vocabulary tokens (SGLang's lengths: uniform in
  [len * range_ratio, len]).
- ``generated-shared-prefix``: ``gsp_num_groups`` random system prompts, each followed by
  ``gsp_prompts_per_group`` random questions (SGLang's dataset of that name).
- ``multi-turn``: chat conversations of ``multi_turn_num_turns`` turns after one shared
  system prompt; or, with ``--dataset-path``, the user turns of each line replayed.
- ``long-document``: ``long_doc_num_docs`` long random documents, each asked questions
  (chunked prefill, and the document shared by its questions).
- ``custom``: ``--dataset-path`` JSONL, one request per line.

JSONL lines: ``{"prompt": str}`` (or ``"text"``), ``{"messages": [{"role", "content"}]}``
(OpenAI) or ``{"conversations": [{"from", "value"}]}`` (ShareGPT); an optional
``"output_len"`` (or ``"max_tokens"``). Without one, a turn asks for as many tokens as the
file's assistant reply after it has, else ``--random-output-len``.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATASETS = ("random", "generated-shared-prefix", "multi-turn", "long-document", "custom")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "system": "system"}


@dataclass
class Turn:
    text: str
    output_len: int


@dataclass
class Conversation:
    turns: list[Turn]
    history: list[dict[str, str]] = field(default_factory=list)  # before the first turn
    chat: bool = False  # turns are chat messages (history kept) rather than raw prompts

    @property
    def num_requests(self) -> int:
        return len(self.turns)


class RandomText:
    """Text of n random vocabulary tokens (special tokens excluded), seeded."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.ids = sorted(i for i in tokenizer.get_vocab().values() if i not in special)
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)

    def __call__(self, n: int) -> str:
        return self.tokenizer.decode(self.rng.choices(self.ids, k=n))

    def lens(self, full: int, range_ratio: float, count: int) -> list[int]:
        return [self.rng.randint(max(int(full * range_ratio), 1), full) for _ in range(count)]


def _check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")


def random_dataset(args: argparse.Namespace, text: RandomText) -> list[Conversation]:
    _check_positive(args, "num_prompts", "random_input_len", "random_output_len")
    n = args.num_prompts
    ins = text.lens(args.random_input_len, args.random_range_ratio, n)
    outs = text.lens(args.random_output_len, args.random_range_ratio, n)
    return [Conversation([Turn(text(i), o)]) for i, o in zip(ins, outs)]


def shared_prefix_dataset(args: argparse.Namespace, text: RandomText) -> list[Conversation]:
    _check_positive(args, "gsp_num_groups", "gsp_prompts_per_group", "gsp_system_prompt_len",
                    "gsp_question_len", "gsp_output_len")
    convs = []
    for _ in range(args.gsp_num_groups):
        system = text(args.gsp_system_prompt_len)
        convs += [Conversation([Turn(system + text(args.gsp_question_len), args.gsp_output_len)])
                  for _ in range(args.gsp_prompts_per_group)]
    text.rng.shuffle(convs)
    return convs


def multi_turn_dataset(args: argparse.Namespace, text: RandomText) -> list[Conversation]:
    _check_positive(args, "num_prompts", "multi_turn_num_turns", "multi_turn_user_len",
                    "multi_turn_output_len")
    system = text(args.multi_turn_system_prompt_len) if args.multi_turn_system_prompt_len else ""
    history = [{"role": "system", "content": system}] if system else []
    return [
        Conversation([Turn(text(args.multi_turn_user_len), args.multi_turn_output_len)
                      for _ in range(args.multi_turn_num_turns)], list(history), chat=True)
        for _ in range(args.num_prompts)
    ]


def long_document_dataset(args: argparse.Namespace, text: RandomText) -> list[Conversation]:
    _check_positive(args, "num_prompts", "long_doc_num_docs", "long_doc_len",
                    "long_doc_question_len", "long_doc_output_len")
    docs = [text(args.long_doc_len) for _ in range(args.long_doc_num_docs)]
    convs = [
        Conversation([Turn(docs[i % len(docs)] + "\n\nQuestion: " +
                           text(args.long_doc_question_len), args.long_doc_output_len)])
        for i in range(args.num_prompts)
    ]
    text.rng.shuffle(convs)
    return convs


def _messages_of(line: dict[str, Any], where: str) -> list[dict[str, str]]:
    if "messages" in line:
        msgs = [{"role": m["role"], "content": m["content"]} for m in line["messages"]]
    else:
        msgs = []
        for m in line["conversations"]:
            role = SHAREGPT_ROLES.get(m.get("from", m.get("role", "")))
            if role is None:
                raise ValueError(f"{where}: unknown speaker {m.get('from')!r}")
            msgs.append({"role": role, "content": m.get("value", m.get("content", ""))})
    if not any(m["role"] == "user" for m in msgs):
        raise ValueError(f"{where}: the conversation has no user message")
    return msgs


def _turns(msgs: list[dict[str, str]], fixed: int | None, default: int, tokenizer: Any,
           all_turns: bool) -> tuple[list[dict[str, str]], list[Turn]]:
    """(history before the first sent turn, the user turns to send)."""
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    sent = users if all_turns else users[-1:]
    head = msgs[: sent[0]]
    if all_turns:  # the file's own replies are replaced by the server's
        head = [m for m in head if m["role"] == "system"]
    turns = []
    for i in sent:
        reply = msgs[i + 1]["content"] if i + 1 < len(msgs) else None
        n = fixed or (len(tokenizer.encode(reply, add_special_tokens=False)) if reply else 0)
        turns.append(Turn(msgs[i]["content"], max(n, 1) if n else default))
    return head, turns


def file_dataset(args: argparse.Namespace, tokenizer: Any) -> list[Conversation]:
    path = Path(args.dataset_path)
    if not path.is_file():
        raise ValueError(f"--dataset-path {str(path)!r} is not a file")
    convs = []
    for no, raw in enumerate(path.read_text().splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{path}:{no}"
        line = json.loads(raw)
        fixed = line.get("output_len", line.get("max_tokens"))
        if "prompt" in line or "text" in line:
            prompt = line.get("prompt", line.get("text"))
            convs.append(Conversation([Turn(prompt, fixed or args.random_output_len)]))
        elif "messages" in line or "conversations" in line:
            msgs = _messages_of(line, where)
            head, turns = _turns(msgs, fixed, args.random_output_len, tokenizer,
                                 args.dataset_name == "multi-turn")
            convs.append(Conversation(turns, head, chat=True))
        else:
            raise ValueError(f"{where}: expected a 'prompt', 'messages' or 'conversations' key")
        if len(convs) == args.num_prompts:
            break
    if not convs:
        raise ValueError(f"--dataset-path {str(path)!r} holds no requests")
    return convs


def sample_conversations(args: argparse.Namespace, tokenizer: Any) -> list[Conversation]:
    """The run's conversations, the same for the same arguments and ``--seed``."""
    if args.dataset_path:
        if args.dataset_name not in ("custom", "multi-turn"):
            raise ValueError("--dataset-path is read by --dataset-name custom or multi-turn, "
                             f"not {args.dataset_name}")
        return file_dataset(args, tokenizer)
    if args.dataset_name == "custom":
        raise ValueError("--dataset-name custom needs --dataset-path FILE.jsonl")
    text = RandomText(tokenizer, args.seed)
    make = {"random": random_dataset, "generated-shared-prefix": shared_prefix_dataset,
            "multi-turn": multi_turn_dataset, "long-document": long_document_dataset}
    return make[args.dataset_name](args, text)


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """A chat as one prompt string for completion-style APIs: the tokenizer's chat template
    when it has one, else ``role: content`` lines."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
