# One image for every stage; compose.yaml picks the service with `llmbus serve NAME`.
# BASE_IMAGE: any Debian-based image with Python 3.11 and its venv module. Where the public
# registry is out of reach, bench/compose_check.sh builds one locally and passes it here.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
WORKDIR /app
# g++ builds the executor's CPU kernels (paged attention, small steps) on first use; without it
# the executor uses torch's attention and ONNX Runtime for every step.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# One venv for llmbus (a base image may bring it with packages already in it, e.g. a CPU torch).
RUN test -x /opt/llmbus/bin/python || python3 -m venv /opt/llmbus
ENV PATH=/opt/llmbus/bin:$PATH
COPY pyproject.toml README.md ./
COPY bus ./bus
COPY services ./services
COPY bench ./bench
# torch from PyPI is the CUDA build on x86_64; it runs on the CPU as well.
RUN pip install --no-cache-dir . \
    && llmbus model pull
ENTRYPOINT ["llmbus"]
