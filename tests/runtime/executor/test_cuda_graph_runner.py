"""Decode through CUDA-graph replay: static buffers, padding rows and batch-size buckets.

Without CUDA the capture mechanism is replaced by an eager one (``EagerGraph``: capture
runs the function once and keeps its output tensor; replay runs it again into that same
tensor), so everything the runner does around the graph runs here: the forward reads only
the static buffers, padding rows touch only the pad slot, and logits equal the eager
decode's. With CUDA the real graphs are checked the same way. The Triton path runs in its
interpreter on a CPU, and must never read the layout back (capture forbids host syncs)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from radixlm.kernels import reference  # noqa: E402
from radixlm.runtime.config import ServerArgs  # noqa: E402
from radixlm.runtime.executor.cuda_graph_runner import capture_batch_sizes  # noqa: E402
from radixlm.runtime.executor.model_runner import ModelRunner  # noqa: E402
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch  # noqa: E402

CUDA = torch.cuda.is_available()


class EagerGraph:
    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self):
        self.out.copy_(self.fn())


def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(6) == [1, 2, 4, 6]
    assert capture_batch_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert capture_batch_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    sizes = capture_batch_sizes(160)
    assert sizes[-1] == 160 and all(b - a <= 8 for a, b in zip(sizes, sizes[1:]))


def _runner(model_dir, **kw) -> ModelRunner:
    args = ServerArgs(model_path=str(model_dir), attention_backend="triton",
                      max_total_tokens=256, device="cuda" if CUDA else "cpu", **kw)
    return ModelRunner(args, str(model_dir))


def _decode_batch(runner, lens, gen):
    """Sequences of ``lens`` cached tokens (random K/V), each decoding one token."""
    b, width = len(lens), max(lens) + 1
    slots = torch.randperm(runner.pool_size, generator=gen)[: b * width].view(b, width)
    batch = ModelWorkerBatch(
        is_decode=True, req_pool_indices=list(range(b)), prefix_lens=list(lens),
        extend_lens=[1] * b, input_ids=torch.randint(0, 100, (b,), generator=gen).tolist(),
        logit_ranges=[(0, 1)] * b)
    return batch, slots.to(runner.device)


@pytest.mark.skipif(not CUDA and pytest.importorskip("triton") is None, reason="no triton")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_replay_equals_eager_decode_and_padding_touches_only_its_slot(tiny_llama_dir,
                                                                      monkeypatch,
                                                                      kv_cache_dtype):
    runner = _runner(tiny_llama_dir, cuda_graph_max_bs=4, kv_cache_dtype=kv_cache_dtype)
    assert runner.kv_pool.k_buffers[0].dtype == runner.kv_dtype
    if not CUDA:  # the eager stand-in for capture, through the same entry point
        assert runner.graph_runner is None
        runner.graph_runner = runner._capture_cuda_graphs(
            ServerArgs(cuda_graph_max_bs=4), graph_factory=EagerGraph)
    gr = runner.graph_runner
    assert gr.batch_sizes == [1, 2, 4] and gr.pad_slot == runner.pool_size
    gen = torch.Generator().manual_seed(0)
    pool = runner.kv_pool
    for layer in range(pool.num_layers):
        for buf in pool.get_kv_buffer(layer):
            buf.copy_(torch.randn(buf.shape, generator=gen))
    monkeypatch.setattr(reference, "_read_layout", _refuse)  # no host sync in a replay
    for lens in ([5], [3, 17], [9, 1, 30]):  # 3 sequences run in the graph of 4
        batch, req_to_token = _decode_batch(runner, lens, gen)
        before = [t.clone() for layer in range(pool.num_layers)
                  for t in pool.get_kv_buffer(layer)]
        fb = runner.batch_builder.build(batch, req_to_token)
        eager = runner.model(fb)
        after_eager = [t.clone() for layer in range(pool.num_layers)
                       for t in pool.get_kv_buffer(layer)]
        for layer in range(pool.num_layers):  # the pool as before, then replay
            k, v = pool.get_kv_buffer(layer)
            k.copy_(before[2 * layer])
            v.copy_(before[2 * layer + 1])
        replayed = runner.forward(batch, req_to_token)
        assert replayed.shape == eager.shape
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
        after = [t for layer in range(pool.num_layers) for t in pool.get_kv_buffer(layer)]
        for got, want in zip(after, after_eager):  # every slot but the pad slot as eager
            torch.testing.assert_close(got[: runner.pool_size].float(),
                                       want[: runner.pool_size].float())


def _refuse(*args, **kwargs):
    raise AssertionError("the layout was read back from the device")


def test_graphs_only_where_they_apply(tiny_llama_dir):
    # the torch path (every CPU default) and --disable-cuda-graph capture nothing
    args = ServerArgs(model_path=str(tiny_llama_dir), max_total_tokens=256, device="cpu")
    assert ModelRunner(args, str(tiny_llama_dir)).graph_runner is None
    runner = _runner(tiny_llama_dir, disable_cuda_graph=True)
    assert runner.graph_runner is None
    assert runner._capture_cuda_graphs(ServerArgs(disable_cuda_graph=True),
                                       graph_factory=EagerGraph) is None


@pytest.mark.skipif(not CUDA and pytest.importorskip("triton") is None, reason="no triton")
@pytest.mark.parametrize("arch", ["mistral", "gemma2", "mixtral", "qwen3_moe"])
def test_windowed_soft_capped_and_moe_layers_replay_like_eager(family_dirs, monkeypatch, arch):
    """The Triton kernels take sliding windows and soft-caps themselves, and run the experts
    of MoE models in the fused-MoE kernel: such models decode in graphs too, with no host
    sync (nothing read back: no ``.tolist()`` / ``.item()``, which the torch path's expert
    grouping calls), equal to eager decode and to the torch path."""
    runner = _runner(family_dirs[arch], cuda_graph_max_bs=4)
    assert runner.decode_windows == []  # no window views: the window is in the kernel
    if not CUDA:
        runner.graph_runner = runner._capture_cuda_graphs(
            ServerArgs(cuda_graph_max_bs=4), graph_factory=EagerGraph)
    assert runner.graph_runner is not None
    gen = torch.Generator().manual_seed(0)
    pool = runner.kv_pool
    for layer in range(pool.num_layers):
        for buf in pool.get_kv_buffer(layer):
            buf.copy_(torch.randn(buf.shape, generator=gen))
    for lens in ([5], [30, 40], [9, 1, 50]):  # past the 24-token windows
        batch, req_to_token = _decode_batch(runner, lens, gen)
        fb = runner.batch_builder.build(batch, req_to_token)
        with monkeypatch.context() as m:
            m.setattr(reference, "_read_layout", _refuse)  # no host sync in a replay
            m.setattr(torch.Tensor, "tolist", _refuse)
            m.setattr(torch.Tensor, "item", _refuse)
            eager = runner.model(fb)
            replayed = runner.forward(batch, req_to_token)
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
        fb.attention_backend, fb.attention_plan = "torch", None  # the masked torch path
        torch.testing.assert_close(runner.model(fb), eager, rtol=1e-4, atol=1e-4)


def test_batches_beyond_the_graphs_run_eagerly(tiny_llama_dir):
    runner = _runner(tiny_llama_dir, cuda_graph_max_bs=2)
    if not CUDA:
        runner.graph_runner = runner._capture_cuda_graphs(
            ServerArgs(cuda_graph_max_bs=2), graph_factory=EagerGraph)
    gr = runner.graph_runner
    assert gr.can_run(2, 10) and not gr.can_run(3, 10)
    assert not gr.can_run(1, gr.kv_indices.numel())
    calls = []
    gr.replay = lambda fb, nnz: calls.append(fb.batch_size)
    gen = torch.Generator().manual_seed(1)
    batch, req_to_token = _decode_batch(runner, [4, 5, 6], gen)
    logits = runner.forward(batch, req_to_token)  # 3 > 2: eager
    assert calls == [] and logits.shape[0] == 3
