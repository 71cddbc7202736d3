# Two entry points for a fresh machine: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint format crds clean

# pip runs as $(VENV)/bin/pip, never `python -m pip`: `-m` puts the repo root on sys.path, where the
# operator/ folder would shadow the standard library's `operator` module.
PIP := $(VENV)/bin/pip

$(STAMP): pyproject.toml
	cd /tmp && $(PYTHON) -m venv $(CURDIR)/$(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first (a local wheel here); a bare `torch` would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)  ## serve the SmolLM2 demo model on CPU, ask it a question over HTTP, keep serving
	$(VENV)/bin/kubellm demo

test: $(STAMP)  ## lint, then the whole suite
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q

crds: $(STAMP)  ## regenerate the CRD from operator/api.py (a test fails when the committed file drifts)
	$(VENV)/bin/kubellm crd -o crds/llmdeployments.kubellm.io.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
