#!/usr/bin/env bash
# Three hosts (network namespaces), a three-server NATS cluster with TLS and the per-service
# users, the stages spread over the hosts, and each fault injected while 16 streams run; tears
# everything down at the end. Needs root. See bench/cluster_check.py for what it measures.
#
#   sudo bench/cluster_check.sh [--faults nats-api,partition,...] [--json FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m llmbus.bench.cluster_check "$@"
