#!/usr/bin/env bash
# `make demo`: installs what is missing (scripts/bootstrap.sh), builds only what the demo runs
# (kvcompd and the Python extension, not the tests or benchmarks), then runs bench/demo/demo.py:
# kvcompd on its embedded defaults, a prefill client pushing a generated Llama-3.1-8B-shaped
# cache block by block, a decode client fetching it. Each step prints its time as it ends.
#   bash scripts/demo.sh [build-dir] [demo.py options]     (JOBS, CMAKE_ARGS as for make)
set -euo pipefail
BUILD=${1:-build}
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
T0=$(date +%s)
step() { echo "== [$(($(date +%s) - T0)) s] $1"; }

step "1/4 dependencies (scripts/bootstrap.sh; apt and pip show their progress)"
bash scripts/bootstrap.sh
step "2/4 configure ($BUILD)"
# shellcheck disable=SC2086  # CMAKE_ARGS holds several arguments
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${CMAKE_ARGS:-} >/dev/null
step "3/4 build kvcompd and the Python extension (the first build takes a few minutes)"
cmake --build "$BUILD" -j "$JOBS" --target kvcompd _kvcomp
step "4/4 run the demo (bench/demo/demo.py)"
python3 bench/demo/demo.py "$BUILD/service/kvcompd" "${@:2}"
step "done"
