#!/usr/bin/env bash
# `make demo`: the most complete real path that exists. Until the daemon and SDK land this
# generates a cache, compresses and round-trips it through the format, and prints its sizes.
set -euo pipefail
BUILD=${1:-build}
cd "$(dirname "$0")/.."
exec "$BUILD/bench/kvcomp_engine_demo"
