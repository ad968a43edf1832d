# The README's two set-up commands: `make demo` and `make test`.
# Each installs what it needs into the current Python environment first.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
export PYTHONUNBUFFERED := 1
# Compiled DeepSpeed ops are cached here between runs.
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/hylo/torch_extensions

.PHONY: install demo test lint assets bench

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -q -e '.[dev]'

assets: install
	$(PYTHON) jobs/fetch_assets.py

demo: assets
	$(PYTHON) jobs/demo.py

test: assets
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q tests

lint:
	$(PYTHON) -m ruff check .
