# One image for every stage; compose.yaml picks the service with `llmbus serve NAME`.
FROM python:3.11-slim
WORKDIR /app
# g++ builds the executor's CPU kernels (paged attention) on first use; without it the executor
# uses torch's attention.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY bus ./bus
COPY services ./services
# torch from PyPI is the CUDA build on x86_64; it runs on the CPU as well.
RUN pip install --no-cache-dir . \
    && llmbus model pull
ENTRYPOINT ["llmbus"]
