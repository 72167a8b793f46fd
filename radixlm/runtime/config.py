"""ServerArgs: every engine and server setting in one frozen dataclass.

CLI flags are generated from the fields (``add_cli_args`` / ``from_cli_args``), with
SGLang's names where the concept is the same. Numbers derived from these settings and
the model (pool size, concurrency) are computed by the objects that own them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from radixlm.runtime.kv_events_config import KVEventsConfig

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs", "lof")
RADIX_EVICTION_POLICIES = ("lru", "lfu")  # SGLang's others (slru, priority, tlru): refused
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "outlines")
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


@dataclass(frozen=True)
class ServerArgs:
    # model
    model_path: str | None = field(default=None, metadata={"help": "local HF model directory "
                                   "(default: the built-in tiny model)"})
    tokenizer_path: str | None = field(default=None, metadata={"help": "default: model_path"})
    dtype: str = field(default="auto", metadata={"help": "auto|float32|float16|bfloat16"})
    device: str = field(default="auto", metadata={"help": "auto|cpu|cuda"})
    context_length: int | None = field(default=None, metadata={"help": "override the model's"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "|".join(KV_CACHE_DTYPES) + " (SGLang's flag): the KV pool's dtype; auto: the "
                "model's. A narrower cache holds more tokens and is read faster; fp8 rows are "
                "plain casts with no scale (SGLang's default scale 1.0, without "
                "--quantization-param-path), e4m3 saturating at +-448"})
    # memory and cache
    page_size: int = field(default=1, metadata={"help": "tokens per KV page"})
    max_total_tokens: int | None = field(default=None, metadata={"help": "KV pool size in tokens"})
    kv_cache_memory_gb: float = field(default=1.0, metadata={
        "help": "KV pool memory on CPU when --max-total-tokens is not given"})
    mem_fraction_static: float = field(default=0.85, metadata={
        "help": "share of free GPU memory for the KV pool (CUDA)"})
    disable_radix_cache: bool = False
    radix_eviction_policy: str = field(default="lru", metadata={
        "help": "lru|lfu: which radix-cache leaves are evicted first: least recently used, "
                "or fewest hits (ties: least recently used)"})
    # scheduling
    chunked_prefill_size: int = field(default=2048, metadata={"help": "max tokens per forward "
                                      "(prefill chunks); -1 disables chunking"})
    max_prefill_tokens: int = field(default=16384, metadata={"help": "max new prompt tokens "
                                    "admitted per prefill batch"})
    max_running_requests: int | None = None
    max_queued_requests: int | None = None
    schedule_policy: str = field(default="lpm", metadata={"help": "|".join(SCHEDULE_POLICIES)})
    enable_priority_scheduling: bool = field(default=False, metadata={
        "help": "order waiting requests by their priority first (higher values first), then "
                "by --schedule-policy; a waiting request may preempt running ones"})
    schedule_low_priority_values_first: bool = field(default=False, metadata={
        "help": "with --enable-priority-scheduling, lower priority values run first"})
    priority_scheduling_preemption_threshold: int = field(default=10, metadata={
        "help": "how much more urgent a waiting request must be to preempt a running one"})
    disable_priority_preemption: bool = field(default=False, metadata={
        "help": "with --enable-priority-scheduling, never preempt running requests"})
    default_priority_value: int | None = field(default=None, metadata={
        "help": "priority of requests that give none (default: the least urgent)"})
    abort_on_priority_when_disabled: bool = field(default=False, metadata={
        "help": "without --enable-priority-scheduling, refuse (503) requests that set a "
                "priority instead of ignoring it"})
    enable_mixed_chunk: bool = field(default=True, metadata={
        "help": "run prefill chunks and decode tokens in one forward"})
    disable_mixed_chunk: bool = False
    attention_backend: str | None = field(default=None, metadata={"help": "torch|triton "
                                          "(default: triton on CUDA, torch on CPU)"})
    cuda_graph_max_bs: int | None = field(default=None, metadata={
        "help": "largest decode batch replayed from a CUDA graph (CUDA with the Triton "
                "path; default 160, fewer when the pool cannot hold that many requests)"})
    disable_cuda_graph: bool = field(default=False, metadata={
        "help": "run every decode forward eagerly (no CUDA graph capture at startup)"})
    disable_cpu_weight_prepack: bool = field(default=False, metadata={
        "help": "on a CPU in float32, multiply by the dense weights (torch's matmul repacks "
                "them on every call) instead of oneDNN-prepacked copies made at startup; "
                "the copies hold the linear and LM-head weights a second time"})
    random_seed: int | None = None
    cpu_threads: int | None = field(default=None, metadata={
        "help": "torch CPU threads of the server's scheduler process (default: CPU cores - 1, "
                "leaving one for HTTP and detokenisation; split evenly between --dp-size replicas; "
                "OpenMP threads that compete with "
                "other processes for a core slow every step down); in the offline Engine, "
                "when given, torch's thread count (default: torch's own)"})
    # constrained decoding
    grammar_backend: str = field(default="xgrammar", metadata={
        "help": "xgrammar|llguidance|outlines: compiles regex / json_schema / ebnf grammars"})
    disable_jump_forward: bool = field(default=False, metadata={
        "help": "do not append grammar-forced text without sampling it"})
    grammar_compile_timeout: float = field(default=10.0, metadata={
        "help": "seconds a regex / JSON schema may take to compile (its first compile runs "
                "in a child process, killed past it: the request is then a 400)"})
    grammar_compile_memory_mb: int = field(default=1024, metadata={
        "help": "MB of memory a grammar's first compile may take, in a child process killed "
                "past it (the request is then a 400); 0 compiles in the scheduler unbounded"})
    grammar_cache_size: int = field(default=256, metadata={
        "help": "compiled grammars kept (LRU)"})
    # server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = field(default=None, metadata={
        "help": "the API key, or a file of 'key tenant' lines (each tenant has its own "
                "cache namespace and rids, and no admin rights)"})
    admin_api_key: str | None = field(default=None, metadata={
        "help": "the admin's key (SGLang's flag): weight updates, /flush_cache, abort_all "
                "and /metrics need it; without it the one --api-key key is the admin, and "
                "tenant keys never are"})
    weights_root: str | None = field(default=None, metadata={
        "help": "/update_weights_from_disk loads only directories under this one (symlinks "
                "and '..' resolved first); unset: any directory"})
    served_model_name: str | None = None
    shutdown_timeout: float = field(default=30.0, metadata={"help": "seconds running requests "
                                    "get to finish after SIGTERM"})
    # limits a request may not pass (HTTP 400 / 413 beyond them)
    max_request_bytes: int = field(default=8 << 20, metadata={
        "help": "largest request body in bytes (413 beyond it, before it is read whole)"})
    request_read_timeout: float = field(default=30.0, metadata={
        "help": "seconds a client may take to send a request body (408 after)"})
    timeout_header_read: float = field(default=10.0, metadata={
        "help": "seconds a connection may take to send a complete request head (from "
                "being accepted, or from the first byte of a later request on it); it is "
                "closed after"})
    max_connections: int | None = field(default=None, metadata={
        "help": "most HTTP connections open at once; one beyond it gets 503 and is closed "
                "(default: half of ulimit -n, at most 10000)"})
    max_n: int = field(default=64, metadata={"help": "largest n (samples per prompt)"})
    max_stop_sequences: int = field(default=64, metadata={
        "help": "most stop strings (and stop_token_ids) per request"})
    max_stop_length: int = field(default=1024, metadata={
        "help": "longest stop string, in characters"})
    max_logit_bias: int = field(default=1024, metadata={"help": "most logit_bias entries"})
    max_top_logprobs_num: int = field(default=64, metadata={
        "help": "largest top_logprobs_num (native) / logprobs (OpenAI completions)"})
    max_batch_prompts: int = field(default=2048, metadata={
        "help": "most prompts (texts or input_ids lists) in one /generate, /v1/completions "
                "or /tokenize request"})
    max_chat_messages: int = field(default=2048, metadata={
        "help": "most messages in one /v1/chat/completions request"})
    tokenizer_metrics_allowed_custom_labels: tuple[str, ...] | None = field(
        default=None, metadata={"help": "label names requests may set on the request metrics "
                                "(custom_labels in /generate, the labels header on /v1)"})
    tokenizer_metrics_custom_labels_header: str = field(default="x-custom-labels", metadata={
        "help": "HTTP header of the OpenAI routes that carries custom labels as a JSON object"})
    watchdog_timeout: float = field(default=300.0, metadata={
        "help": "seconds the scheduler's loop may make no progress before the server fails "
                "its requests and exits (SGLang's --watchdog-timeout)"})
    # logging
    log_level: str = "info"
    log_requests: bool = field(default=False, metadata={
        "help": "log every finished request to the console, one JSON line each, with as much "
                "as --log-requests-level says (SGLang's flag)"})
    log_requests_level: int = field(default=2, metadata={
        "help": "0: metadata; 1: and sampling params; 2: and the prompt up to 2048 "
                "characters; 3: and the prompt up to --log-requests-max-chars (SGLang's levels)"})
    log_requests_file: str | None = field(default=None, metadata={
        "help": "append one JSON line per finished request to this file (prompt, namespace, "
                "token counts, finish reason, latencies): the input of radixlm prefix-report"})
    log_requests_max_chars: int = field(default=16384, metadata={
        "help": "longest prompt (characters; token ids when there is no text) a request log "
                "record keeps; longer ones are cut and marked"})
    enable_metrics: bool = field(default=False, metadata={
        "help": "SGLang's flag, accepted for its command lines: radixlm always serves /metrics"})
    decode_log_interval: int = field(default=40, metadata={"help": "decode steps per log line"})
    kv_events_config: str | None = field(default=None, metadata={
        "help": "JSON (vLLM's and SGLang's flag): publish the radix tree's BlockStored / "
                "BlockRemoved / AllBlocksCleared events in vLLM's wire format on a zmq PUB "
                'socket, e.g. \'{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", '
                '"replay_endpoint": "tcp://127.0.0.1:5558"}\'; keys: vLLM\'s KVEventsConfig'})
    tp_size: int = field(default=1, metadata={
        "help": "tensor parallel size: ranks that each hold 1/tp_size of every layer (heads, "
                "KV heads, MLP, vocabulary); torch.distributed with NCCL on CUDA, gloo on CPU"})
    nnodes: int = field(default=1, metadata={
        "help": "machines the tensor-parallel ranks span (tp_size / nnodes ranks on each)"})
    node_rank: int = field(default=0, metadata={
        "help": "this machine's index among --nnodes (0 runs the scheduler and the server; "
                "the others run only their ranks)"})
    dist_init_addr: str | None = field(default=None, metadata={
        "help": "host:port where the ranks meet (rank 0 listens; needed with --nnodes > 1; "
                "default: a free loopback port); with --dp-size, replica r meets at port + r"})
    dist_timeout: float = field(default=120.0, metadata={
        "help": "seconds a tensor-parallel collective may take before the ranks fail, so a "
                "rank that hangs brings the server down (joining at startup may take 300 s)"})
    dp_size: int = field(default=1, metadata={
        "help": "data parallel replicas: scheduler processes, each with its own model copy and "
                "KV pool, behind one HTTP server (on a CPU they split --cpu-threads; on GPUs "
                "replica i uses cuda:(--base-gpu-id + i))"})
    base_gpu_id: int = field(default=0, metadata={
        "help": "the first GPU of the replicas (SGLang's flag)"})
    load_balance_method: str = field(default="cache_aware", metadata={
        "help": "|".join(LOAD_BALANCE_METHODS) + ": how --dp-size replicas share requests; "
                "cache_aware: the replica holding the longest prefix of the prompt (from its "
                "own KV events) unless it is overloaded (the two thresholds below). SGLang "
                "0.5's names: auto (cache_aware), total_requests (shortest_queue), "
                "total_tokens (minimum_tokens), follow_bootstrap_room (a PD request's room "
                "decides: room mod --dp-size; a prefill server always places rooms so)"})
    cache_aware_balance_abs_threshold: int = field(default=2048, metadata={
        "help": "cache_aware: a replica whose load (queued + running tokens) exceeds the "
                "least loaded one's by more than this many tokens, and by more than "
                "--cache-aware-balance-rel-threshold times, gets no cache-routed request "
                "(sglang-router's --balance-abs-threshold, in tokens instead of requests)"})
    cache_aware_balance_rel_threshold: float = field(default=1.5, metadata={
        "help": "cache_aware: see --cache-aware-balance-abs-threshold "
                "(sglang-router's --balance-rel-threshold)"})
    cache_aware_threshold: float = field(default=0.3, metadata={
        "help": "cache_aware: a request goes by cache only to a replica holding more than "
                "this share of its prompt, else to the least loaded one (sglang-router's "
                "--cache-threshold)"})
    disaggregation_mode: str = field(default="null", metadata={
        "help": "null|prefill|decode (SGLang's): a prefill server computes prompts and sends "
                "their KV pages and first token to the decode server named by each request's "
                "bootstrap_host/port/room; a decode server receives them and decodes"})
    disaggregation_bootstrap_port: int = field(default=8998, metadata={
        "help": "prefill server: the port of its bootstrap service, where decode servers "
                "ask for its KV transfer endpoint (SGLang's); decode server: the port used "
                "for a request whose bootstrap_port is null"})
    disaggregation_transfer_backend: str = field(default="zmq", metadata={
        "help": "how KV pages travel: zmq (TCP; SGLang's mooncake, nixl, ascend and mori "
                "need RDMA/NVLink libraries radixlm does not ship)"})
    disaggregation_secret_file: str | None = field(default=None, metadata={
        "help": "prefill and decode servers: a file (mode 0600, 32..4096 bytes, e.g. "
                "`openssl rand -hex 32`) holding the key both servers share; every PD "
                "socket speaks CurveZMQ with keys derived from it, so KV pages and claims "
                "come only from peers holding it. Required by --disaggregation-mode "
                "prefill/decode (radixlm serve-pd makes one itself)"})
    disaggregation_trusted_hosts: tuple[str, ...] = field(default=(), metadata={
        "help": "decode server: the only bootstrap_host values a request may name (others "
                "get a 403 before anything connects); empty: any host, authenticated by "
                "the secret"})
    disaggregation_bootstrap_timeout: float = field(default=300.0, metadata={
        "help": "seconds a room may wait to be claimed (prefill) or for the prefill's "
                "bootstrap service to answer (decode) before its request fails "
                "(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)"})
    disaggregation_waiting_timeout: float = field(default=300.0, metadata={
        "help": "seconds a claimed room may wait for its KV (decode) or for the decode's "
                "acknowledgement (prefill) before its request fails and its pages are "
                "freed (SGLANG_DISAGGREGATION_WAITING_TIMEOUT)"})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        need(self.schedule_policy in SCHEDULE_POLICIES,
             f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        need(self.dtype in ("auto", "float32", "float16", "bfloat16"),
             f"dtype must be auto|float32|float16|bfloat16, got {self.dtype!r}")
        why = (" (SGLang's block-scaled mxfp8, nvfp4 and fp4_mx_block16 need CUDA kernels "
               "radixlm does not have)" if self.kv_cache_dtype in SGLANG_KV_CACHE_DTYPES else "")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, f"kv_cache_dtype (--kv-cache-dtype) must "
             f"be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}{why}")
        need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device must be auto|cpu|cuda, got {self.device!r}")
        need(self.radix_eviction_policy in RADIX_EVICTION_POLICIES,
             f"radix_eviction_policy must be one of {RADIX_EVICTION_POLICIES} (SGLang's slru, "
             f"priority and tlru are not supported), got {self.radix_eviction_policy!r}")
        need(self.priority_scheduling_preemption_threshold >= 0,
             "priority_scheduling_preemption_threshold must be >= 0, got "
             f"{self.priority_scheduling_preemption_threshold}")
        need(self.grammar_backend in GRAMMAR_BACKENDS,
             f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}")
        need(self.grammar_compile_timeout > 0,
             f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}")
        need(self.grammar_compile_memory_mb == 0 or self.grammar_compile_memory_mb >= 64,
             "grammar_compile_memory_mb must be 0 (no limit) or >= 64, got "
             f"{self.grammar_compile_memory_mb}")
        need(self.attention_backend in (None, "torch", "triton"),
             f"attention_backend must be torch or triton, got {self.attention_backend!r}")
        need(self.max_total_tokens is None or self.max_total_tokens >= 2 * self.page_size,
             f"max_total_tokens must be >= 2 pages, got {self.max_total_tokens}")
        need(self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1,
             f"chunked_prefill_size must be >= 1 or -1, got {self.chunked_prefill_size}")
        need(self.max_prefill_tokens >= 1,
             f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        need(self.max_running_requests is None or self.max_running_requests >= 1,
             f"max_running_requests must be >= 1, got {self.max_running_requests}")
        need(self.max_queued_requests is None or self.max_queued_requests >= 1,
             f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        need(self.context_length is None or self.context_length >= 2,
             f"context_length must be >= 2, got {self.context_length}")
        need(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
             f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        need(self.cpu_threads is None or self.cpu_threads >= 1,
             f"cpu_threads must be >= 1, got {self.cpu_threads}")
        for name in ("max_request_bytes", "max_n", "max_stop_sequences", "max_stop_length",
                     "max_logit_bias", "max_top_logprobs_num", "max_batch_prompts",
                     "max_chat_messages"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        need(self.log_requests_level in (0, 1, 2, 3),
             f"log_requests_level must be 0, 1, 2 or 3, got {self.log_requests_level}")
        need(self.log_requests_max_chars >= 1,
             f"log_requests_max_chars must be >= 1, got {self.log_requests_max_chars}")
        for name in ("request_read_timeout", "watchdog_timeout"):
            need(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        need(self.timeout_header_read > 0,
             f"timeout_header_read must be > 0, got {self.timeout_header_read}")
        need(self.max_connections is None or self.max_connections >= 1,
             f"max_connections must be >= 1, got {self.max_connections}")
        for name in self.tokenizer_metrics_allowed_custom_labels or ():
            need(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) is not None
                 and not name.startswith("__") and name != "finish_reason",
                 f"tokenizer_metrics_allowed_custom_labels: {name!r} is not a usable "
                 "Prometheus label name")
        if self.kv_events_config is not None:
            KVEventsConfig.from_json(self.kv_events_config)
        need(self.tp_size >= 1, f"tp_size must be >= 1, got {self.tp_size}")
        need(self.nnodes >= 1 and self.tp_size % self.nnodes == 0,
             f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes})")
        need(0 <= self.node_rank < self.nnodes,
             f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        need(self.nnodes == 1 or self.dist_init_addr is not None,
             "dist_init_addr (host:port of node 0) is needed when nnodes > 1")
        need(self.dist_init_addr is None
             or re.fullmatch(r"[^:\s]+:\d+", self.dist_init_addr) is not None,
             f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        port = (self.dist_init_addr or "").rpartition(":")[2]
        need(not (port.isascii() and port.isdigit())
             or 0 < int(port) + self.dp_size - 1 < 65536,
             f"dist_init_addr's port + dp_size - 1 must be a TCP port (replica r meets at "
             f"port + r), got {self.dist_init_addr!r} with dp_size {self.dp_size}")
        need(self.dist_timeout > 0, f"dist_timeout must be > 0, got {self.dist_timeout}")
        need(self.dp_size >= 1, f"dp_size must be >= 1, got {self.dp_size}")
        need(self.base_gpu_id >= 0, f"base_gpu_id must be >= 0, got {self.base_gpu_id}")
        need(self.load_balance_method in LOAD_BALANCE_METHODS + tuple(LOAD_BALANCE_ALIASES),
             f"load_balance_method must be one of "
             f"{LOAD_BALANCE_METHODS + tuple(LOAD_BALANCE_ALIASES)}, "
             f"got {self.load_balance_method!r}")
        need(self.load_balance_method != "follow_bootstrap_room"
             or self.disaggregation_mode != "null", "load_balance_method "
             "follow_bootstrap_room places PD requests by their bootstrap_room: it needs "
             "--disaggregation-mode prefill or decode")
        need(self.cache_aware_balance_abs_threshold >= 0,
             "cache_aware_balance_abs_threshold must be >= 0, got "
             f"{self.cache_aware_balance_abs_threshold}")
        need(self.cache_aware_balance_rel_threshold >= 1.0,
             "cache_aware_balance_rel_threshold must be >= 1.0, got "
             f"{self.cache_aware_balance_rel_threshold}")
        need(0.0 <= self.cache_aware_threshold <= 1.0,
             f"cache_aware_threshold must be in [0, 1], got {self.cache_aware_threshold}")
        self._validate_disaggregation(need)
        self._validate_keys(need)

    def _validate_keys(self, need: Any) -> None:
        key = self.admin_api_key
        need(key is None or (key != "" and key.split() == [key]),
             "admin_api_key must be a non-empty string without spaces")
        need(self.admin_api_key is None or self.admin_api_key != self.api_key,
             "admin_api_key must differ from api_key")
        need(self.weights_root is None or os.path.isdir(self.weights_root),
             f"weights_root must be a directory, got {self.weights_root!r}")

    def _validate_disaggregation(self, need: Any) -> None:
        need(self.disaggregation_mode in DISAGGREGATION_MODES,
             f"disaggregation_mode must be one of {DISAGGREGATION_MODES}, "
             f"got {self.disaggregation_mode!r}")
        backend = self.disaggregation_transfer_backend
        need(backend in TRANSFER_BACKENDS, f"disaggregation_transfer_backend {backend!r} is "
             f"not available: radixlm moves KV pages over {TRANSFER_BACKENDS} only"
             + (" (SGLang's mooncake, nixl, ascend and mori need RDMA/NVLink libraries; "
                "fake is for SGLang's tests)" if backend in SGLANG_TRANSFER_BACKENDS else ""))
        need(0 < self.disaggregation_bootstrap_port < 65536, "disaggregation_bootstrap_port "
             f"must be a TCP port (1..65535), got {self.disaggregation_bootstrap_port}")
        need(all(h and h.strip() == h for h in self.disaggregation_trusted_hosts),
             "disaggregation_trusted_hosts must be host names or addresses, got "
             f"{self.disaggregation_trusted_hosts!r}")
        for name in ("disaggregation_bootstrap_timeout", "disaggregation_waiting_timeout"):
            need(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def balance_method(self) -> str:
        """``load_balance_method`` in radixlm's names (SGLang 0.5's mapped)."""
        return LOAD_BALANCE_ALIASES.get(self.load_balance_method, self.load_balance_method)

    def resolve_cpu_threads(self) -> int:
        """Torch threads for the scheduler on a CPU: ``cpu_threads``, else all cores but one;
        with ``dp_size`` replicas each gets its share (at least one)."""
        total = self.cpu_threads or max(len(os.sched_getaffinity(0)) - 1, 1)
        return max(total // self.dp_size, 1)

    def kv_events(self) -> KVEventsConfig | None:
        """The parsed ``kv_events_config`` when it publishes, else None."""
        if self.kv_events_config is None:
            return None
        cfg = KVEventsConfig.from_json(self.kv_events_config)
        return cfg if cfg.publishing else None

    @property
    def mixed_chunk(self) -> bool:
        return self.enable_mixed_chunk and not self.disable_mixed_chunk

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; valid: {sorted(names)}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            kind = hints[f.name]
            if kind is bool:
                parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
                continue
            if "tuple" in str(kind):  # a list of names
                parser.add_argument(flag, nargs="+", type=str, default=f.default,
                                    help=help_text)
                continue
            base = _base_type(kind)
            parser.add_argument(flag, type=base, default=f.default,
                                help=f"{help_text} (default: {f.default})".strip())

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def _base_type(kind: Any) -> type:
    for t in (int, float, str):
        if kind is t or (getattr(kind, "__args__", None) and t in kind.__args__):
            return t
    raise TypeError(f"no CLI type for {kind}")
