"""ModelRunner: owns the model, the KV pool and the sampler; turns a ModelWorkerBatch into
one forward (``forward``: logits) and its next tokens (``forward_and_sample``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from radixlm.kernels import cpu_paged
from radixlm.radix_cache.kv_pool import (
    KVPool,
    SWAKVPool,
    kv_cache_dtype_name,
    kv_cache_torch_dtype,
)
from radixlm.radix_cache.state_pool import StatePool
from radixlm.radix_cache.swa_allocator import SWASpec
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.distributed.layers import (
    check_tp_split,
    kv_head_start,
    local_kv_heads,
    packed_layers,
    prepack_weights,
)
from radixlm.runtime.distributed.parallel_state import TpGroup, destroy_tp, init_tp
from radixlm.runtime.distributed.quantization import (
    dense_weight_bytes,
    dense_weights,
    quantize_weights,
    quantized_weight_bytes,
)
from radixlm.runtime.executor.batch_builder import ForwardBatchBuilder
from radixlm.runtime.executor.cuda_graph_runner import DEFAULT_MAX_BS, CudaGraphRunner
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.forward_heap import ForwardHeap, release_free_heap
from radixlm.runtime.executor.hybrid import (
    make_state_pool,
    refuse_hybrid_features,
    snapshot_state_slots,
    state_pool_slots,
)
from radixlm.runtime.executor.models import (
    build_model,
    decode_windows,
    get_model_class,
    state_specs,
)
from radixlm.runtime.executor.models.weights import (
    LoadTarget,
    config_differences,
    copy_weights,
    plan_load,
)
from radixlm.runtime.executor.quant.loader import load_checkpoint, quant_weight_bytes
from radixlm.runtime.executor.sampler import NextTokens, Sampler, SamplingBatch
from radixlm.runtime.executor.swa_pool import SWALayout, swa_pool_size
from radixlm.runtime.executor.tp_worker import (
    ShutdownStep,
    UpdateWeightsStep,
    forward_step,
    read_kv,
    send_step,
    write_kv,
)
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch
from radixlm.runtime.model_config import ModelConfig

logger = logging.getLogger(__name__)

# a CPU default: enough for hundreds of concurrent requests of a small model
MAX_DEFAULT_POOL_TOKENS = 1 << 17
DEFAULT_MAX_RUNNING_REQUESTS = 256


def max_running_requests(args: ServerArgs, pool_size: int) -> int:
    """--max-running-requests, else one request per 8 pool tokens, at most 256."""
    return args.max_running_requests or min(DEFAULT_MAX_RUNNING_REQUESTS,
                                            max(pool_size // 8, 1))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class ModelRunner:
    def __init__(self, args: ServerArgs, model_path: str, tp_rank: int = 0) -> None:
        self.device = resolve_device(args.device)
        self.is_embedding = args.is_embedding  # forward returns pooled models' hidden states
        self.model_config = ModelConfig.from_hf(model_path, dtype=args.dtype,
                                                context_length=args.context_length)
        refuse_hybrid_features(args, self.model_config)
        self.tp = self._init_tp(args, tp_rank)
        self.tp_broken = False
        self.dtype = self.model_config.resolve_dtype(self.device)
        if args.dtype == "auto":
            logger.info("dtype auto: a %s checkpoint, served in %s on %s (CPU: bfloat16 "
                        "for bfloat16 checkpoints where it has bf16 instructions)",
                        self.model_config.torch_dtype, self.dtype, self.device.type)
        self.kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, self.dtype)  # the pool's
        self.attention_backend = args.attention_backend
        if (self.attention_backend == "triton" and self.device.type != "cuda"
                and os.environ.get("TRITON_INTERPRET") != "1"):
            raise ValueError("attention_backend 'triton' needs a CUDA device (on a CPU, set "
                             "TRITON_INTERPRET=1 to run the kernels in Triton's interpreter)")
        if args.random_seed is not None:
            torch.manual_seed(args.random_seed)
        # an embedding model never reads its LM head: its checkpoint may have none
        self.optional_weights = ("lm_head.weight",) if self.is_embedding else ()
        self.model = build_model(self.model_config, self.device, self.tp)
        # a quantized checkpoint's linears stay quantized (executor/quant/)
        self.quant_kinds = load_checkpoint(self.model, self.model_config, model_path,
                                           self.optional_weights, args.quantization)
        self.model.eval()
        if self.quant_kinds:
            logger.info("quantized checkpoint: %s linear weights, %.3f GiB with the kernels' "
                        "packed copies", dict(self.quant_kinds),
                        quant_weight_bytes(self.model) / (1 << 30))
        # the torch path: sliding windows whose layers decode over a truncated layout
        # (ForwardBatch.window_views); the Triton kernels take the window themselves
        self.decode_windows = decode_windows(self.model) if self.uses_torch_attention else []
        if args.torchao_config:  # "int8wo", the one value config_checks lets through
            n = quantize_weights(self.model)
            logger.info("--torchao-config int8wo: %d projections multiply by int8 weights, "
                        "%.3f GiB (dense: %.3f GiB)", n, quantized_weight_bytes(self.model)
                        / (1 << 30), dense_weight_bytes(self.model) / (1 << 30))
        self.prepack = not args.disable_cpu_weight_prepack
        prepack_weights(self.model, self.prepack)
        if self.device.type == "cpu":
            release_free_heap()  # what loading freed (dense buffers, conversions)
        # --enable-hybrid-swa-memory: the sliding layers' K/V in a pool of their own
        self.swa = SWALayout.of(self.model) if args.enable_hybrid_swa_memory else None
        self.swa_ratio = args.swa_full_tokens_ratio
        if args.enable_hybrid_swa_memory and self.swa is None:
            logger.info("--enable-hybrid-swa-memory: the model has no sliding layers; one pool")
        self.pool_size = self._pool_size(args)
        self.swa_pool_size = (0 if self.swa is None else swa_pool_size(
            self.pool_size, self.swa_ratio, self.swa.window, args.page_size))
        self.kv_pool = self._make_pool()
        # a hybrid model: a state slot per request row the scheduler hands out (hybrid.py)
        # and as many again for the radix tree's snapshots of cached prefixes' states
        specs = state_specs(self.model)
        self.request_state_slots = self.snapshot_state_slots = 0
        self.state_pool = None
        if specs:
            per_slot, explicit = StatePool.bytes_per_slot(specs, self.dtype), bool(
                args.max_running_requests)
            self.request_state_slots = state_pool_slots(
                max_running_requests(args, self.pool_size) + 1, explicit, self.kv_pool_bytes,
                per_slot)
            self.snapshot_state_slots = snapshot_state_slots(
                self.request_state_slots, explicit, self.kv_pool_bytes, per_slot,
                not args.disable_radix_cache)
            self.state_pool = make_state_pool(
                specs, self.request_state_slots + self.snapshot_state_slots, self.dtype,
                self.device)
        logger.info("KV pool: %d tokens, %s K/V (%.2f GiB), model dtype %s", self.pool_size,
                    self.kv_cache_dtype, self.kv_pool_bytes / (1 << 30),
                    kv_cache_dtype_name(self.dtype))
        if self.swa is not None:
            logger.info("SWA pool: layers %s (window %d) in %d slots, the other %d layers in "
                        "%d", list(self.swa.swa_layers), self.swa.window, self.swa_pool_size,
                        self.swa.num_layers - len(self.swa.swa_layers), self.pool_size)
        if self.prepacked_layers:
            logger.info("%d linear layers multiply by prepacked weights (oneDNN's layout, "
                        "or fma_linear's panels), %.2f GiB besides the dense ones "
                        "(--disable-cpu-weight-prepack: dense only)",
                        self.prepacked_layers, self.prepacked_weight_bytes / (1 << 30))
        # made last: the weights and the pool are mapped as glibc decides (forward_heap.py)
        self.heap = ForwardHeap(self.device.type == "cpu" and not args.disable_cpu_malloc_cache)
        self.batch_builder = ForwardBatchBuilder(
            self.device, self.kv_pool, self.attention_backend, self.dtype, self.decode_windows,
            self.uses_torch_attention, self.paged_kernel, self.amx_attention, self.state_pool)
        self.graph_runner = self._capture_cuda_graphs(args)
        self.sampler = Sampler(self.model_config.vocab_size, self.device, args.random_seed)

    def _make_pool(self) -> KVPool | SWAKVPool:
        """One slot more than the allocator hands out: padding rows of CUDA-graph replays
        write and read only that one (cuda_graph_runner.py)."""
        cfg = self.model_config
        heads = local_kv_heads(cfg, self.tp.size)
        if self.swa is None:
            return KVPool(self.pool_size + 1, cfg.kv_layers, heads, cfg.head_dim,
                          self.kv_dtype, self.device)
        return SWAKVPool(self.pool_size, self.swa_pool_size, list(self.swa.swa_layers),
                         cfg.num_layers, heads, cfg.head_dim, self.kv_dtype, self.device)

    @property
    def state_pool_size(self) -> int:
        """State slots of a hybrid model (0: none, a model of attention layers only)."""
        return 0 if self.state_pool is None else self.state_pool.size

    def swa_spec(self) -> SWASpec | None:
        """The SWA pool as the cache manager's allocator needs it (None: one pool)."""
        if self.swa is None:
            return None
        assert isinstance(self.kv_pool, SWAKVPool)
        return SWASpec(self.swa_pool_size, self.swa.window, self.kv_pool.full_to_swa)

    def _init_tp(self, args: ServerArgs, tp_rank: int) -> TpGroup:
        """Join this replica's tensor-parallel group (rank ``tp_rank`` of ``args.tp_size``;
        on CUDA, rank r of a machine uses the r-th GPU from ``args.device``'s)."""
        if args.tp_size == 1:
            return TpGroup()
        check_tp_split(self.model_config, args.tp_size)
        if self.device.type == "cuda":
            local = tp_rank % (args.tp_size // args.nnodes)
            self.device = torch.device("cuda", (self.device.index or 0) + local)
            torch.cuda.set_device(self.device)
        assert args.dist_init_addr is not None, "start_tp_ranks sets dist_init_addr"
        return init_tp(tp_rank, args.tp_size, args.dist_init_addr, self.device,
                       args.dist_timeout)

    @property
    def uses_torch_attention(self) -> bool:
        """Whether attention runs in the torch path (which can use shared-prefix groups)."""
        if self.attention_backend is None:
            return self.device.type != "cuda"
        return self.attention_backend == "torch"

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer, in the pool's dtype (this rank's heads);
        with the SWA pool, what one full slot costs with its share of sliding slots."""
        cfg = self.model_config
        heads = local_kv_heads(cfg, self.tp.size)
        if self.swa is None:
            return KVPool.bytes_per_token(cfg.kv_layers, heads, cfg.head_dim, self.kv_dtype)
        full, swa = self.swa.bytes_per_token(heads, cfg.head_dim, self.kv_dtype)
        return full + int(swa * self.swa_ratio)

    @property
    def prepacked_layers(self) -> int:
        """Layers multiplying by a prepacked weight copy (0 with --disable-cpu-weight-prepack,
        or where oneDNN cannot pack)."""
        return len(packed_layers(self.model))

    @property
    def prepacked_weight_bytes(self) -> int:
        """Memory of the prepacked weight copies, besides the dense weights."""
        return sum(m.packed_nbytes() for m in packed_layers(self.model))

    @property
    def kv_pool_bytes(self) -> int:
        if self.swa is None:
            return self.pool_size * self.kv_bytes_per_token
        cfg = self.model_config
        full, swa = self.swa.bytes_per_token(local_kv_heads(cfg, self.tp.size), cfg.head_dim,
                                             self.kv_dtype)
        return self.pool_size * full + self.swa_pool_size * swa

    @property
    def weight_bytes(self) -> int:
        """This rank's weights: parameters and buffers (a tied tensor once; not the
        ``meta`` placeholders of int8 layers), the int8 weights and the prepacked copies."""
        tensors = {id(t): t for t in (*self.model.parameters(), *self.model.buffers())
                   if not t.is_meta}
        return (sum(t.nbytes for t in tensors.values()) + quantized_weight_bytes(self.model)
                + self.prepacked_weight_bytes)

    @property
    def graph_bytes(self) -> int:
        """Memory the decode CUDA graphs took (0 without them)."""
        return 0 if self.graph_runner is None else self.graph_runner.memory_bytes

    @property
    def kv_cache_dtype(self) -> str:
        """The pool's dtype as --kv-cache-dtype spells it ("auto" resolved)."""
        return kv_cache_dtype_name(self.kv_dtype)

    def _pool_size(self, args: ServerArgs) -> int:
        per_token = self.kv_bytes_per_token
        if args.max_total_tokens is not None:
            size = args.max_total_tokens
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            size = int(free * args.mem_fraction_static) // per_token
        else:
            size = min(int(args.kv_cache_memory_gb * (1 << 30)) // per_token,
                       MAX_DEFAULT_POOL_TOKENS)
        size = self.tp.all_reduce_min(size)  # every rank's pool has rank 0's layout
        size -= size % args.page_size
        if size < 2 * args.page_size:
            raise ValueError(f"KV pool too small: {size} tokens (page_size {args.page_size})")
        return size

    @property
    def paged_kernel(self) -> bool:
        """Whether decode attention runs in the compiled CPU kernel (K/V read in place, in
        any of its pool dtypes; float8_e4m3 pools take the torch path). A bfloat16 or
        float16 model's q is widened to float32 for it (``planned_attention``), unless
        ``amx_attention``."""
        return (self.device.type == "cpu" and self.kv_dtype in cpu_paged.KV_DTYPES
                and cpu_paged.available())

    @property
    def amx_attention(self) -> bool:
        """Whether the kernel multiplies a bfloat16 model's attention on AMX tiles (bf16
        q over a bf16 pool, a CPU with AMX-BF16): every extend chunk then takes it."""
        return (self.paged_kernel and self.dtype == torch.bfloat16
                and self.kv_dtype == torch.bfloat16 and cpu_paged.amx())

    @torch.inference_mode()
    def forward(self, batch: ModelWorkerBatch, req_to_token: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] float32 for the rows named by ``batch.logit_ranges`` (on a
        tensor-parallel rank other than 0: ``[rows, 0]``); with ``--is-embedding`` the
        final hidden states of those rows instead, [rows, hidden] (every rank)."""
        if batch.state_restores:  # cached prefixes' states into the requests' slots
            self._copy_states(batch.state_restores)  # (each rank its own heads' states)
        if self.tp.size > 1:
            return self._tp_forward(batch, req_to_token)
        fb = self.batch_builder.build(batch, req_to_token)
        if batch.is_decode and self.graph_runner is not None and not self.is_embedding:
            nnz = sum(batch.prefix_lens) + len(batch)
            if self.graph_runner.can_run(len(batch), nnz):
                return self.graph_runner.replay(fb, nnz)
        return self._run_and_snapshot(fb)

    def _run_and_snapshot(self, fb: ForwardBatch) -> torch.Tensor:
        """The model over ``fb``, then the snapshots at its sequences' ends (on every rank:
        each holds its heads' states)."""
        out = self._run_model(fb)
        if fb.state is not None and fb.state.saves_at_end:  # snapshots at a sequence's end
            self._copy_states(fb.state.saves_at_end)
        return out

    @property
    def inner_snapshots(self) -> bool:
        """Whether the model writes states inside an extend (``StateIndices.saves``); a
        hybrid without it snapshots only at the end of a forward's sequences."""
        return bool(getattr(self.model, "inner_state_snapshots", False))

    def _copy_states(self, pairs: list[list[int]]) -> None:
        """``[src, dst]`` state slots: every linear layer's states copied."""
        assert self.state_pool is not None, "state copies without a state pool"
        t = torch.tensor(pairs, dtype=torch.int64, device=self.device)  # [n, 2]
        self.state_pool.copy(t[:, 0], t[:, 1])

    @torch.inference_mode()
    def forward_and_sample(self, batch: ModelWorkerBatch, req_to_token: torch.Tensor
                           ) -> tuple[torch.Tensor, NextTokens | None]:
        """``forward``, then the next tokens of ``batch.sampling``'s rows with the logprobs
        asked for (prompt logprobs too; rank 0 of a tensor-parallel group: the other ranks
        only run ``forward``). Returns what ``forward`` returned and the tokens (None
        without ``batch.sampling``: an embedding forward, or one where no row samples)."""
        logits = self.forward(batch, req_to_token)
        sampling: SamplingBatch | None = batch.sampling
        return logits, None if sampling is None else self.sampler.sample(logits, sampling)

    def _run_model(self, fb: ForwardBatch) -> torch.Tensor:
        with self.heap:  # on a CPU, its activations from the heap the last one left
            return self.model.hidden_states(fb) if self.is_embedding else self.model(fb)

    def _tp_forward(self, batch: ModelWorkerBatch, req_to_token: torch.Tensor) -> torch.Tensor:
        """Rank 0 first tells the others."""
        def run() -> torch.Tensor:
            if self.tp.is_first:
                send_step(self.tp, forward_step(batch, req_to_token))
            return self._run_and_snapshot(self.batch_builder.build(batch, req_to_token))
        return self._collective(run)

    def read_kv(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """Rank 0 of a tensor-parallel group: the K/V rows at ``slots`` with every KV head
        (each rank holds a shard), for a PD transfer (``tp_worker.read_kv``)."""
        return self._collective(read_kv, self, self._kv_head_starts(), slots)

    def write_kv(self, slots: torch.Tensor, frames: list[torch.Tensor]) -> None:
        """Rank 0: write every-head K/V rows at ``slots``, each rank its heads."""
        self._collective(write_kv, self, self._kv_head_starts(), slots, frames)

    def _kv_head_starts(self) -> list[int]:
        return [kv_head_start(self.model_config, self.tp.size, r) for r in range(self.tp.size)]

    def _collective(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, which talks to the other ranks. A collective that fails (a rank
        died, or hung past --dist-timeout) breaks the group for good (``tp_broken``)."""
        try:
            return fn(*args)
        except RuntimeError as e:
            self.tp_broken = True
            raise RuntimeError(
                f"tensor-parallel rank {self.tp.rank} of {self.tp.size}: a collective failed "
                f"({e}); another rank died or did not answer within --dist-timeout "
                f"({self.tp.timeout_s:g} s)") from None

    def _capture_cuda_graphs(self, args: ServerArgs,
                             graph_factory=None) -> CudaGraphRunner | None:
        """Decode CUDA graphs, on CUDA with the Triton path unless --disable-cuda-graph
        (mixture-of-experts models too: the Triton path runs their experts in the fused-MoE
        kernel, which reads nothing back to the host)."""
        if self.state_pool is not None:  # the states' gather / scatter are not captured
            return None
        if self.swa is not None and self.device.type == "cuda":
            # the graphs' index buffers hold full slots; the sliding layers' translation
            # is not captured yet
            logger.info("decode CUDA graphs off with --enable-hybrid-swa-memory")
            return None
        if (args.disable_cuda_graph or self.uses_torch_attention or self.tp.size > 1
                or (self.device.type != "cuda" and graph_factory is None)):
            return None
        max_bs = min(args.cuda_graph_max_bs or DEFAULT_MAX_BS, self.pool_size)
        with torch.inference_mode():
            return CudaGraphRunner(self.model, self.kv_pool, self.attention_backend, max_bs,
                                   self.model_config.context_length, self.pool_size,
                                   self.device, graph_factory)

    # --- weight updates (the scheduler calls these between steps) -------------------------
    def check_weights(self, model_path: str) -> dict[str, tuple[LoadTarget, ...]]:
        """Check ``model_path`` against the served model from config.json and the
        safetensors headers, reading no weights: ValueError naming what differs (a config
        field, or missing / unexpected / misshapen tensors). Returns ``plan_load``'s targets."""
        path = Path(model_path)
        if self.quant_kinds:
            raise ValueError("the served checkpoint is quantized: weight updates from disk "
                             "load float safetensors checkpoints only")
        if not path.is_dir():
            raise ValueError(f"model_path {model_path!r} is not a directory")
        try:
            new = ModelConfig.from_hf(path)
            diffs = config_differences(self.model_config, new)
            spec = get_model_class(new.architectures).spec_for(new)
            if not diffs and spec != self.model.spec:  # a family's own config.json fields
                diffs = [f"the {type(self.model).__name__} options: {self.model.spec} -> {spec}"]
            if diffs:
                raise ValueError(f"the checkpoint in {model_path} has another shape than the "
                                 f"served model: {'; '.join(diffs)}")
            return plan_load(self.model, path, self.optional_weights)
        except (OSError, KeyError, TypeError, json.JSONDecodeError, SafetensorError) as e:
            raise ValueError(f"cannot read the checkpoint in {model_path}: {e!r}") from None

    def update_weights_from_disk(self, model_path: str) -> None:
        """Copy the weights of ``model_path`` into the existing parameters, after
        ``check_weights`` (nothing is touched if it fails). A read error half-way reloads
        the previous checkpoint and raises ValueError. The KV pool is not touched: the
        caller must drop every cached KV computed by the old weights."""
        targets = self.check_weights(model_path)
        if self.tp.size > 1 and self.tp.is_first:
            send_step(self.tp, UpdateWeightsStep(model_path))
        previous = self.model_config.model_dir
        try:
            with dense_weights(self.model) as quantized:  # int8 layers: quantized on exit
                if quantized:  # the targets were the meta placeholders
                    targets = plan_load(self.model, model_path, self.optional_weights)
                self._copy_or_reload(targets, model_path, previous)
        finally:  # the packed copies are of the weights that were there before
            prepack_weights(self.model, self.prepack)
        self.model_config = dataclasses.replace(self.model_config, model_dir=Path(model_path))

    def _copy_or_reload(self, targets: dict[str, tuple[LoadTarget, ...]], model_path: str,
                        previous: Path) -> None:
        """Copy ``model_path`` into ``targets``; a failure half-way reloads ``previous``
        and raises ValueError."""
        try:
            copy_weights(targets, model_path)
        except Exception as e:  # noqa: BLE001 - put the previous weights back, then report
            logger.exception("loading %s failed half-way; reloading %s", model_path, previous)
            copy_weights(plan_load(self.model, previous, self.optional_weights), previous)
            raise ValueError(f"reading the weights in {model_path} failed ({e!r}); the "
                             f"previous weights ({previous}) were reloaded") from None

    def shutdown_tp(self, notify: bool = True) -> None:
        """Leave the tensor-parallel group; rank 0 first tells the other ranks to stop
        (unless ``notify`` is false: the group is broken)."""
        if self.tp.size > 1:
            if self.tp.is_first and notify and not self.tp_broken:
                send_step(self.tp, ShutdownStep())
            destroy_tp()
            self.tp = TpGroup()
