"""``radixlm prefix-report LOG``: options and the command."""

from __future__ import annotations

import argparse
import json
import sys

from radixlm.analysis.plot import plot_divergence
from radixlm.analysis.prefix_report import prefix_report, render_text
from radixlm.analysis.prompts import load_prompts


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", help="JSONL: the server's --log-requests-file, or prompts / "
                        "chat conversations (text, prompt, messages, conversations)")
    parser.add_argument("--tokenizer", default=None, help="local HF tokenizer (or model) "
                        "directory: positions and hit rates in its tokens, chats rendered "
                        "with its template (default: characters)")
    parser.add_argument("--family-chars", type=int, default=48, help="normalized leading "
                        "characters that name a template family")
    parser.add_argument("--page-size", type=int, default=1,
                        help="the server's --page-size: cache hits in whole pages")
    parser.add_argument("--max-requests", type=int, default=None,
                        help="read at most this many prompts")
    parser.add_argument("--max-families", type=int, default=10,
                        help="families shown in the text report (most tokens lost first)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="write a PNG histogram of the divergence positions")


def run_cli(args: argparse.Namespace) -> int:
    for name in ("family_chars", "page_size", "max_requests", "max_families"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"--{name.replace('_', '-')} must be >= 1, got {value}", file=sys.stderr)
            return 2
    tokenizer = None
    if args.tokenizer is not None:
        from radixlm.runtime.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    try:
        prompts, skipped = load_prompts(args.log, tokenizer, args.max_requests)
    except (OSError, ValueError) as e:
        print(f"prefix-report: {e}", file=sys.stderr)
        return 2
    report = prefix_report(prompts, tokenizer, args.family_chars, args.page_size)
    report["skipped_lines"] = skipped
    if args.plot:
        report["plot"] = str(plot_divergence(report, args.plot))
    print(json.dumps(report, indent=2, ensure_ascii=False) if args.json
          else render_text(report, args.max_families))
    return 0
