"""ServerArgs' allowed values and range checks (``check_server_args``, which
``ServerArgs.validate`` calls): every setting's limits in one place, apart from the fields."""

from __future__ import annotations

import os
import re
from typing import Any

from radixlm.runtime.kv_events_config import KVEventsConfig

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs", "lof")
RADIX_EVICTION_POLICIES = ("lru", "lfu")  # SGLang's others (slru, priority, tlru): refused
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "outlines")
# SGLang's --tool-call-parser / --reasoning-parser names radixlm reads (entrypoints/
# function_call/registry.py and entrypoints/reasoning_parser.py map them)
TOOL_CALL_PARSERS = ("qwen25", "qwen", "hermes", "llama3", "mistral", "pythonic", "gpt-oss")
REASONING_PARSERS = ("qwen3", "deepseek-r1", "deepseek-v3", "kimi", "glm45", "gpt-oss")
LOAD_BALANCE_METHODS = ("cache_aware", "round_robin", "shortest_queue", "minimum_tokens")
# SGLang 0.5's names: "auto" (its default), its request and token counts, and PD's room
# placement (round_robin for requests without a room)
LOAD_BALANCE_ALIASES = {"auto": "cache_aware", "total_requests": "shortest_queue",
                        "total_tokens": "minimum_tokens", "follow_bootstrap_room": "round_robin"}
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("zmq",)
# SGLang's backends that need RDMA / NVLink libraries radixlm does not ship
SGLANG_TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "mori", "fake")
# --kv-cache-dtype: SGLang's spellings that apply to us, plus fp16 / float16 / float32
# (radix_cache.kv_pool.KV_CACHE_DTYPES maps them to torch dtypes)
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "float32", "fp8_e5m2",
                   "fp8_e4m3")
SGLANG_KV_CACHE_DTYPES = ("mxfp8", "nvfp4", "fp4_mx_block16")  # block-scaled: refused
# --torchao-config: SGLang's values radixlm implements ("" is off); its others need
# dynamic-activation int8 or int4 / fp8 kernels radixlm does not have
TORCHAO_CONFIGS = ("", "int8wo")
# --quantization: SGLang's names of the checkpoint formats radixlm reads (executor/quant/);
# the marlin names are SGLang's GPU kernels for the same AWQ / GPTQ layouts
QUANTIZATION_METHODS = ("awq", "awq_marlin", "gptq", "gptq_marlin", "fp8", "compressed-tensors",
                        "w8a8_int8", "w8a8_fp8", "gguf")
LOAD_FORMATS = ("auto", "safetensors", "gguf")
SGLANG_TORCHAO_CONFIGS = ("int8dq", "int4wo-<group_size>", "fp8wo", "fp8dq-per_tensor",
                          "fp8dq-per_row")


def check_server_args(args: Any) -> None:
    """ValueError naming the first ServerArgs field out of range (``ServerArgs.validate``)."""

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(msg)

    need(args.page_size >= 1, f"page_size must be >= 1, got {args.page_size}")
    need(args.schedule_policy in SCHEDULE_POLICIES,
         f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {args.schedule_policy!r}")
    need(args.dtype in ("auto", "float32", "float16", "bfloat16"),
         f"dtype must be auto|float32|float16|bfloat16, got {args.dtype!r}")
    why = (" (SGLang's block-scaled mxfp8, nvfp4 and fp4_mx_block16 need CUDA kernels "
           "radixlm does not have)" if args.kv_cache_dtype in SGLANG_KV_CACHE_DTYPES else "")
    need(args.kv_cache_dtype in KV_CACHE_DTYPES, f"kv_cache_dtype (--kv-cache-dtype) must "
         f"be one of {KV_CACHE_DTYPES}, got {args.kv_cache_dtype!r}{why}")
    need(args.device in ("auto", "cpu", "cuda") or args.device.startswith("cuda:"),
         f"device must be auto|cpu|cuda, got {args.device!r}")
    _check_quantization(args, need)
    _check_hicache(args, need)
    _check_hybrid_swa(args, need)
    need(args.radix_eviction_policy in RADIX_EVICTION_POLICIES,
         f"radix_eviction_policy must be one of {RADIX_EVICTION_POLICIES} (SGLang's slru, "
         f"priority and tlru are not supported), got {args.radix_eviction_policy!r}")
    need(args.priority_scheduling_preemption_threshold >= 0,
         "priority_scheduling_preemption_threshold must be >= 0, got "
         f"{args.priority_scheduling_preemption_threshold}")
    need(args.grammar_backend in GRAMMAR_BACKENDS,
         f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {args.grammar_backend!r}")
    need(args.sampling_defaults in ("model", "openai"),
         f"sampling_defaults (--sampling-defaults) must be model or openai, got "
         f"{args.sampling_defaults!r}")
    need(args.tool_call_parser is None or args.tool_call_parser in TOOL_CALL_PARSERS,
         f"tool_call_parser (--tool-call-parser) must be one of {TOOL_CALL_PARSERS}, got "
         f"{args.tool_call_parser!r}")
    need(args.tool_call_parser is None or args.grammar_backend != "outlines",
         "--tool-call-parser needs --grammar-backend xgrammar or llguidance: the outlines "
         "backend cannot hold a call to its schema after free text (tool_choice 'auto')")
    need(args.reasoning_parser is None or args.reasoning_parser in REASONING_PARSERS,
         f"reasoning_parser (--reasoning-parser) must be one of {REASONING_PARSERS}, got "
         f"{args.reasoning_parser!r}")
    need(args.grammar_compile_timeout > 0,
         f"grammar_compile_timeout must be > 0, got {args.grammar_compile_timeout}")
    need(args.grammar_compile_memory_mb == 0 or args.grammar_compile_memory_mb >= 64,
         "grammar_compile_memory_mb must be 0 (no limit) or >= 64, got "
         f"{args.grammar_compile_memory_mb}")
    need(args.grammar_step_budget_ms >= 0,
         f"grammar_step_budget_ms must be >= 0, got {args.grammar_step_budget_ms}")
    need(args.attention_backend in (None, "torch", "triton"),
         f"attention_backend must be torch or triton, got {args.attention_backend!r}")
    need(args.max_total_tokens is None or args.max_total_tokens >= 2 * args.page_size,
         f"max_total_tokens must be >= 2 pages, got {args.max_total_tokens}")
    need(args.chunked_prefill_size == -1 or args.chunked_prefill_size >= 1,
         f"chunked_prefill_size must be >= 1 or -1, got {args.chunked_prefill_size}")
    need(args.max_prefill_tokens >= 1,
         f"max_prefill_tokens must be >= 1, got {args.max_prefill_tokens}")
    need(args.max_running_requests is None or args.max_running_requests >= 1,
         f"max_running_requests must be >= 1, got {args.max_running_requests}")
    need(args.max_queued_requests is None or args.max_queued_requests >= 1,
         f"max_queued_requests must be >= 1, got {args.max_queued_requests}")
    need(args.context_length is None or args.context_length >= 2,
         f"context_length must be >= 2, got {args.context_length}")
    need(args.cuda_graph_max_bs is None or args.cuda_graph_max_bs >= 1,
         f"cuda_graph_max_bs must be >= 1, got {args.cuda_graph_max_bs}")
    need(args.cpu_threads is None or args.cpu_threads >= 1,
         f"cpu_threads must be >= 1, got {args.cpu_threads}")
    for name in ("max_request_bytes", "max_n", "max_stop_sequences", "max_stop_length",
                 "max_logit_bias", "max_top_logprobs_num", "max_batch_prompts",
                 "max_chat_messages"):
        need(getattr(args, name) >= 1, f"{name} must be >= 1, got {getattr(args, name)}")
    need(args.max_stored_responses >= 0,
         f"max_stored_responses must be >= 0, got {args.max_stored_responses}")
    need(args.max_stored_response_bytes >= 1,
         f"max_stored_response_bytes must be >= 1, got {args.max_stored_response_bytes}")
    need(args.log_requests_level in (0, 1, 2, 3),
         f"log_requests_level must be 0, 1, 2 or 3, got {args.log_requests_level}")
    need(args.log_requests_max_chars >= 1,
         f"log_requests_max_chars must be >= 1, got {args.log_requests_max_chars}")
    for name in ("request_read_timeout", "watchdog_timeout"):
        need(getattr(args, name) > 0, f"{name} must be > 0, got {getattr(args, name)}")
    need(args.timeout_header_read > 0,
         f"timeout_header_read must be > 0, got {args.timeout_header_read}")
    need(args.max_connections is None or args.max_connections >= 1,
         f"max_connections must be >= 1, got {args.max_connections}")
    for name in args.tokenizer_metrics_allowed_custom_labels or ():
        need(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) is not None
             and not name.startswith("__") and name != "finish_reason",
             f"tokenizer_metrics_allowed_custom_labels: {name!r} is not a usable "
             "Prometheus label name")
    if args.kv_events_config is not None:
        KVEventsConfig.from_json(args.kv_events_config)
    need(args.tp_size >= 1, f"tp_size must be >= 1, got {args.tp_size}")
    need(args.nnodes >= 1 and args.tp_size % args.nnodes == 0,
         f"tp_size ({args.tp_size}) must be a multiple of nnodes ({args.nnodes})")
    need(0 <= args.node_rank < args.nnodes,
         f"node_rank must be in [0, nnodes={args.nnodes}), got {args.node_rank}")
    need(args.nnodes == 1 or args.dist_init_addr is not None,
         "dist_init_addr (host:port of node 0) is needed when nnodes > 1")
    need(args.dist_init_addr is None
         or re.fullmatch(r"[^:\s]+:\d+", args.dist_init_addr) is not None,
         f"dist_init_addr must be host:port, got {args.dist_init_addr!r}")
    port = (args.dist_init_addr or "").rpartition(":")[2]
    need(not (port.isascii() and port.isdigit())
         or 0 < int(port) + args.dp_size - 1 < 65536,
         f"dist_init_addr's port + dp_size - 1 must be a TCP port (replica r meets at "
         f"port + r), got {args.dist_init_addr!r} with dp_size {args.dp_size}")
    need(args.dist_timeout > 0, f"dist_timeout must be > 0, got {args.dist_timeout}")
    need(args.dp_size >= 1, f"dp_size must be >= 1, got {args.dp_size}")
    need(args.base_gpu_id >= 0, f"base_gpu_id must be >= 0, got {args.base_gpu_id}")
    need(args.load_balance_method in LOAD_BALANCE_METHODS + tuple(LOAD_BALANCE_ALIASES),
         f"load_balance_method must be one of "
         f"{LOAD_BALANCE_METHODS + tuple(LOAD_BALANCE_ALIASES)}, "
         f"got {args.load_balance_method!r}")
    need(args.load_balance_method != "follow_bootstrap_room"
         or args.disaggregation_mode != "null", "load_balance_method "
         "follow_bootstrap_room places PD requests by their bootstrap_room: it needs "
         "--disaggregation-mode prefill or decode")
    need(args.cache_aware_balance_abs_threshold >= 0,
         "cache_aware_balance_abs_threshold must be >= 0, got "
         f"{args.cache_aware_balance_abs_threshold}")
    need(args.cache_aware_balance_rel_threshold >= 1.0,
         "cache_aware_balance_rel_threshold must be >= 1.0, got "
         f"{args.cache_aware_balance_rel_threshold}")
    need(0.0 <= args.cache_aware_threshold <= 1.0,
         f"cache_aware_threshold must be in [0, 1], got {args.cache_aware_threshold}")
    _check_disaggregation(args, need)
    _check_keys(args, need)


def _check_quantization(args: Any, need: Any) -> None:
    """--torchao-config int8wo quantizes a float checkpoint at load; --quantization names
    a quantized checkpoint's format (checked against its quantization_config at load)."""
    need(args.torchao_config in TORCHAO_CONFIGS,
         f"torchao_config (--torchao-config) must be 'int8wo' (weight-only int8, per output "
         f"channel) or empty, got {args.torchao_config!r}; SGLang's "
         f"{', '.join(SGLANG_TORCHAO_CONFIGS)} are not supported")
    need(args.quantization is None or args.quantization in QUANTIZATION_METHODS,
         f"quantization (--quantization) must be one of {', '.join(QUANTIZATION_METHODS)}, "
         f"got {args.quantization!r} (SGLang's and vLLM's online methods such as 'rtn', "
         "bitsandbytes, marlin-only and NVIDIA/AMD formats are not read)")
    need(args.load_format in LOAD_FORMATS,
         f"load_format (--load-format) must be one of {LOAD_FORMATS}, got {args.load_format!r}")
    need(not (args.torchao_config and (args.quantization or args.load_format == "gguf")),
         "torchao_config (--torchao-config) quantizes a float checkpoint; the checkpoint is "
         "already quantized (--quantization / --load-format gguf)")
    need(args.quantization != "gguf" or args.load_format in ("auto", "gguf"),
         f"quantization gguf needs load_format auto or gguf, got {args.load_format!r}")


def _check_keys(args: Any, need: Any) -> None:
    key = args.admin_api_key
    need(key is None or (key != "" and key.split() == [key]),
         "admin_api_key must be a non-empty string without spaces")
    need(args.admin_api_key is None or args.admin_api_key != args.api_key,
         "admin_api_key must differ from api_key")
    need(args.weights_root is None or os.path.isdir(args.weights_root),
         f"weights_root must be a directory, got {args.weights_root!r}")


def _check_disaggregation(args: Any, need: Any) -> None:
    need(args.disaggregation_mode in DISAGGREGATION_MODES,
         f"disaggregation_mode must be one of {DISAGGREGATION_MODES}, "
         f"got {args.disaggregation_mode!r}")
    backend = args.disaggregation_transfer_backend
    need(backend in TRANSFER_BACKENDS, f"disaggregation_transfer_backend {backend!r} is "
         f"not available: radixlm moves KV pages over {TRANSFER_BACKENDS} only"
         + (" (SGLang's mooncake, nixl, ascend and mori need RDMA/NVLink libraries; "
            "fake is for SGLang's tests)" if backend in SGLANG_TRANSFER_BACKENDS else ""))
    need(0 < args.disaggregation_bootstrap_port < 65536, "disaggregation_bootstrap_port "
         f"must be a TCP port (1..65535), got {args.disaggregation_bootstrap_port}")
    need(all(h and h.strip() == h for h in args.disaggregation_trusted_hosts),
         "disaggregation_trusted_hosts must be host names or addresses, got "
         f"{args.disaggregation_trusted_hosts!r}")
    for name in ("disaggregation_bootstrap_timeout", "disaggregation_waiting_timeout"):
        need(getattr(args, name) > 0, f"{name} must be > 0, got {getattr(args, name)}")
    need(not (args.is_embedding and args.disaggregation_mode != "null"),
         "is_embedding (--is-embedding) serves prefill-only requests; it cannot run with "
         f"--disaggregation-mode {args.disaggregation_mode}")


HICACHE_WRITE_POLICIES = ("write_through", "write_back")
HICACHE_PREFETCH_POLICIES = ("auto", "best_effort", "wait_complete", "timeout")
HICACHE_STORAGE_BACKENDS = ("file",)
SGLANG_HICACHE_STORAGE_BACKENDS = ("mooncake", "hf3fs", "nixl", "aibrix", "eic", "lmcache",
                                   "dynamic")


def _check_hicache(args: Any, need: Any) -> None:
    """--enable-hierarchical-cache and its --hicache-* flags (a flag without the tier, or a
    tier radixlm lacks, is refused rather than ignored)."""
    backend = args.hicache_storage_backend
    for name in ("hicache_ratio", "hicache_size"):
        need(getattr(args, name) is None,
             f"{name}: radixlm has no separate host-memory tier (on a CPU the KV pool is host "
             "memory already); use --hicache-storage-backend file for a tier below the pool")
    why = (" (SGLang's backend needs a service or library radixlm does not ship)"
           if backend in SGLANG_HICACHE_STORAGE_BACKENDS else "")
    need(backend is None or backend in HICACHE_STORAGE_BACKENDS,
         f"hicache_storage_backend must be one of {HICACHE_STORAGE_BACKENDS}, got "
         f"{backend!r}{why}")
    need(args.hicache_write_policy in HICACHE_WRITE_POLICIES,
         f"hicache_write_policy must be one of {HICACHE_WRITE_POLICIES} (SGLang's "
         f"write_through_selective is not supported), got {args.hicache_write_policy!r}")
    need(args.hicache_storage_prefetch_policy in HICACHE_PREFETCH_POLICIES,
         f"hicache_storage_prefetch_policy must be one of {HICACHE_PREFETCH_POLICIES}, got "
         f"{args.hicache_storage_prefetch_policy!r}")
    need(args.hicache_storage_size_gb > 0,
         f"hicache_storage_size_gb must be > 0, got {args.hicache_storage_size_gb}")
    if not args.enable_hierarchical_cache:
        need(backend is None, "hicache_storage_backend needs --enable-hierarchical-cache")
        return
    need(backend is not None, "enable_hierarchical_cache needs --hicache-storage-backend file "
         "(radixlm's tier below the pool is storage; it has no host-memory tier)")
    need(not args.disable_radix_cache,
         "enable_hierarchical_cache needs the radix cache (drop --disable-radix-cache)")


def _check_hybrid_swa(args: Any, need: Any) -> None:
    """--enable-hybrid-swa-memory: the settings the SWA pool does not support yet are
    refused by name (their KV copies read or write every layer at one slot)."""
    need(0 < args.swa_full_tokens_ratio <= 1,
         f"swa_full_tokens_ratio must be in (0, 1], got {args.swa_full_tokens_ratio}")
    if not args.enable_hybrid_swa_memory:
        return
    need(not args.disable_hybrid_swa_memory,
         "enable_hybrid_swa_memory and disable_hybrid_swa_memory are both set")
    for name, on in (("enable_hierarchical_cache", args.enable_hierarchical_cache),
                     ("disaggregation_mode", args.disaggregation_mode != "null"),
                     ("tp_size", args.tp_size > 1)):
        need(not on, f"enable_hybrid_swa_memory does not support {name} yet (the SWA pool "
             "is per process and its K/V copies are not written); drop one of them")
