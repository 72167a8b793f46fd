"""The file storage tier against hostile page files: a prompt's stored pages 1-3 replaced
by symlinks to /dev/zero or by 1 GiB sparse files (``--hicache-storage-prefetch-policy
wait_complete``, the policy that waited longest). Prints the Engine's peak RSS before and
after the request, its latency, the tokens it took from storage and the backend's counts
(``refused_files``, ``bytes_read``). Without the checks, run it under an address-space
limit: the /dev/zero read grows until it fails.

    .venv/bin/python benchmarks/hicache_hostile_pages.py dev_zero
    .venv/bin/python benchmarks/hicache_hostile_pages.py sparse

(one kind per process: the peak RSS of a process only grows).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import tempfile
import time

import radixlm


def _doc(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 400) for _ in range(n)]


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(kind: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        eng = radixlm.Engine(max_total_tokens=640, dtype="float32", cpu_threads=1,
                             random_seed=0, enable_hierarchical_cache=True,
                             hicache_storage_backend="file", hicache_storage_dir=d,
                             hicache_storage_prefetch_policy="wait_complete")
        try:
            params = {"temperature": 0, "max_new_tokens": 4}
            want = eng.generate(input_ids=_doc(0), sampling_params=params)["output_ids"]
            hicache = eng.scheduler.cache.hicache
            hicache.tier.flush(60)
            assert eng.flush_cache()
            for key in hicache.keys(_doc(0), None)[1:]:
                path = hicache.tier.backend.path(key)
                path.unlink()
                if kind == "dev_zero":
                    os.symlink("/dev/zero", path)
                else:
                    with open(path, "wb") as f:
                        f.truncate(1 << 30)
            before, t0 = _peak_mb(), time.perf_counter()
            out = eng.generate(input_ids=_doc(0), sampling_params=params)
            took = time.perf_counter() - t0
            info = hicache.tier.backend.info()
            return (f"{kind}: peak RSS {before:.0f} -> {_peak_mb():.0f} MB, request "
                    f"{took * 1e3:.0f} ms, storage tokens "
                    f"{out['meta_info']['cached_tokens_details']['storage']}, same tokens "
                    f"{out['output_ids'] == want}, refused_files "
                    f"{info.get('refused_files')}, bytes_read {info.get('bytes_read')}")
        finally:
            eng.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kinds", nargs="+", choices=["dev_zero", "sparse"])
    for kind in parser.parse_args().kinds:
        print(run(kind), flush=True)


if __name__ == "__main__":
    main()
