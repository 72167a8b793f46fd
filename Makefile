# radixlm: `make serve` (the server on the built-in tiny model) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch first, pinned: on these CPU machines 2.13.0 is a CPU build; unpinned pulls CUDA.
TORCH_SPEC ?= torch==2.13.0
# a failed pip in `pip ... | grep` fails the recipe
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

.PHONY: install serve demo test lint bench bench-vllm bench-llamacpp gpu-check clean

$(VENV)/.installed: pyproject.toml
	@echo "radixlm: installing into $(VENV) from PyPI (about 2.4 GB; 3-6 minutes, then 1-2 to compile the CPU kernel)"
	@echo "[1/4 $$(date +%T)] a virtual environment in $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@echo "[2/4 $$(date +%T)] $(TORCH_SPEC) (a CPU build on CPU machines)"
	$(PIP) install --progress-bar off "$(TORCH_SPEC)" | { grep -v "^Requirement already" || true; }
	@echo "[3/4 $$(date +%T)] radixlm and its test tools"
	$(PIP) install --progress-bar off -e ".[test]" | { grep -E "^(Collecting|Successfully)" || true; }
	@echo "[4/4 $$(date +%T)] the CPU attention kernel (C++), compiled once per machine"
	@# without a compiler the engine keeps its pure-torch path
	@$(PY) -c "import logging, sys; logging.basicConfig(level=logging.INFO, format='  %(message)s'); \
	from radixlm.kernels import cpu_paged; sys.exit(0 if cpu_paged.available() else 1)" \
	|| echo "  CPU attention kernel not built: the torch path serves"
	touch $@
	@echo "[done $$(date +%T)] installed: run .venv/bin/radixlm, or 'source $(VENV)/bin/activate' first"

install: $(VENV)/.installed

serve: install
	@echo "serving on http://127.0.0.1:30000 once ready; try: curl -s localhost:30000/generate -d '{\"text\": \"Hello\", \"sampling_params\": {\"max_new_tokens\": 8}}'"
	$(PY) -m radixlm.cli serve $(ARGS)

demo: install
	$(PY) -m radixlm.cli demo

test: install
	@echo "the test suite: about 20 minutes on 2 cores"
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

bench-llamacpp: install
	$(PY) benchmarks/llamacpp_side_by_side.py $(ARGS)

# On a CUDA machine (no venv: the image's Python with torch, plus ../shared/gpu/carry-wheels.sh
# wheels in .site): engine tokens vs the CPU and vs transformers, and the kernels' timings.
GPU_PY ?= python3
gpu-check:
	PYTHONPATH=$(CURDIR):$(CURDIR)/.site $(GPU_PY) benchmarks/gpu_smoke.py
	PYTHONPATH=$(CURDIR):$(CURDIR)/.site $(GPU_PY) benchmarks/gpu_smoke.py --preset small --dtype bfloat16 --against transformers
	PYTHONPATH=$(CURDIR):$(CURDIR)/.site $(GPU_PY) benchmarks/kernels_gpu.py
	# the fused-MoE kernel vs float64, and a tiny Mixtral decoded from CUDA graphs
	PYTHONPATH=$(CURDIR):$(CURDIR)/.site $(GPU_PY) -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe.py tests/kernels/test_quant_linear_triton.py tests/runtime/executor/test_cuda_graph_runner.py
	PYTHONPATH=$(CURDIR):$(CURDIR)/.site $(GPU_PY) benchmarks/gpu_smoke.py --family mixtral

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
