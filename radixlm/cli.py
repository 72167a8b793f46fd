"""``radixlm`` command line: ``demo``, ``make-tiny-model``, ``serve``, ``bench serve`` (and
the benchmarks/ scripts as ``bench NAME``), ``prefix-report`` (see --help)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from radixlm import server_args_cli
from radixlm.analysis import cli as prefix_report_cli
from radixlm.bench import scripts as bench_scripts
from radixlm.bench import serve as bench_serve
from radixlm.runtime.disaggregation import launcher as pd_launcher
from radixlm.runtime.entrypoints.listener import bind_listener
from radixlm.tiny_families import FAMILIES, make_family_model
from radixlm.tiny_hybrids import HYBRIDS, make_hybrid_model
from radixlm.tiny_model import ARCHS, add_shape_args, make_tiny_model, shape_from_args

DEMO_PROMPTS = [
    "The capital of France is",
    "The capital of France is Paris, and the capital of Italy is",
    "Once upon a time",
    "To make a good cup of tea, first",
]


def _server_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    server_args_cli.add_group_help(parser)
    server_args_cli.add_server_args(parser)
    return parser


def _demo(args: argparse.Namespace) -> int:
    from radixlm.runtime.entrypoints.engine.engine import Engine

    with Engine(**dataclasses.asdict(server_args_cli.server_args_from_cli(args))) as eng:
        # one after another, so that the second finds the first's prefix in the radix cache
        outs = [eng.generate(p, {"max_new_tokens": 24, "temperature": 0}) for p in DEMO_PROMPTS]
        for prompt, out in zip(DEMO_PROMPTS, outs):
            meta = out["meta_info"]
            print(
                f"{prompt!r} -> {out['text']!r}  (prompt {meta['prompt_tokens']}, "
                f"cached {meta['cached_tokens']}, generated {meta['completion_tokens']})"
            )
        info = eng.get_server_info()
        print(
            f"KV pool: {info['max_total_num_tokens']} tokens of {info['kv_cache_dtype']}, "
            f"cache hit rate {100 * info['cache_hit_rate']:.1f}%"
        )
    return 0


def _make_tiny(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    shape = shape_from_args(args)
    if args.arch in FAMILIES:  # written by transformers' own classes (tiny_families.py)
        if shape is not None:
            parser.error(f"--preset and the size flags are for llama / qwen2, not {args.arch}")
        path = make_family_model(args.dir, args.arch, seed=args.seed)
    elif args.arch in HYBRIDS:  # linear-attention hybrids (tiny_hybrids.py)
        if shape is not None:
            parser.error(f"--preset and the size flags are for llama / qwen2, not {args.arch}")
        path = make_hybrid_model(args.dir, args.arch, seed=args.seed)
    else:
        try:
            path = make_tiny_model(args.dir, arch=args.arch, seed=args.seed, shape=shape)
        except ValueError as e:  # a shape that cannot be built (heads vs kv heads, ...)
            parser.error(str(e))
    print(path)
    return 0


def _serve(args: argparse.Namespace) -> int:
    server_args = server_args_cli.server_args_from_cli(args)
    # the port is the server's before seconds of imports (listener.py); a node that runs
    # only tensor-parallel ranks serves no HTTP
    sock = bind_listener(server_args.host, server_args.port) if server_args.node_rank == 0 \
        else None
    # imported here, as Engine above: a server's spawned children import this module again
    # when it is the main one (``radixlm serve``), and seconds of imports each are theirs
    from radixlm.runtime.entrypoints.launch import launch_server

    return launch_server(server_args, sock)


def _serve_pd(args: argparse.Namespace) -> int:
    flags = args.server_flags[1:] if args.server_flags[:1] == ["--"] else args.server_flags
    return pd_launcher.run(args, flags)


def _bench(args: argparse.Namespace) -> int:
    return bench_serve.run_cli(args)


def _prefix_report(args: argparse.Namespace) -> int:
    return prefix_report_cli.run_cli(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in bench_scripts.SCRIPTS:
        # every argument is the script's, --help included: argparse would claim them
        return bench_scripts.run(argv[1], argv[2:])
    parser = argparse.ArgumentParser(prog="radixlm")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = _server_flags(sub.add_parser(
        "demo", help="offline generation on the built-in tiny model", add_help=False,
        usage=server_args_cli.USAGE))
    serve = _server_flags(sub.add_parser(
        "serve", help="the HTTP server: SGLang's /generate and OpenAI /v1/*", add_help=False,
        usage=server_args_cli.USAGE,
        description="Serve a model (--model-path DIR; default: the built-in tiny model) on "
                    "SGLang's native API and OpenAI's. --help=GROUP shows one group."))
    serve_pd = sub.add_parser("serve-pd", help="a prefill server, a decode server and a "
                              "router on this machine: radixlm serve-pd [opts] -- FLAGS "
                              "(FLAGS: radixlm serve's, given to both servers)")
    pd_launcher.add_cli_args(serve_pd)
    serve_pd.add_argument("server_flags", nargs=argparse.REMAINDER)
    tiny = sub.add_parser("make-tiny-model", help="write a tiny random model of any supported "
                          "family (and the built-in tokenizer) to DIR")
    tiny.add_argument("dir")
    tiny.add_argument("--arch", choices=[*ARCHS, *FAMILIES, *HYBRIDS], default="llama",
                      help="llama / qwen2: the built-in models; the others: hidden 64, 3 "
                           "layers, each family's special features on (radixlm/tiny_families.py"
                           "; the hybrids qwen3_next(_moe), qwen3_5(_moe), qwen3_5mm, "
                           "nemotron_h, granitemoehybrid, falcon_h1, bamba, jamba: "
                           "radixlm/tiny_hybrids.py)")
    tiny.add_argument("--seed", type=int, default=0)
    add_shape_args(tiny)
    bench = sub.add_parser("bench", help="a load generator against any server, and the "
                           "benchmarks/ scripts (docs/benchmarks.md)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve.add_cli_args(bench_sub.add_parser(
        "serve", help="load generator: throughput, TTFT/TPOT/ITL/E2E percentiles, goodput",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    for name, (script, what) in bench_scripts.SCRIPTS.items():  # run before parsing, above
        bench_sub.add_parser(name, add_help=False, help=f"{what} (benchmarks/{script})")
    prefix_report_cli.add_cli_args(sub.add_parser(
        "prefix-report", help="where and why prompts in a request log stop sharing a prefix",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's own usage, and the flag a misspelt one meant
        own = {"demo": demo, "serve": serve}.get(args.command)
        if own is None:
            parser.parse_args(argv)  # argparse's own error
        own.error(server_args_cli.suggest_flag(unknown))
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
    )
    handlers = {"demo": _demo, "make-tiny-model": lambda a: _make_tiny(a, tiny),
                "serve": _serve, "bench": _bench,
                "serve-pd": _serve_pd,
                "prefix-report": _prefix_report}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
