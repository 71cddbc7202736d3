# Two entry points for a fresh machine: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint format crds clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first (a local wheel here); a bare `torch` would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)  ## pull the SmolLM2 demo model and ask it the demo question on CPU
	$(VENV)/bin/kubellm models pull smollm2
	$(VENV)/bin/kubellm generate --model smollm2 --prompt "What is the capital of France?"

test: $(STAMP)  ## lint, then the whole suite
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
