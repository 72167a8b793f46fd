"""The command line of ServerArgs: every field a flag, the flags in groups by topic.

``add_server_args(parser)`` adds one flag per ServerArgs field (``--model-path`` for
``model_path``) in the argument group of ``FLAG_GROUPS``; ``server_args_from_cli(args)``
builds the ServerArgs back. ``--help`` prints every group, ``--help=GROUP`` one group
(vLLM's form; a word that names no group lists the flags whose name contains it), and
``suggest_flag`` finds the flag a misspelt one meant. A field missing from ``FLAG_GROUPS``
fails ``tests/test_cli.py``: a new setting is placed in a topic when it is added.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from typing import Any, get_type_hints

from radixlm.runtime.config import ServerArgs

# name -> (title, fields): the order of --help
FLAG_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "model": ("the model and its numbers", (
        "model_path", "load_format", "tokenizer_path", "served_model_name", "dtype", "device",
        "context_length", "kv_cache_dtype", "torchao_config", "quantization", "is_embedding",
        "sampling_defaults", "random_seed")),
    "server": ("where it listens and how it stops", (
        "host", "port", "shutdown_timeout", "watchdog_timeout")),
    "scheduling": ("batches, chunks, priorities and the CPU", (
        "chunked_prefill_size", "max_prefill_tokens", "max_running_requests",
        "max_queued_requests", "schedule_policy", "enable_priority_scheduling",
        "schedule_low_priority_values_first", "priority_scheduling_preemption_threshold",
        "disable_priority_preemption", "default_priority_value",
        "abort_on_priority_when_disabled", "enable_mixed_chunk", "disable_mixed_chunk",
        "attention_backend", "cuda_graph_max_bs", "disable_cuda_graph",
        "disable_cpu_weight_prepack", "disable_cpu_malloc_cache", "cpu_threads")),
    "cache": ("the KV pool, the radix cache and the storage tier", (
        "page_size", "max_total_tokens", "kv_cache_memory_gb", "mem_fraction_static",
        "disable_radix_cache", "radix_eviction_policy", "enable_hybrid_swa_memory",
        "disable_hybrid_swa_memory", "swa_full_tokens_ratio", "enable_hierarchical_cache",
        "hicache_storage_backend", "hicache_storage_dir", "hicache_storage_size_gb",
        "hicache_write_policy", "hicache_storage_prefetch_policy", "hicache_ratio",
        "hicache_size")),
    "parallelism": ("data-parallel replicas and tensor-parallel ranks", (
        "dp_size", "base_gpu_id", "load_balance_method", "cache_aware_threshold",
        "cache_aware_balance_abs_threshold", "cache_aware_balance_rel_threshold", "tp_size",
        "nnodes", "node_rank", "dist_init_addr", "dist_timeout")),
    "disaggregation": ("prefill/decode disaggregation", (
        "disaggregation_mode", "disaggregation_bootstrap_port",
        "disaggregation_transfer_backend", "disaggregation_secret_file",
        "disaggregation_trusted_hosts", "disaggregation_bootstrap_timeout",
        "disaggregation_waiting_timeout")),
    "speculative": ("speculative decoding", (
        "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
        "speculative_eagle_topk", "speculative_num_draft_tokens",
        "speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size")),
    "grammar": ("structured output, tools and reasoning", (
        "grammar_backend", "disable_jump_forward", "grammar_compile_timeout",
        "grammar_compile_memory_mb", "grammar_step_budget_ms", "grammar_cache_size",
        "tool_call_parser", "reasoning_parser")),
    "security": ("keys, tenants and the limits a request may not pass", (
        "api_key", "admin_api_key", "weights_root", "max_request_bytes",
        "request_read_timeout", "timeout_header_read", "max_connections", "max_n",
        "max_stop_sequences", "max_stop_length", "max_logit_bias", "max_top_logprobs_num",
        "max_batch_prompts", "max_chat_messages", "max_stored_responses",
        "max_stored_response_bytes")),
    "observability": ("logs, metrics and KV events", (
        "log_level", "log_requests", "log_requests_level", "log_requests_file",
        "log_requests_max_chars", "enable_metrics", "decode_log_interval",
        "tokenizer_metrics_allowed_custom_labels", "tokenizer_metrics_custom_labels_header",
        "kv_events_config")),
}

USAGE = "%(prog)s [--model-path DIR] [--host HOST] [--port PORT] [FLAG ...]"


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _help(f: dataclasses.Field, kind: Any) -> str:
    """The field's help with its default once: not for switches (off unless given), not
    for an unset default, not where the help already says it."""
    text = f.metadata.get("help", "")
    default = f.default
    if kind is bool or default in (None, "", ()) or "default" in text.lower():
        return text
    shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
    return f"{text} (default: {shown})" if text else f"default: {shown}"


def _add_field(group: Any, f: dataclasses.Field, kind: Any) -> None:
    flag, help_text = flag_name(f.name), _help(f, kind)
    if kind is bool:
        group.add_argument(flag, action="store_true", default=f.default, help=help_text)
    elif "tuple" in str(kind):  # a list of names
        group.add_argument(flag, nargs="+", type=str, default=f.default, help=help_text,
                           metavar=f.name.split("_")[-1].upper())
    else:
        group.add_argument(flag, type=_base_type(kind), default=f.default, help=help_text,
                           metavar=f.name.split("_")[-1].upper())


def add_server_args(parser: argparse.ArgumentParser, groups: list[str] | None = None) -> None:
    """Every ServerArgs field as a flag, in FLAG_GROUPS' groups (only ``groups`` if given)."""
    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    hints = get_type_hints(ServerArgs)
    for name, (title, members) in FLAG_GROUPS.items():
        if groups is not None and name not in groups:
            continue
        group = parser.add_argument_group(f"{name}: {title}")
        for member in members:
            _add_field(group, fields[member], hints[member])


def server_args_from_cli(args: argparse.Namespace) -> ServerArgs:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs)}
    return ServerArgs(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def ungrouped_fields() -> list[str]:
    """ServerArgs fields no group names, and group members that are not fields."""
    grouped = [m for _, members in FLAG_GROUPS.values() for m in members]
    names = [f.name for f in dataclasses.fields(ServerArgs)]
    return sorted(set(names) ^ set(grouped)) + sorted({m for m in grouped
                                                      if grouped.count(m) > 1})


class GroupHelp(argparse.Action):
    """``--help`` (every group), ``--help=GROUP`` (one), ``--help=WORD`` (the flags whose
    name contains WORD)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        topic = (values or "all").lower()
        if topic == "all":
            parser.print_help()
            parser.exit()
        one = argparse.ArgumentParser(prog=parser.prog, usage=USAGE, add_help=False)
        if topic in FLAG_GROUPS:
            add_server_args(one, [topic])
        elif not _add_matching(one, topic):
            parser.exit(2, f"{parser.prog}: no group or flag matches {topic!r}; groups: "
                           f"{', '.join(FLAG_GROUPS)}\n")
        one.print_help()
        parser.exit()


def _add_matching(parser: argparse.ArgumentParser, word: str) -> int:
    """The flags whose name contains ``word``; how many."""
    hints = get_type_hints(ServerArgs)
    group = parser.add_argument_group(f"flags matching {word!r}")
    matching = [f for f in dataclasses.fields(ServerArgs)
                if word.replace("-", "_").strip("_") in f.name]
    for f in matching:
        _add_field(group, f, hints[f.name])
    return len(matching)


def add_group_help(parser: argparse.ArgumentParser) -> None:
    """The -h / --help[=GROUP] flag of a parser made with ``add_help=False``."""
    parser.add_argument("-h", "--help", nargs="?", const="all", metavar="GROUP",
                        action=GroupHelp, default=argparse.SUPPRESS,
                        help=f"show this help; --help=GROUP for one of {', '.join(FLAG_GROUPS)}"
                             "; --help=WORD for the flags whose name contains WORD")


def suggest_flag(unknown: list[str]) -> str:
    """'unrecognized arguments: ...' with the nearest server flag for each."""
    flags = ["--help", *(flag_name(f.name) for f in dataclasses.fields(ServerArgs))]
    parts = []
    for arg in unknown:
        name = arg.split("=", 1)[0]
        close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6) \
            if name.startswith("--") else []
        parts.append(f"{arg} (did you mean {close[0]}?)" if close else arg)
    return "unrecognized arguments: " + " ".join(parts)


def _base_type(kind: Any) -> type:
    for t in (int, float, str):
        if kind is t or (getattr(kind, "__args__", None) and t in kind.__args__):
            return t
    raise TypeError(f"no CLI type for {kind}")
