"""GPU check and timing of the Triton kernels (one command, about 3 minutes on an H200).

    python benchmarks/kernels_gpu.py [--quick]

1. Correctness: every Triton kernel against the torch reference on the GPU.
2. Decode attention: batch 1..256 x context 512..32k, Hq=32 Hkv=4 (GQA 8:1), D=128, bf16.
3. Extend attention: prefix 0..8k, 512 new tokens per sequence.
Times are ``triton.testing.do_bench`` medians; bandwidth is the bytes the kernel must
move (K/V read once, q/o) divided by the time, beside a device-to-device copy measured
in the same run. Target: decode at batch 64 x 4k context >= 70% of copy bandwidth.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import triton
import triton.testing

from radixlm import kernels

HQ, HKV, D, DTYPE = 32, 4, 128, torch.bfloat16
KV_LIMIT_BYTES = 40e9
TARGET = 0.70


def _ragged(lens: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """kv_indptr and kv_indices for ``lens``, slots on shuffled pages of 16 tokens."""
    total = sum(lens)
    pages = torch.randperm((total + 15) // 16 + len(lens), device=device)
    slots = (pages[:, None] * 16 + torch.arange(16, device=device)).reshape(-1)
    indptr = torch.tensor([0] + lens, device=device).cumsum(0)
    return indptr, slots[:total].contiguous(), slots.numel()


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def check_correctness() -> bool:
    """Each kernel vs the reference; returns True if all pass."""
    torch.manual_seed(0)
    dev = "cuda"
    ok = True

    def report(name: str, err: float, tol: float) -> None:
        nonlocal ok
        ok &= err < tol
        print(f"  {name:44} rel err {err:.2e}  {'ok' if err < tol else 'FAIL'}")

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 1e-2)):
        for d, hkv, group in ((64, 2, 1), (128, 4, 8), (256, 2, 4), (32, 2, 2)):
            lens = [1, 17, 4000, 100, 40]
            indptr, indices, slots = _ragged(lens, dev)
            kb = torch.randn(slots, hkv, d, device=dev, dtype=dtype)
            vb = torch.randn_like(kb)
            q = torch.randn(len(lens), hkv * group, d, device=dev, dtype=dtype)
            args = (q, kb, vb, indptr, indices, d**-0.5)
            o = kernels.decode_attention(*args, backend="triton")
            ref = kernels.decode_attention(*args, backend="torch")
            report(f"decode {dtype} D={d} G={group}", _rel(o, ref), tol)
            q_lens, prefix = [1, 300, 5, 64], [0, 700, 4000, 3]
            qo = torch.tensor([0] + q_lens, device=dev).cumsum(0)
            kv, idx, _ = _ragged(prefix, dev)
            n = sum(q_lens)
            q = torch.randn(n, hkv * group, d, device=dev, dtype=dtype)
            k = torch.randn(n, hkv, d, device=dev, dtype=dtype)
            v = torch.randn_like(k)
            eargs = (q, k, v, kb, vb, qo, kv, idx, d**-0.5)
            o = kernels.extend_attention(*eargs, backend="triton")
            ref = kernels.extend_attention(*eargs, backend="torch")
            report(f"extend {dtype} D={d} G={group}", _rel(o, ref), tol)
        x, r = torch.randn(33, 4096, device=dev, dtype=dtype), torch.randn(33, 4096, device=dev)
        w = torch.randn(4096, device=dev, dtype=dtype)
        a, ra = kernels.rms_norm(x, w, 1e-6, r.to(dtype), backend="triton")
        b, rb = kernels.rms_norm(x, w, 1e-6, r.to(dtype), backend="torch")
        report(f"rms_norm+residual {dtype}", max(_rel(a, b), _rel(ra, rb)), tol)
        cache = torch.randn(4096, 128, device=dev)
        pos = torch.randint(0, 4096, (33,), device=dev)
        q, k = (
            torch.randn(33, 32, 128, device=dev, dtype=dtype),
            torch.randn(33, 8, 128, device=dev),
        )
        qa, ka = kernels.apply_rotary(q, k.to(dtype), cache, pos, backend="triton")
        qb, kb2 = kernels.apply_rotary(q, k.to(dtype), cache, pos, backend="torch")
        report(f"apply_rotary {dtype}", max(_rel(qa, qb), _rel(ka, kb2)), tol)
        k_pool = torch.zeros(1000, 8, 128, device=dev, dtype=dtype)
        v_pool = torch.zeros_like(k_pool)
        loc = torch.randperm(1000, device=dev)[:100]
        rows = torch.randn(100, 8, 128, device=dev, dtype=dtype)
        kernels.store_kv(k_pool, v_pool, loc, rows, 2 * rows, backend="triton")
        exact = torch.equal(k_pool[loc], rows) and torch.equal(v_pool[loc], 2 * rows)
        report(f"store_kv {dtype} (exact)", 0.0 if exact else 1.0, 0.5)
    return ok


def _median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def bench_decode(batches: list[int], contexts: list[int], copy_bw: float) -> float | None:
    print(f"\ndecode attention  Hq={HQ} Hkv={HKV} D={D} bf16 (GB/s; % of copy)")
    print(f"{'batch':>6} {'context':>8} {'us':>9} {'GB/s':>8} {'%copy':>6}")
    elem = torch.tensor([], dtype=DTYPE).element_size()
    target = None
    for batch in batches:
        for ctx in contexts:
            kv_bytes = 2 * batch * ctx * HKV * D * elem
            if kv_bytes > KV_LIMIT_BYTES:
                continue
            indptr, indices, slots = _ragged([ctx] * batch, "cuda")
            kb = torch.randn(slots, HKV, D, device="cuda", dtype=DTYPE)
            vb = torch.randn_like(kb)
            q = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
            ms = _median_ms(
                lambda a=(q, kb, vb, indptr, indices): kernels.decode_attention(
                    *a, D**-0.5, backend="triton"
                )
            )
            moved = kv_bytes + indices.numel() * indices.element_size() + 2 * q.numel() * elem
            bw = moved / (ms * 1e-3)
            if (batch, ctx) == (64, 4096):
                target = bw / copy_bw
            print(f"{batch:6} {ctx:8} {ms * 1e3:9.1f} {bw / 1e9:8.0f} {100 * bw / copy_bw:5.0f}%")
            del kb, vb
    return target


def bench_extend(prefixes: list[int], new: int, batch: int) -> None:
    print(f"\nextend attention  {batch} sequences x {new} new tokens, Hq={HQ} Hkv={HKV} D={D}")
    print(f"{'prefix':>7} {'us':>9} {'TFLOP/s':>8}")
    for prefix in prefixes:
        kv, idx, slots = _ragged([prefix] * batch, "cuda")
        kb = torch.randn(max(slots, 1), HKV, D, device="cuda", dtype=DTYPE)
        vb = torch.randn_like(kb)
        n = batch * new
        q = torch.randn(n, HQ, D, device="cuda", dtype=DTYPE)
        k = torch.randn(n, HKV, D, device="cuda", dtype=DTYPE)
        v = torch.randn_like(k)
        qo = torch.arange(batch + 1, device="cuda") * new
        ms = _median_ms(
            lambda a=(q, k, v, kb, vb, qo, kv, idx): kernels.extend_attention(
                *a, D**-0.5, backend="triton"
            )
        )
        flops = 4 * batch * HQ * D * new * (prefix + (new + 1) / 2)
        print(f"{prefix:7} {ms * 1e3:9.1f} {flops / (ms * 1e-3) / 1e12:8.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    start = time.time()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
        f"{triton.__version__}\ncorrectness vs the torch reference:"
    )
    ok = check_correctness()
    copy_bw = copy_bandwidth()
    print(f"\ndevice-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    batches = [1, 64] if args.quick else [1, 8, 32, 64, 128, 256]
    contexts = [4096] if args.quick else [512, 2048, 4096, 8192, 32768]
    ratio = bench_decode(batches, contexts, copy_bw)
    bench_extend([0, 2048] if args.quick else [0, 1024, 4096, 8192], 512, 4)
    if ratio is not None:
        verdict = "met" if ratio >= TARGET else "NOT met"
        print(
            f"\ntarget: decode batch 64 x 4k >= {TARGET:.0%} of copy bandwidth: "
            f"{ratio:.0%} ({verdict})"
        )
    print(f"correctness: {'PASS' if ok else 'FAIL'}; {time.time() - start:.0f} s total")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
