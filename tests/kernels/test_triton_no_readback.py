"""The Triton path never reads the batch layout back from the device inside a forward:
the model runner passes the extents it knows on the host (``Layout``), so a forward has no
host sync and is ready for CUDA graphs. On a CPU the check is a mock: the function that
reads the layout back raises, and the kernels and a whole engine still run (Triton's
interpreter), with the same tokens as the torch path."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from radixlm import kernels  # noqa: E402
from radixlm.kernels import reference  # noqa: E402
from radixlm.kernels.reference import Layout  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def refuse_readback(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the layout was read back from the device")

    monkeypatch.setattr(reference, "_read_layout", refuse)
    monkeypatch.setattr(reference, "DEBUG_KERNELS", False)


def test_kernels_take_the_host_layout(monkeypatch):
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, slots = 4, 2, 32, 64
    k_buf = torch.randn(slots, hkv, d, generator=gen).to(DEVICE)
    v_buf = torch.randn(slots, hkv, d, generator=gen).to(DEVICE)
    lens = [5, 9, 1]
    kv_indptr = torch.tensor([0, 5, 14, 15], device=DEVICE)
    kv_indices = torch.randperm(slots, generator=gen)[:15].to(DEVICE)
    q = torch.randn(3, hq, d, generator=gen).to(DEVICE)
    layout = Layout(3, 1, max(lens))
    ref = kernels.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.2,
                                   backend="torch")
    refuse_readback(monkeypatch)
    got = kernels.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.2,
                                   backend="triton", layout=layout)
    assert torch.allclose(got, ref, atol=1e-5)
    with pytest.raises(AssertionError, match="read back"):  # without a layout: a read
        kernels.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.2,
                                 backend="triton")


def test_engine_forward_never_reads_the_layout_back(make_engine, tiny_llama_dir, monkeypatch):
    pytest.importorskip("triton")
    prompts = ["The capital of France is", "Hello"]
    sp = {"max_new_tokens": 3, "temperature": 0}
    torch_eng = make_engine(model_path=str(tiny_llama_dir), attention_backend="torch",
                            max_total_tokens=1024)
    want = [o["output_ids"] for o in torch_eng.generate(prompts, sp)]
    triton_eng = make_engine(model_path=str(tiny_llama_dir), attention_backend="triton",
                             max_total_tokens=1024)
    refuse_readback(monkeypatch)
    assert [o["output_ids"] for o in triton_eng.generate(prompts, sp)] == want
