"""What the scheduler reports: ``get_info`` (``/server_info``, metrics, loads), its log lines,
per-namespace cache counts, and the KV invariants checked when it goes idle."""

from __future__ import annotations

import logging
import time
from typing import Any

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.constrained import GrammarCompiler
from radixlm.runtime.cpu_threads import ThreadSizer
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.managers.scheduler.cache_manager import CacheManager
from radixlm.runtime.managers.scheduler.embedding_outputs import EmbeddingOutputs
from radixlm.runtime.managers.scheduler.pd_queues import DecodeQueues, PrefillQueues
from radixlm.runtime.managers.scheduler.schedule_batch import Req, ScheduleBatch
from radixlm.runtime.managers.scheduler.schedule_policy import PrefillAdder
from radixlm.runtime.managers.scheduler.speculative import Speculator
from radixlm.runtime.managers.validation import MAX_NAMESPACE_LABELS, namespace_label
from radixlm.runtime.openmp_env import wait_policy

logger = logging.getLogger(__name__)


class SchedulerReports:
    """Mixed into ``Scheduler``, which sets the state below in its ``__init__`` (and
    ``is_idle``); these methods read it and keep the counters of the log lines."""

    args: ServerArgs
    model_runner: ModelRunner
    cache: CacheManager
    grammar_compiler: GrammarCompiler
    embeddings: EmbeddingOutputs | None
    pd: PrefillQueues | DecodeQueues | None
    spec: Speculator | None
    threads: ThreadSizer
    on_cpu: bool
    context_len: int
    max_running_requests: int
    waiting: list[Req]
    grammar_waiting: list[Req]
    running: list[Req]
    chunked_req: Req | None
    stats: dict[str, float]
    namespace_stats: dict[str, list[int]]  # namespace label -> [prompt, cached] tokens
    decode_moments: list[float]
    weight_version: str
    gen_throughput: float
    _gen_tokens_at_log: float
    _last_log_time: float

    def _count_namespace(self, req: Req) -> None:
        label = namespace_label(req.namespace)
        if label not in self.namespace_stats and len(self.namespace_stats) >= MAX_NAMESPACE_LABELS:
            label = "other"
        counts = self.namespace_stats.setdefault(label, [0, 0])
        counts[0] += req.seq_len
        counts[1] += req.prefix_len


    def _time_step(self, batch: ScheduleBatch, decode: bool, seconds: float) -> None:
        """Busy time of prefill (and mixed) steps and their tokens; decode steps' moments."""
        step_us = int(seconds * 1e6)
        if not decode:
            self.stats["total_prefill_busy_us"] += step_us
            self.stats["total_prefill_uncached_tokens"] += batch.num_tokens
            return
        b, m = len(batch), self.decode_moments
        for i, x in enumerate((1, b, step_us, b * b, b * step_us, b)):
            m[i] += x

    def token_usage(self) -> float:
        return self.cache.used_size() / self.cache.pool_size

    def cache_hit_rate(self) -> float:
        return self.stats["cached_tokens"] / max(self.stats["prompt_tokens"], 1)

    def _log_prefill(self, adder: PrefillAdder) -> None:
        cached = sum(r.prefix_len for r in adder.reqs)
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: "
            "%.2f, #running-req: %d, #queue-req: %d", len(adder.reqs), sum(adder.extend_lens),
            cached, self.token_usage(), len(self.running), len(self.waiting))

    def _log_decode(self, batch_size: int) -> None:
        now = time.monotonic()
        gen = self.stats["generation_tokens"] - self._gen_tokens_at_log
        throughput = gen / max(now - self._last_log_time, 1e-9)
        self.gen_throughput = throughput
        self._gen_tokens_at_log, self._last_log_time = self.stats["generation_tokens"], now
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, cache hit rate: "
            "%.1f%%, gen throughput (token/s): %.2f, #queue-req: %d", batch_size,
            self.cache.used_size(), self.token_usage(), 100 * self.cache_hit_rate(),
            throughput, len(self.waiting))

    def get_info(self) -> dict[str, Any]:
        return {
            "max_total_num_tokens": self.cache.pool_size,
            "page_size": self.cache.page_size,
            "kv_cache_dtype": self.model_runner.kv_cache_dtype,  # "auto" resolved
            "prepacked_weight_bytes": self.model_runner.prepacked_weight_bytes,
            "context_length": self.context_len,
            "max_running_requests": self.max_running_requests,
            "num_running_reqs": len(self.running) + (self.chunked_req is not None),
            "num_waiting_reqs": len(self.waiting) + len(self.grammar_waiting),
            "num_queue_reqs": len(self.waiting),  # SGLang's split of the two
            "num_grammar_queue_reqs": len(self.grammar_waiting),
            "gen_throughput": self.gen_throughput,
            "evicted_tokens": self.cache.evicted_tokens,
            "grammar_cache_hits": self.grammar_compiler.cache_hits,
            "grammar_compile_time": self.grammar_compiler.compile_time.snapshot(),
            "num_waiting_tokens": sum(r.seq_len for r in (*self.waiting, *self.grammar_waiting)),
            "token_usage": self.token_usage(),
            "used_tokens": self.cache.used_size(),
            "free_tokens": self.cache.allocator.available_size(),
            "evictable_tokens": self.cache.tree.evictable_size(),
            "protected_tokens": self.cache.tree.protected_size(),
            "cache_hit_rate": self.cache_hit_rate(),
            "namespace_cache": {k: {"prompt_tokens": p, "cached_tokens": c}
                                for k, (p, c) in self.namespace_stats.items()},
            "weight_version": self.weight_version,
            # what /v1/loads reports beyond the above (SGLang's LoadSnapshot)
            "num_waiting_uncached_tokens": self.waiting_uncached_tokens(),
            "num_retracted_reqs": sum(r.num_retractions > 0 for r in self.waiting),
            "decode_moments": list(self.decode_moments),
            "weight_bytes": self.model_runner.weight_bytes,
            "kv_cache_bytes": self.model_runner.kv_pool_bytes,
            "graph_bytes": self.model_runner.graph_bytes,
            # a hybrid model's state pool (radix_cache/state_pool.py); 0 for other models
            "state_pool_slots": self.model_runner.state_pool_size,
            "free_state_slots": (0 if self.cache.states is None
                                 else self.cache.states.available_size()),
            "state_pool_bytes": (0 if self.model_runner.state_pool is None
                                 else self.model_runner.state_pool.nbytes),
            # of its slots, the radix tree's snapshots of cached prefixes' states (their
            # budget, held now, evicted since start: radix_cache/snapshot_tree.py)
            "snapshot_state_slots": self.cache.snapshot_slots,
            "state_snapshots": self.cache.tree.num_snapshots(),
            "evicted_state_snapshots": self.cache.tree.evicted_snapshots,
            "disaggregation_mode": self.args.disaggregation_mode,
            "pooling": (None if self.embeddings is None else  # --is-embedding
                        {"method": self.embeddings.config.method,
                         "normalize": self.embeddings.config.normalize}),
            "torch_threads": self.threads.threads if self.on_cpu else 0,  # on a CPU, now
            "omp_wait_policy": wait_policy(),
            **(self.pd.info() if self.pd is not None else {}),
            **(self._hicache_info()),
            **(self._spec_info()),
            **{k: int(v) for k, v in self.stats.items()},
        }

    def _hicache_info(self) -> dict[str, Any]:
        hicache = self.cache.hicache
        if hicache is None:
            return {}
        return {"hierarchical_cache": hicache.info(), **hicache.counters()}

    def _spec_info(self) -> dict[str, Any]:
        """--speculative-algorithm: SGLang's spec_accept_length, output tokens per request
        per decode forward (1.0: no draft accepted); the counts are in ``stats``."""
        if self.spec is None:
            return {}
        verified = self.stats["spec_verify_ct"]
        accepted = self.stats["spec_accepted_tokens"]
        return {"spec_accept_length": (verified + accepted) / verified if verified else 0.0}

    def waiting_uncached_tokens(self) -> int:
        """Tokens the waiting requests still have to compute: each one's beyond its cached
        prefix as last matched (the whole prompt before its first match), and the chunked
        request's rest."""
        waiting = sum(max(r.seq_len - r.prefix_len, 0)
                      for r in (*self.waiting, *self.grammar_waiting))
        chunked = self.chunked_req
        return waiting + (0 if chunked is None else max(chunked.seq_len - chunked.kv_len, 0))

    def check_idle_invariants(self, deep: bool = True) -> None:
        """The KV accounting of docs/design.md; run (cheaply, ``deep=False``) every time the
        scheduler becomes idle, and in full by tests and ``Engine.check_invariants``."""
        assert self.is_idle(), "invariants are checked only when idle"
        assert not self.cache.running, f"rows still held: {list(self.cache.running)}"
        assert self.cache.tree.protected_size() == 0, "locked nodes with no running request"
        self.cache.check_accounting(deep=deep)
