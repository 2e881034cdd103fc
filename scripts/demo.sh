#!/usr/bin/env bash
# `make demo`: installs what is missing (scripts/bootstrap.sh), builds only what the demo runs
# (kvcompd and the Python extension, not the tests or benchmarks), then runs bench/demo/demo.py:
# kvcompd on its embedded defaults, a prefill client pushing a generated Llama-3.1-8B-shaped
# cache block by block, a decode client fetching it. Each step prints its time as it starts and
# as it ends.
#   bash scripts/demo.sh [build-dir] [demo.py options]     (JOBS, CMAKE_ARGS as for make)
#
# The demo has a build directory of its own (build-demo by default), configured for what the demo
# runs and nothing more: the CPU backend only (KVCOMP_CUDA=OFF: the demo's kvcompd runs its
# embedded defaults, which use the CPU backend, so the CUDA kernels, a third of the build's
# compile time, are not compiled even where nvcc is present) and -O2 without debug information
# (about a quarter less compile time per source). `make build` and `make test` keep their own
# directory (build: RelWithDebInfo, CUDA compiled when nvcc is found), so running `make demo`
# never changes what `make test` builds and neither rebuilds the other's objects. The extension
# goes into build-demo/python/kvcomp (with the package's .py files), not into the source tree,
# so the extension `make test` built there is left as it is.
set -euo pipefail
BUILD=${1:-build-demo}
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
T0=$(date +%s)
TS=$T0
STEPS=()
now() { echo $(($(date +%s) - T0)); }
step() {  # closes the step before (its time) and opens the next one
  local t; t=$(date +%s)
  if ((${#STEPS[@]})); then
    echo "== [$(now) s] ${STEPS[-1]}: done in $((t - TS)) s"
    STEPS[-1]="${STEPS[-1]}|$((t - TS))"
  fi
  TS=$t
  [ "$1" = "done" ] && return
  STEPS+=("$1")
  echo "== [$(now) s] $1"
}

step "1/4 dependencies (scripts/bootstrap.sh; apt and pip show their progress)"
bash scripts/bootstrap.sh
step "2/4 configure $BUILD (CPU backend only, -O2 without debug information)"
# shellcheck disable=SC2086  # CMAKE_ARGS holds several arguments (they come last: they win)
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_FLAGS_RELEASE="-O2 -DNDEBUG" -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" \
  -DKVCOMP_CUDA=OFF -DKVCOMP_PYTHON_PACKAGE_DIR="$PWD/$BUILD/python" ${CMAKE_ARGS:-} >/dev/null
n=$(ninja -C "$BUILD" -t commands kvcompd _kvcomp | wc -l)
step "3/4 build kvcompd and the Python extension ($n steps, -j $JOBS; ninja prints [done/all])"
cmake --build "$BUILD" -j "$JOBS" --target kvcompd _kvcomp
step "4/4 run the demo (bench/demo/demo.py)"
KVCOMP_DEMO_PYTHONPATH="$PWD/$BUILD/python" \
  python3 bench/demo/demo.py "$BUILD/service/kvcompd" "${@:2}"
step "done"
echo "== make demo took $(now) s:"
for s in "${STEPS[@]}"; do
  printf '   %5s s  %s\n' "${s##*|}" "${s%|*}"
done
