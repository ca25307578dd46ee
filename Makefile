# Set-up reuses a torch that is already installed (a GPU machine's CUDA build) and otherwise installs
# TORCH_SPEC (on the project's CPU machines, a CPU build that lies on disk).
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup demo test

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/glmquant demo out/tiny

test: setup
	$(BIN)/python -m pytest -q
