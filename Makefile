# The README's two set-up commands: `make demo` and `make test`.
# Each installs what it needs into the current Python environment first, at the versions of the lock
# constraints.txt (also used by both cluster images; `make constraints` regenerates it).
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
CONSTRAINTS := constraints.txt
export PYTHONUNBUFFERED := 1
# Compiled DeepSpeed ops are cached here between runs.
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/hylo/torch_extensions

.PHONY: install demo test test-fast lint assets docs bench constraints gpu-check

# torch is not in the lock: an installed torch is kept, otherwise the CPU build 2.13.0 is installed.
# pip compiles what it installs one file after another on one core (43 of its 102 CPU-s in a fresh virtualenv);
# --no-compile, then compileall on every core does the same work in parallel: `make install` into a new virtualenv
# 98 -> 84 s here (2026-12-04), ~8 s more when everything is installed already (compileall reads every file's
# cache header). A cache only: a file it cannot compile (a template of another Python version in some package)
# is compiled on import, or not, as before.
SITE_PACKAGES = $(PYTHON) -c "import sysconfig as s; print(*sorted({s.get_path('purelib'), s.get_path('platlib')}))"
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install --no-compile -c $(CONSTRAINTS) torch==2.13.0
	$(PIP) install -q --no-compile -c $(CONSTRAINTS) -e '.[dev]'
	@$(PYTHON) -m compileall -q -j 0 $$($(SITE_PACKAGES)) >/dev/null 2>&1 || true

# Rewrite the lock from this environment (after upgrading a dependency and passing `make test`).
constraints:
	$(PYTHON) cluster/constraints.py --write

assets: install
	$(PYTHON) jobs/fetch_assets.py

demo: assets
	$(PYTHON) jobs/demo.py

# The tests run in three processes (pytest-xdist) on the machine's two cores: much of a slow test is waiting on
# processes it started. A test file goes to one process at a time (--dist loadfile), so that a file's shared
# fixtures (its Ray, its models) are made once; the wheel quick start and the cluster faults (the longest chains
# of work) start first, then the files with the most tests (tests/conftest.py; --no-loadscope-reorder lets that
# order stand). Each process gets a Ray temp root of its own (tests/conftest.py:
# Ray's helper actors otherwise find each other's clusters) and one torch thread (OMP_NUM_THREADS=1). The suite is
# CPU-bound either way: three processes 19-20 min (2026-12-04), TEST_WORKERS=0 (one process) ~42
# (docs/results.md#cuts-dec4-night).
# compileall first: where PYTHONDONTWRITEBYTECODE is set (this build machine's environment) Python caches no
# bytecode, and each of the hundreds of processes the suite starts (jobs, torchrun ranks, Ray Train workers) compiled
# the checkout's modules again (~0.6 CPU-s a process that imports the trainer). Symlinked folders are not followed:
# hylo/pipeline, hylo/jobs, hylo/kernels are compiled as pipeline, jobs, kernels.
TEST_WORKERS ?= 3
test: assets docs
	$(PYTHON) -m ruff check .
	$(PYTHON) -m compileall -q -j 0 hylo pipeline jobs kernels tests bench
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

# The documentation site (docs/, mkdocs.yml) into site/ (git-ignored). --strict: a broken link or anchor, a page
# missing from the nav or a nav entry without its page is an error. The configuration reference is generated
# from the config dataclasses while it builds (docs/hooks/config_reference.py). Built beside site/ and swapped in
# (docs/hooks/build_site.py): a site/ holding anything but our own earlier build is refused, never emptied.
docs: install
	$(PYTHON) docs/hooks/build_site.py site

# The edit-run loop (after one `make test` has installed everything): lint and every test not marked
# `slow`, i.e. none that starts Ray, DeepSpeed, torchrun or any other process or loads the real SmolLM2
# (tests/conftest.py fails a test without the marker that starts a process), in two processes.
test-fast:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q -n 2 -m "not slow" tests

lint:
	$(PYTHON) -m ruff check .

# One prepared check of every GPU path at the released shapes (docs/gpu-check.md): on a GPU machine,
# `make gpu-check OUT=folder` writes folder/gpu_check.json and folder/gpu_check.md. Installs nothing:
# the machine's own torch/triton/transformers plus the carried wheels (docs/gpu-check.md). Each case runs in a
# process of its own, stopped after GPU_CASE_SECONDS; none starts after GPU_DEADLINE seconds.
OUT ?= gpu-check
GPU_CASE_SECONDS ?= 240
GPU_DEADLINE ?= 540
gpu-check:
	$(PYTHON) bench/gpu_check.py --out $(OUT) --case-seconds $(GPU_CASE_SECONDS) --deadline $(GPU_DEADLINE) $(GPU_CHECK_FLAGS)
