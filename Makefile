# radixlm: `make serve` (the server on the built-in tiny model) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch first, pinned: on these CPU machines 2.13.0 is a CPU build; unpinned pulls CUDA.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install serve demo test lint bench bench-vllm gpu-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	# the CPU attention kernel (C++), compiled once per machine; without a compiler the
	# engine keeps its pure-torch path
	$(PY) -m radixlm.kernels.cpu_paged || echo "CPU attention kernel not built: torch path"
	touch $@

install: $(VENV)/.installed

serve: install
	$(PY) -m radixlm.cli serve $(ARGS)

demo: install
	$(PY) -m radixlm.cli demo

test: install
	PYTHONUNBUFFERED=1 $(PY) -m pytest -q -x -n auto --maxprocesses 4 --dist loadfile --durations=15

lint: install
	$(VENV)/bin/ruff check radixlm tests benchmarks examples

bench: install
	$(PY) benchmarks/offline_throughput.py
	$(PY) benchmarks/constrained_throughput.py
	$(PY) benchmarks/serving.py

# radixlm against vLLM's CPU build, side by side (creates vLLM's own venv under
# ~/.cache/radixlm/vllm-venv on first use), e.g. ARGS="--preset small" or, quick,
# ARGS="--workloads unique --rounds 1 --modes offline --preset tiny"
bench-vllm: install
	$(PY) benchmarks/vllm_side_by_side.py $(ARGS)

# On a CUDA machine (no venv: the image's Python with torch, plus ../shared/gpu/carry-wheels.sh
# wheels in .site): engine tokens vs the CPU and vs transformers, and the kernels' timings.
GPU_PY ?= python3
gpu-check:
	PYTHONPATH=$(CURDIR):$(CURDIR)/.site $(GPU_PY) benchmarks/gpu_smoke.py
	PYTHONPATH=$(CURDIR):$(CURDIR)/.site $(GPU_PY) benchmarks/gpu_smoke.py --preset small --dtype bfloat16 --against transformers
	PYTHONPATH=$(CURDIR):$(CURDIR)/.site $(GPU_PY) benchmarks/kernels_gpu.py
	# the fused-MoE kernel vs float64, and a tiny Mixtral decoded from CUDA graphs
	PYTHONPATH=$(CURDIR):$(CURDIR)/.site $(GPU_PY) -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe.py tests/runtime/executor/test_cuda_graph_runner.py
	PYTHONPATH=$(CURDIR):$(CURDIR)/.site $(GPU_PY) benchmarks/gpu_smoke.py --family mixtral

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
