"""CPU seconds the tool-call and reasoning parsers spend on long outputs (issue 55), in one
source tree; run it on two to compare (each tree in its own process):

    .venv/bin/python benchmarks/parser_cost.py [--tree DIR] [--chars 11000 100000]
        [--choices 24]

Make the old tree with ``git archive REV | tar -x -C DIR``. Two loads:

- the finding: 24 chat choices (six streams with ``n=4``), each a pythonic call forced
  open, fed through ``ChoiceOutput`` in 4-character deltas, as the HTTP process does;
- one stream of each format's long call (and of long thinking), 4-character deltas.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

STEP = 4
CALLS = {  # --tool-call-parser (or reasoning parser) -> (head, repeated unit, tail)
    "pythonic": ('[get_weather(city="', "Paris, ", ""),
    "qwen25": ('<tool_call>\n{"name": "f", "arguments": {"text": "', "Paris, ",
               '"}}\n</tool_call>'),
    "llama3": ('<|python_tag|>{"name": "f", "parameters": {"text": "', "Paris, ", '"}}'),
    "mistral": ('[TOOL_CALLS] [{"name": "f", "arguments": {"text": "', "Paris, ", '"}}]'),
    "gpt-oss": ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>"
                '{"text": "', "Paris, ", '"}<|call|>'),
    "reasoning qwen3": ("<think>\n", "Plan it. ", "</think>\n\nAnswer."),
}


def _text(head: str, unit: str, tail: str, chars: int) -> str:
    return (head + unit * (chars // len(unit) + 1))[:chars - len(tail)] + tail


def _stream(feed, text: str) -> None:
    for i in range(0, len(text), STEP):
        feed(text[i:i + STEP])


def run(chars: int, choices: int) -> None:
    from radixlm.runtime.entrypoints.openai.chat_output import ChoiceOutput
    from radixlm.runtime.entrypoints.openai.function_call import (
        ToolCallParser,
        tool_call_format,
    )
    from radixlm.runtime.entrypoints.openai.reasoning_parser import ReasoningParser

    text = _text(*CALLS["pythonic"], chars)
    outs = [ChoiceOutput(None, ToolCallParser(tool_call_format("pythonic")))
            for _ in range(choices)]
    t0 = time.process_time()
    _stream(lambda d: [o.delta(d) for o in outs], text)
    for o in outs:
        o.delta("", final=True)
    print(f"  {choices} pythonic choices x {chars} chars: {time.process_time() - t0:8.3f} s CPU")
    for name, parts in CALLS.items():
        if name.startswith("reasoning"):
            parser = ReasoningParser(name.split()[1])
        else:
            parser = ToolCallParser(tool_call_format(name))
        t0 = time.process_time()
        _stream(parser.feed, _text(*parts, chars))
        parser.finish()
        print(f"  {name:16s} one stream of {chars} chars: {time.process_time() - t0:8.3f} s CPU")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=".", help="the radixlm source tree to time")
    ap.add_argument("--chars", type=int, nargs="+", default=[11_000, 100_000])
    ap.add_argument("--choices", type=int, default=24, help="choices of the first load")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        for chars in args.chars:
            run(chars, args.choices)
        return
    tree = os.path.abspath(args.tree)
    print(f"tree {tree}", flush=True)
    env = {**os.environ, "PYTHONPATH": tree}
    subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--choices",
                    str(args.choices), "--chars", *map(str, args.chars)], cwd=tree, env=env,
                   check=True)


if __name__ == "__main__":
    main()
