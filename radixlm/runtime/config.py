"""ServerArgs: every engine and server setting in one frozen dataclass.

CLI flags are generated from the fields (``radixlm/server_args_cli.py``, in groups by
topic), with SGLang's names where the concept is the same. Numbers derived from these settings and
the model (pool size, concurrency) are computed by the objects that own them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.config_checks import (  # noqa: F401 - the names callers import
    DISAGGREGATION_MODES,
    GRAMMAR_BACKENDS,
    KV_CACHE_DTYPES,
    LOAD_BALANCE_ALIASES,
    LOAD_BALANCE_METHODS,
    RADIX_EVICTION_POLICIES,
    SCHEDULE_POLICIES,
    SGLANG_KV_CACHE_DTYPES,
    SGLANG_TRANSFER_BACKENDS,
    TRANSFER_BACKENDS,
    check_server_args,
)
from radixlm.runtime.cpu_threads import cpu_budget
from radixlm.runtime.kv_events_config import KVEventsConfig


@dataclass(frozen=True)
class ServerArgs:
    # model
    model_path: str | None = field(default=None, metadata={"help": "local HF model directory "
                                   "or a .gguf file (default: the built-in tiny model)"})
    load_format: str = field(default="auto", metadata={
        "help": "auto|safetensors|gguf: auto reads a .gguf file as GGUF, a directory's "
                "safetensors otherwise"})
    tokenizer_path: str | None = field(default=None, metadata={"help": "default: model_path"})
    dtype: str = field(default="auto", metadata={
        "help": "auto|float32|float16|bfloat16; auto: the checkpoint's on a GPU, on a CPU bf16 "
                "where it has bf16 instructions, else float32"})
    device: str = field(default="auto", metadata={"help": "auto|cpu|cuda"})
    context_length: int | None = field(default=None, metadata={"help": "override the model's"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "|".join(KV_CACHE_DTYPES) + ": the KV pool's dtype (auto: the model's); fp8 "
                "is a plain cast, no scale"})
    torchao_config: str = field(default="", metadata={
        "help": "int8wo: weight-only int8 projections, quantized at load (SGLang's flag); "
                "empty: off"})
    quantization: str | None = field(default=None, metadata={
        "help": "the checkpoint's quantization (SGLang's names: awq, awq_marlin, gptq, "
                "gptq_marlin, fp8, compressed-tensors, w8a8_int8, w8a8_fp8, gguf); default: "
                "read from config.json's quantization_config"})
    is_embedding: bool = field(default=False, metadata={
        "help": "serve an embedding model: /v1/embeddings and /encode return pooled hidden "
                "states; generation routes answer 400"})
    # memory and cache
    page_size: int = field(default=1, metadata={"help": "tokens per KV page"})
    max_total_tokens: int | None = field(default=None, metadata={"help": "KV pool size in tokens"})
    kv_cache_memory_gb: float = field(default=1.0, metadata={
        "help": "KV pool memory on CPU when --max-total-tokens is not given"})
    mem_fraction_static: float = field(default=0.85, metadata={
        "help": "share of free GPU memory for the KV pool (CUDA)"})
    disable_radix_cache: bool = field(default=False, metadata={
        "help": "no prefix reuse: every prompt computed in full"})
    enable_hybrid_swa_memory: bool = field(default=False, metadata={
        "help": "sliding-window layers' K/V in a second, smaller pool, freed past each "
                "request's window (SGLang's SWA pool)"})
    disable_hybrid_swa_memory: bool = field(default=False, metadata={
        "help": "SGLang's flag: one pool for every layer (radixlm's default)"})
    swa_full_tokens_ratio: float = field(default=0.8, metadata={
        "help": "with --enable-hybrid-swa-memory: sliding-layer pool slots per full-layer "
                "pool slot, in (0, 1] (SGLang's flag and default)"})
    radix_eviction_policy: str = field(default="lru", metadata={
        "help": "lru|lfu: which radix-cache leaves are evicted first: least recently used, "
                "or fewest hits (ties: least recently used)"})
    # hierarchical cache (SGLang's flags; radix_cache/storage, managers/hicache.py)
    enable_hierarchical_cache: bool = field(default=False, metadata={
        "help": "a storage tier under the KV pool (--hicache-storage-*): evicted or cached "
                "pages written there and loaded instead of recomputed"})
    hicache_storage_backend: str | None = field(default=None, metadata={
        "help": "file (the one built in; SGLang's mooncake, hf3fs, nixl, aibrix, eic, "
                "lmcache are refused)"})
    hicache_storage_dir: str = field(default="~/.cache/radixlm/hicache", metadata={
        "help": "the file backend's directory (created 0700; share it between servers of "
                "one user to share pages)"})
    hicache_storage_size_gb: float = field(default=16.0, metadata={
        "help": "most GB of pages in --hicache-storage-dir; past it the least recently used "
                "pages are deleted"})
    hicache_write_policy: str = field(default="write_through", metadata={
        "help": "write_through (every cached page, as it is cached) | write_back (pages as "
                "the pool evicts them)"})
    hicache_storage_prefetch_policy: str = field(default="auto", metadata={
        "help": "how long a queued request waits for its stored pages: auto (while loading "
                "beats computing) | best_effort | wait_complete | timeout"})
    hicache_ratio: float | None = field(default=None, metadata={
        "help": "SGLang's host-memory tier (host pool / device pool): radixlm has none (on a "
                "CPU the pool is host memory); refused"})
    hicache_size: int | None = field(default=None, metadata={
        "help": "SGLang's host-memory tier size in GB: refused (see --hicache-ratio)"})
    # scheduling
    chunked_prefill_size: int = field(default=2048, metadata={"help": "max tokens per forward "
                                      "(prefill chunks); -1 disables chunking"})
    max_prefill_tokens: int = field(default=16384, metadata={"help": "max new prompt tokens "
                                    "admitted per prefill batch"})
    max_running_requests: int | None = field(default=None, metadata={
        "help": "most requests decoding at once (default: what the KV pool holds)"})
    max_queued_requests: int | None = field(default=None, metadata={
        "help": "503 beyond this many waiting requests (default: no limit)"})
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
    disable_mixed_chunk: bool = field(default=False, metadata={
        "help": "prefill chunks and decode steps in separate forwards"})
    attention_backend: str | None = field(default=None, metadata={"help": "torch|triton "
                                          "(default: triton on CUDA, torch on CPU)"})
    cuda_graph_max_bs: int | None = field(default=None, metadata={
        "help": "largest decode batch replayed from a CUDA graph (CUDA with the Triton "
                "path; default 160, fewer when the pool cannot hold that many requests)"})
    disable_cuda_graph: bool = field(default=False, metadata={
        "help": "run every decode forward eagerly (no CUDA graph capture at startup)"})
    disable_cpu_weight_prepack: bool = field(default=False, metadata={
        "help": "on a CPU, multiply by the dense weights instead of oneDNN-prepacked copies "
                "(which hold the weights a second time)"})
    disable_cpu_malloc_cache: bool = field(default=False, metadata={
        "help": "on a CPU (glibc), keep malloc's defaults: no reuse of a forward's activations "
                "by the next"})
    random_seed: int | None = field(default=None, metadata={
        "help": "seed of unseeded sampling (default: random)"})
    cpu_threads: int | None = field(default=None, metadata={
        "help": "torch CPU threads, fixed (default: the cores other processes leave free, "
                "measured every 2 s)"})
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
    grammar_step_budget_ms: float = field(default=50.0, metadata={
        "help": "CPU ms a request's grammar may take in one decode step (mask, advance, "
                "jump-forward); over it: 400; 0: none"})
    grammar_cache_size: int = field(default=256, metadata={
        "help": "compiled grammars kept (LRU)"})
    sampling_defaults: str = field(default="model", metadata={
        "help": "model|openai: unset sampling fields from the checkpoint's "
                "generation_config.json (model) or the API's defaults"})
    # chat: tool calls and reasoning (entrypoints/openai/)
    tool_call_parser: str | None = field(default=None, metadata={
        "help": "how the model writes tool calls: qwen25 (qwen, hermes), llama3, mistral, "
                "pythonic, gpt-oss; needed for tool_choice auto"})
    reasoning_parser: str | None = field(default=None, metadata={
        "help": "split the model's thinking into reasoning_content: qwen3, deepseek-r1, "
                "deepseek-v3, kimi, glm45, gpt-oss"})
    # server
    host: str = field(default="127.0.0.1", metadata={
        "help": "the address to listen on; 0.0.0.0 for every interface"})
    port: int = field(default=30000, metadata={"help": "the HTTP port"})
    api_key: str | None = field(default=None, metadata={
        "help": "the API key, or a file of 'key tenant' lines (each tenant has its own "
                "cache namespace and rids, and no admin rights)"})
    admin_api_key: str | None = field(default=None, metadata={
        "help": "the admin's key: weight updates, /flush_cache, abort_all, /metrics (without it"
                " the one --api-key key is the admin)"})
    weights_root: str | None = field(default=None, metadata={
        "help": "/update_weights_from_disk loads only directories under this one (symlinks "
                "and '..' resolved first); unset: any directory"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "the model's name in /v1/models and answers (default: the checkpoint's "
                "path; tenants see the directory's name)"})
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
    max_stored_responses: int = field(default=1024, metadata={
        "help": "most /v1/responses kept in memory, per tenant (each its own LRU); 0: none stored"})
    max_stored_response_bytes: int = field(default=256 << 20, metadata={
        "help": "most bytes one tenant's stored responses take in memory (each tenant its own "
                "LRU)"})
    tokenizer_metrics_allowed_custom_labels: tuple[str, ...] | None = field(
        default=None, metadata={"help": "label names requests may set on the request metrics "
                                "(custom_labels in /generate, the labels header on /v1)"})
    tokenizer_metrics_custom_labels_header: str = field(default="x-custom-labels", metadata={
        "help": "HTTP header of the OpenAI routes that carries custom labels as a JSON object"})
    watchdog_timeout: float = field(default=300.0, metadata={
        "help": "seconds the scheduler's loop may make no progress before the server fails "
                "its requests and exits (SGLang's --watchdog-timeout)"})
    # logging
    log_level: str = field(default="info", metadata={
        "help": "debug|info|warning|error"})
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
        "help": "JSON: publish the radix tree's KV events in vLLM's format on zmq, e.g. "
                "'{\"publisher\": \"zmq\"}' (vLLM's KVEventsConfig keys)"})
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
        "help": "data-parallel replicas: scheduler processes, each its own model copy and KV "
                "pool, behind one HTTP server"})
    base_gpu_id: int = field(default=0, metadata={
        "help": "the first GPU of the replicas (SGLang's flag)"})
    load_balance_method: str = field(default="cache_aware", metadata={
        "help": "cache_aware|round_robin|shortest_queue|minimum_tokens (and SGLang 0.5's "
                "names): how --dp-size replicas share requests"})
    cache_aware_balance_abs_threshold: int = field(default=2048, metadata={
        "help": "cache_aware: skip a replica more than this many tokens (and the relative "
                "threshold) above the least loaded"})
    cache_aware_balance_rel_threshold: float = field(default=1.5, metadata={
        "help": "cache_aware: see --cache-aware-balance-abs-threshold "
                "(sglang-router's --balance-rel-threshold)"})
    cache_aware_threshold: float = field(default=0.3, metadata={
        "help": "cache_aware: route by cache only to a replica holding more than this share of "
                "the prompt"})
    disaggregation_mode: str = field(default="null", metadata={
        "help": "null|prefill|decode: this server's side of prefill/decode disaggregation"})
    disaggregation_bootstrap_port: int = field(default=8998, metadata={
        "help": "prefill: its bootstrap service's port; decode: the port for a request whose "
                "bootstrap_port is null"})
    disaggregation_transfer_backend: str = field(default="zmq", metadata={
        "help": "how KV pages travel: zmq (TCP; SGLang's mooncake, nixl, ascend and mori "
                "need RDMA/NVLink libraries radixlm does not ship)"})
    disaggregation_secret_file: str | None = field(default=None, metadata={
        "help": "the key both PD servers share (mode 0600, 32-4096 bytes); required in PD modes"})
    disaggregation_trusted_hosts: tuple[str, ...] = field(default=(), metadata={
        "help": "decode server: the only bootstrap_host values a request may name (others "
                "get a 403 before anything connects); empty: any host, authenticated by "
                "the secret"})
    disaggregation_bootstrap_timeout: float = field(default=300.0, metadata={
        "help": "seconds a room may wait to be claimed, or for the bootstrap service, before "
                "its request fails"})
    disaggregation_waiting_timeout: float = field(default=300.0, metadata={
        "help": "seconds a claimed room may wait for its KV or acknowledgement before its "
                "request fails"})
    # speculative decoding (SGLang's flags; managers/scheduler/speculative.py)
    speculative_algorithm: str | None = field(default=None, metadata={
        "help": "NGRAM: greedy requests verify tokens drafted from their own prompt and "
                "output, several per forward (other requests decode one at a time); "
                "SGLang's STANDALONE, EAGLE, EAGLE3 and NEXTN are not supported yet"})
    speculative_draft_model_path: str | None = field(default=None, metadata={
        "help": "the draft model of STANDALONE / EAGLE (not supported yet; NGRAM has none)"})
    speculative_num_steps: int | None = field(default=None, metadata={
        "help": "draft tokens proposed per verification (with top-k 1: "
                "--speculative-num-draft-tokens minus 1)"})
    speculative_eagle_topk: int | None = field(default=None, metadata={
        "help": "branches per draft step: only 1 (a chain); a tree of drafts is not "
                "supported yet"})
    speculative_num_draft_tokens: int | None = field(default=None, metadata={
        "help": "tokens one verification forward takes per request: its last token and "
                "the drafts (default with NGRAM: --speculative-ngram-max-match-window-size, "
                "SGLang's)"})
    speculative_ngram_min_match_window_size: int = field(default=1, metadata={
        "help": "NGRAM: the shortest suffix of a request's tokens matched against its "
                "earlier tokens"})
    speculative_ngram_max_match_window_size: int = field(default=12, metadata={
        "help": "NGRAM: the longest suffix matched (the longest match wins)"})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_server_args(self)
        check_speculative(self)

    @property
    def balance_method(self) -> str:
        """``load_balance_method`` in radixlm's names (SGLang 0.5's mapped)."""
        return LOAD_BALANCE_ALIASES.get(self.load_balance_method, self.load_balance_method)

    def resolve_cpu_threads(self) -> int:
        """Torch threads for the scheduler on a CPU at start-up: ``cpu_threads``, else all
        cores of the budget (affinity, cgroup quota) but one; with ``dp_size`` replicas each
        gets its share (at least one). ``cpu_threads.ThreadSizer`` adjusts it later."""
        total = self.cpu_threads or max(cpu_budget() - 1, 1)
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


SPECULATIVE_ALGORITHMS = ("NGRAM",)
SGLANG_SPECULATIVE_ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3", "NEXTN")


def check_speculative(args: ServerArgs) -> None:
    """ValueError naming the speculative flag, or the flag it cannot run with, that is not
    supported: a setting is refused, never ignored."""
    algo = args.speculative_algorithm
    spec_flags = {name: getattr(args, name) for name in (
        "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
        "speculative_num_draft_tokens")}
    if algo is None:
        given = [k for k, v in spec_flags.items() if v is not None]
        if given:
            raise ValueError(f"{given[0]} (--{given[0].replace('_', '-')}) needs "
                             "--speculative-algorithm")
        return
    if algo in SGLANG_SPECULATIVE_ALGORITHMS:
        raise ValueError(f"speculative_algorithm (--speculative-algorithm) {algo} is not "
                         f"supported yet; supported: {', '.join(SPECULATIVE_ALGORITHMS)}")
    if algo not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"speculative_algorithm (--speculative-algorithm) must be one of "
                         f"{SPECULATIVE_ALGORITHMS + SGLANG_SPECULATIVE_ALGORITHMS}, got {algo!r}")
    _check_ngram(args)
    for name, on in (("is_embedding", args.is_embedding),
                     ("enable_hybrid_swa_memory", args.enable_hybrid_swa_memory),
                     ("tp_size", args.tp_size > 1),
                     ("disaggregation_mode", args.disaggregation_mode != "null")):
        if on:
            raise ValueError(f"speculative_algorithm NGRAM with {name} "
                             f"(--{name.replace('_', '-')}) is not supported yet")


def _check_ngram(args: ServerArgs) -> None:
    """NGRAM's numbers: a chain of drafts, no draft model."""
    if args.speculative_draft_model_path is not None:
        raise ValueError("speculative_draft_model_path (--speculative-draft-model-path): "
                         "NGRAM drafts from the request's own tokens and takes no draft model")
    topk = args.speculative_eagle_topk
    if topk is not None and topk != 1:
        raise ValueError(f"speculative_eagle_topk (--speculative-eagle-topk) {topk}: a tree "
                         "of drafts is not supported yet; only 1 (a chain)")
    steps, tokens = args.speculative_num_steps, args.speculative_num_draft_tokens
    if steps is not None and steps < 1:
        raise ValueError(f"speculative_num_steps must be >= 1, got {steps}")
    if tokens is not None and tokens < 2:
        raise ValueError(f"speculative_num_draft_tokens must be >= 2 (the last token and at "
                         f"least one draft), got {tokens}")
    if steps is not None and tokens is not None and tokens != steps + 1:
        raise ValueError(f"speculative_num_draft_tokens ({tokens}) must be "
                         f"speculative_num_steps + 1 ({steps + 1}) with a chain of drafts")
    lo, hi = (args.speculative_ngram_min_match_window_size,
              args.speculative_ngram_max_match_window_size)
    if not 1 <= lo <= hi:
        raise ValueError("speculative_ngram_min_match_window_size must be >= 1 and <= "
                         f"speculative_ngram_max_match_window_size, got {lo} and {hi}")
