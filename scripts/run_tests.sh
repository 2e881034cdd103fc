#!/usr/bin/env bash
# Runs every test that can run on this machine: the C++ tests (ctest; gpu-labelled ones report a
# skip where no GPU is present), the sanitizer builds of the parser-facing tests, the bounded
# fuzz run, and the Python tests. Used by `make test`.
set -euo pipefail
BUILD=${1:-build}
JOBS=$(nproc)
cd "$(dirname "$0")/.."

echo "== C++ tests (ctest) =="
ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS" --timeout 600

if [ -f tests/storage/concurrency_test.cc ] && [ "${KVCOMP_SKIP_STORAGE_TSAN:-0}" != 1 ]; then
  # Storage concurrency under ThreadSanitizer: a separate build of just that test. RocksDB and
  # libstdc++ are not instrumented, so races are reported only from kvcomp's own code.
  echo "== storage concurrency tests (ThreadSanitizer) =="
  cmake -S . -B build-tsan-storage -G Ninja -DKVCOMP_SANITIZE=thread -DKVCOMP_CUDA=OFF \
    -DKVCOMP_PYTHON=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build-tsan-storage -j "$JOBS" --target storage_concurrency_test
  TSAN_OPTIONS="halt_on_error=1 ignore_noninstrumented_modules=1" \
    build-tsan-storage/tests/storage/storage_concurrency_test
fi

if [ -x scripts/run_sanitizers.sh ]; then
  echo "== sanitizer and fuzz tests =="
  bash scripts/run_sanitizers.sh
fi

if [ -d tests/python ]; then
  echo "== Python tests (pytest) =="
  PYTHONPATH="$PWD/client/python${PYTHONPATH:+:$PYTHONPATH}" KVCOMP_BUILD_DIR="$PWD/$BUILD" \
    python3 -m pytest -q tests/python
fi

if [ -x tests/packaging/run.sh ]; then
  # The C++ SDK package (find_package, pkg-config) and the Python wheel in a fresh virtual
  # environment, built from this build's libraries, with the examples run against them.
  echo "== packaging (C++ package, Python wheel, examples) =="
  bash tests/packaging/run.sh "$BUILD"
fi

if [ -d tests/helm ]; then
  echo "== Helm chart tests (pytest) =="
  KVCOMP_BUILD_DIR="$PWD/$BUILD" python3 -m pytest -q tests/helm
fi

echo "== product text (scripts/check_product_text.sh) =="
bash scripts/check_product_text.sh
