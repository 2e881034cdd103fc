#!/usr/bin/env bash
# `make demo`: kvcompd on its embedded defaults, a prefill client pushing a generated
# Llama-3.1-8B-shaped cache block by block, a decode client fetching it (bench/demo/demo.py).
set -euo pipefail
BUILD=${1:-build}
cd "$(dirname "$0")/.."
exec python3 bench/demo/demo.py "$BUILD/service/kvcompd" "${@:2}"
