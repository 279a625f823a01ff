# make demo | make test | make bench | make docs | make lint | make test-fast |
# make check-kernels -- each sets up .venv first (Python 3.10+). make gpu-check runs the
# CUDA checks with the machine's own python3 (docs/gpu.md).
# make docs builds the documentation site (mkdocs, --strict: a warning fails) into site/.
# make dist builds the sdist and the wheel into dist/ and checks both with twine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: demo test test-fast lint bench docs dist data setup clean

setup: $(STAMP)

# torch 2.14.1 / torchvision 0.29.1 are the pinned pair (pip takes them from local files
# where they lie on disk); everything else comes from pyproject's extras.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[all]'
	touch $(STAMP)

# The embedded data set: Debian's dataset-fashion-mnist (real 60k/10k images).
data:
	@if [ ! -f $(FMNIST) ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null; \
	  else \
	    echo "Fashion-MNIST is missing: run 'sudo apt-get install dataset-fashion-mnist'," \
	         "or pass --data DIR with the four idx .gz files."; exit 1; \
	  fi; \
	fi

# The suite runs in TEST_JOBS processes (pytest-xdist), each test module kept on one
# process (--dist loadscope) so that a module's shared fixtures are built once.
TEST_JOBS ?= 2
test: $(STAMP) data
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadscope tests

# The inner loop: each test function once (its first case off the Triton interpreter and
# torch.compile, where it has one), without those marked slow
# (torchrun, process pools, subprocesses); make test runs every case of every test.
test-fast: $(STAMP) data
	$(PY) -m pytest -q -m "not slow" --first-cases tests

# The gate CI runs before the tests: ruff's formatter (layout), ruff (style, errors,
# annotations, import order), mypy (types; every function of the package annotated).
# make format applies the formatter and the import order.
LINTED := src tests benchmarks tools examples
lint: $(STAMP)
	$(PY) -m ruff format --check $(LINTED)
	$(PY) -m ruff check $(LINTED)
	$(PY) -m mypy

.PHONY: format
format: $(STAMP)
	$(PY) -m ruff check --fix --select I $(LINTED)
	$(PY) -m ruff format $(LINTED)

demo: $(STAMP) data
	$(PY) -m largebatch steps --quick

bench: $(STAMP)
	$(PY) benchmarks/optimizer_step.py

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# The sdist and the wheel a release uploads (docs/install.md); tests/test_packaging.py
# also installs the wheel on its own and imports both facades.
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist
	$(PY) -m twine check --strict dist/*

clean:
	rm -rf $(VENV) .pytest_cache build dist site *.egg-info src/*.egg-info

# On a CUDA machine: every check of docs/gpu.md (tests in the CUDA mode, CUDA graphs,
# the step's bandwidth against the copy and its peers, the AdaComp hook on NCCL, FSDP2,
# the demo), from the source tree with the machine's own python3 (GPU_PYTHON), not
# .venv. One report: $$OUT or runs/gpu-check (GPU_REPORT)/report.md. Without a GPU it
# says so and exits 0; a GPU_PYTHON that cannot import torch fails.
.PHONY: gpu-check
gpu-check:
	@bash benchmarks/gpu_check.sh

# Every number of the steps studies (docs/study.md) from their committed runs: each
# docs/study/steps-* folder's report, as `largebatch steps --report` writes it, then the
# quotes of them in docs/study.md and README.md (tools/study_docs.py).
.PHONY: study-report
study-report: $(STAMP)
	$(PY) tools/study_docs.py

# The fused kernels compiled for sm_80 and sm_90, no GPU needed: every launch the fused
# path makes (recorded on the CPU), failing on a spill, more than 128 registers a thread
# or an fp64 instruction per element (tools/compile_check.py;
# make test runs a sample). About 8 minutes on 2 cores.
.PHONY: check-kernels
check-kernels: $(STAMP)
	env -u TRITON_INTERPRET $(PY) tools/compile_check.py
