# Set-up reuses a torch that is already installed (a GPU machine's CUDA build) and otherwise installs
# TORCH_SPEC (on the project's CPU machines, a CPU build that lies on disk).
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# pytest-xdist workers for `make test`: the project's machines have two cores
TEST_WORKERS ?= 2
BIN := $(VENV)/bin
# pytest puts each test folder on sys.path (helpers import by bare name), so every folder's conftest.py is a
# module named `conftest`: mypy checks one test folder per run
TEST_DIRS := $(sort $(dir $(wildcard tests/*/*.py)))

.PHONY: setup demo test test-fast lint typecheck

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/glmquant demo out/tiny

# the whole suite on TEST_WORKERS pytest-xdist processes (each torch on its share of the cores: tests/conftest.py);
# loadgroup keeps the tests that share an expensive fixture (`xdist_group` marks) on one worker, which builds it once
test: setup
	$(BIN)/python -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadgroup

# the edit-test loop: every test not marked slow, under a minute on two idle cores
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff format --check glmquant tests scripts
	$(BIN)/ruff check glmquant tests scripts

typecheck: setup
	$(BIN)/mypy glmquant scripts $(wildcard tests/*.py)
	for dir in $(TEST_DIRS); do $(BIN)/mypy "$$dir" || exit 1; done
