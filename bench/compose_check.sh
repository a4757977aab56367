#!/usr/bin/env bash
# The compose stack, run for real: build the image from a clean Docker state, `compose up`, one
# streamed chat through the API with the key from .env, a trace in Jaeger when its image is
# available, then `compose down`. Prints the time of each phase.
#
#   bench/compose_check.sh [--local-base]
#
# --local-base: the public Docker registry is out of reach (as on llmbus's build machines).
# The base image is then built here (mmdebstrap, Debian bookworm's Python 3.11) with this
# host's CA bundle and, if /opt/wheels has one, its CPU torch wheel, and passed to the
# Dockerfile as BASE_IMAGE; Jaeger is replaced by an idle container if it cannot be pulled.
# Needs: docker with a running daemon, docker compose (v2) or docker-compose (v1), curl.
set -euo pipefail
cd "$(dirname "$0")/.."
local_base=0
[[ "${1:-}" == "--local-base" ]] && local_base=1
work=$(mktemp -d)
project=llmbus-check
if docker compose version >/dev/null 2>&1; then compose=(docker compose); else compose=(docker-compose); fi
compose+=(-p "$project" --env-file "$work/.env" -f compose.yaml)
start=$SECONDS
phase() { echo "== $1 ($((SECONDS - start)) s)"; }
cleanup() {
    "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

phase "clean state"
"${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
docker image rm -f llmbus:latest llmbus-base:local >/dev/null 2>&1 || true

build_args=()
if (( local_base )); then
    phase "local base image"
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$work/base.tar"
    docker import "$work/base.tar" llmbus-base-raw:bookworm >/dev/null
    mkdir -p "$work/base"
    cp /etc/ssl/certs/ca-certificates.crt "$work/base/host-ca.crt"
    cp /opt/wheels/torch-*+cpu-cp311-*.whl "$work/base/" 2>/dev/null || true
    cat > "$work/base/Dockerfile" <<'DOCKERFILE'
FROM llmbus-base-raw:bookworm
COPY host-ca.crt /etc/ssl/certs/ca-certificates.crt
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
COPY . /tmp/base/
RUN python3 -m venv /opt/llmbus \
    && if ls /tmp/base/*.whl >/dev/null 2>&1; then /opt/llmbus/bin/pip install --no-cache-dir /tmp/base/*.whl; fi \
    && rm -rf /tmp/base
DOCKERFILE
    docker build -q -t llmbus-base:local "$work/base" >/dev/null
    build_args=(--build-arg BASE_IMAGE=llmbus-base:local)
fi

phase "image"
docker build -q "${build_args[@]}" -t llmbus:latest . >/dev/null
docker run --rm llmbus:latest compose-env > "$work/.env"
key=$(sed -n 's/^LLMBUS_API_KEY=//p' "$work/.env")

if ! docker image inspect jaegertracing/all-in-one:1.62.0 >/dev/null 2>&1 \
        && ! docker pull -q jaegertracing/all-in-one:1.62.0 >/dev/null 2>&1; then
    echo "Jaeger's image cannot be pulled here: an idle container stands in, no trace check"
    cat > "$work/no-jaeger.yaml" <<'YAML'
services:
  jaeger:
    image: llmbus:latest
    entrypoint: ["sleep", "infinity"]
YAML
    compose+=(-f "$work/no-jaeger.yaml")
    jaeger=0
else
    jaeger=1
fi

phase "compose up"
"${compose[@]}" up -d --no-build
for _ in $(seq 300); do
    curl -sf -H "Authorization: Bearer $key" http://127.0.0.1:8000/health >/dev/null && break
    sleep 1
done
phase "ready"
[[ $(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/v1/models) == 401 ]] \
    || { echo "FAIL: the API answered without its key"; exit 1; }
if (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; then
    echo "FAIL: the bus is published on the host"; exit 1
fi
curl -sN -H "Authorization: Bearer $key" -H 'content-type: application/json' \
    http://127.0.0.1:8000/v1/chat/completions -d '{"model": "smollm2-135m-instruct",
    "stream": true, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi!"}]}' \
    > "$work/stream.txt"
grep -q '^data: \[DONE\]' "$work/stream.txt" || { cat "$work/stream.txt"; echo "FAIL: no stream"; exit 1; }
echo "streamed $(grep -c '^data: {' "$work/stream.txt") chunks"
if (( jaeger )); then
    for _ in $(seq 30); do
        curl -s 'http://127.0.0.1:16686/api/traces?service=llmbus-api&limit=5' \
            | grep -q '"traceID"' && { echo "a trace reached Jaeger"; break; }
        sleep 1
    done
fi
phase "compose down"
"${compose[@]}" down -v --remove-orphans >/dev/null
phase "OK"
