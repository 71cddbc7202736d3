# Minimal CPU runtime image; the delivery issue turns this into multi-stage
# runtime-cuda / runtime-cpu / operator targets. TORCH_PIP_ARGS can point pip at a CPU-only wheel index.
FROM python:3.11-slim-bookworm
ARG TORCH_PIP_ARGS=""
# g++ lets the runtime build its native CPU attention kernel at first start (else it falls back to PyTorch).
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 kubellm
WORKDIR /app
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY runtime ./runtime
COPY kernels ./kernels
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ${TORCH_PIP_ARGS} torch==2.13.0 \
    && pip install --no-cache-dir .
USER 10001
ENTRYPOINT ["kubellm"]
CMD ["generate"]
