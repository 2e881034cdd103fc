#!/usr/bin/env bash
# Runs every test that can run on this machine (README.md, "Tests", lists them): the C++ tests
# (ctest; gpu-labelled ones are skipped where no GPU is present, saying so), storage concurrency
# under ThreadSanitizer, the sanitizer builds of the parser-facing tests, the bounded fuzz run,
# the transport against UCX 1.22, the Python tests, packaging, the Helm chart tests and the
# product-text check. Used by `make test`. Ends with a summary of passed, skipped (with reasons)
# and failed tests per section, from the JUnit files in $BUILD/test-results/.
set -euo pipefail
BUILD=${1:-build}
JOBS=$(nproc)
cd "$(dirname "$0")/.."
RESULTS="$PWD/$BUILD/test-results"
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
T0=$(date +%s)
section() { echo; echo "== $1 [$(($(date +%s) - T0)) s] =="; }
summary() {
  echo
  python3 scripts/test_summary.py "C++ (ctest)=$RESULTS/ctest.xml" \
    ${RERUN:+"C++ (ctest, run again after UCX 1.13.1's abort)=$RESULTS/ctest-rerun.xml"} \
    "Python (pytest tests/python)=$RESULTS/python.xml" \
    "Helm chart (pytest tests/helm)=$RESULTS/helm.xml" || true
  echo "(total $(($(date +%s) - T0)) s)"
}
trap summary EXIT
# The separate builds below carry line tables only (-g1: file:line in the sanitizers' reports, a
# fraction of full debug information's disk) and, in CI (CI=true), are removed once their tests
# have passed (disk: README.md, "Disk").
g1=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG"
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG")
done_with() { if [ "${CI:-}" = true ]; then rm -rf "$@"; fi; }

section "C++ tests (ctest)"
set +e
ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS" --timeout 600 \
  --output-junit "$RESULTS/ctest.xml" 2>&1 | tee "$RESULTS/ctest.log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" != 0 ]; then
  # UCX 1.13.1 can abort a process that holds a UcxServer and clients at once in its own
  # assertion (async.c:643 handler->async == async; docs/protocol.md, "Known gap"; fixed in
  # later UCX). Where every failed test is one that UCX aborted so, those tests run once more
  # and that run decides; both runs are in the summary. Any other failure fails here.
  aborted=$(awk '/Test +#[0-9]+: /{cur=""; if ($0 ~ /\*\*\*(Failed|Exception)/) {
                   sub(/.*Test +#[0-9]+: /, ""); sub(/ .*/, ""); cur=$0 } }
                 /async\.c:643 +Assertion .handler->async == async. failed/{ if (cur != "") print cur }' \
              "$RESULTS/ctest.log" | sort -u)
  failed=$(sed 's/^[0-9]*://' "$BUILD/Testing/Temporary/LastTestsFailed.log" | sort -u)
  if [ -z "$aborted" ] || [ "$failed" != "$aborted" ]; then exit "$rc"; fi
  RERUN=1
  section "C++ tests aborted by UCX 1.13.1's assertion, run once more: $(echo $aborted)"
  ctest --test-dir "$BUILD" --rerun-failed --output-on-failure --timeout 600 \
    --output-junit "$RESULTS/ctest-rerun.xml"
fi

if [ -f tests/storage/concurrency_test.cc ] && [ "${KVCOMP_SKIP_STORAGE_TSAN:-0}" != 1 ]; then
  # Storage concurrency under ThreadSanitizer: a separate build of just that test. RocksDB and
  # libstdc++ are not instrumented, so races are reported only from kvcomp's own code.
  section "storage concurrency tests (ThreadSanitizer)"
  cmake -S . -B build-tsan-storage -G Ninja -DKVCOMP_SANITIZE=thread -DKVCOMP_CUDA=OFF \
    -DKVCOMP_PYTHON=OFF "${g1[@]}" >/dev/null
  cmake --build build-tsan-storage -j "$JOBS" --target storage_concurrency_test
  TSAN_OPTIONS="halt_on_error=1 ignore_noninstrumented_modules=1" \
    build-tsan-storage/tests/storage/storage_concurrency_test
  done_with build-tsan-storage
fi

if [ -x scripts/run_sanitizers.sh ]; then
  section "sanitizer and fuzz tests"
  bash scripts/run_sanitizers.sh
fi

# The data-plane transport also built against UCX 1.22 (the libucx-cu13 wheel, CUDA transports
# included), with its device-payload test run on it: the CUDA-aware code path compiles and links
# against a UCX other than Debian's. The wheel's .pc files name their build machine's prefix;
# pkg-config --define-prefix finds the real one, and copies of them with it go first on the path.
UCX_WHEEL=$(python3 -c 'import libucx, os; print(os.path.dirname(libucx.__file__))' 2>/dev/null || true)
if [ -n "$UCX_WHEEL" ] && [ -f "$UCX_WHEEL/lib/pkgconfig/ucx.pc" ]; then
  section "transport against UCX $(PKG_CONFIG_PATH="$UCX_WHEEL/lib/pkgconfig" pkg-config --modversion ucx) (libucx-cu13)"
  prefix=$(PKG_CONFIG_PATH="$UCX_WHEEL/lib/pkgconfig" pkg-config --define-prefix --variable=prefix ucx)
  mkdir -p build-ucx122/pkgconfig
  for pc in "$UCX_WHEEL"/lib/pkgconfig/*.pc; do
    sed "s|^prefix *=.*|prefix = $prefix|" "$pc" >"build-ucx122/pkgconfig/$(basename "$pc")"
  done
  PKG_CONFIG_PATH="$PWD/build-ucx122/pkgconfig" cmake -S . -B build-ucx122 -G Ninja \
    -DKVCOMP_CUDA=OFF -DKVCOMP_PYTHON=OFF "${g1[@]}" >/dev/null
  cmake --build build-ucx122 -j "$JOBS" --target transport_cuda_ucx_test kvcompd_ucx_interop_test
  ldd build-ucx122/tests/transport/transport_cuda_ucx_test | grep -E 'libuc[ps]\.so'
  build-ucx122/tests/transport/transport_cuda_ucx_test
  # A client on this UCX against this build's kvcompd on the system's UCX started with
  # data_plane.ucx_interop auto, with no UCX_ variable set (the test removes them): put, get and
  # lookup pass because the two sides settle what the pair of releases needs themselves
  # (docs/protocol.md, "UCX releases"). The file's other tests need a client on the daemon's
  # release; the main build's ctest runs them.
  system_ucx=$(pkg-config --modversion ucx | cut -d. -f1,2)
  expect=()
  if [ "$system_ucx" != "$(PKG_CONFIG_PATH="$UCX_WHEEL/lib/pkgconfig" pkg-config --modversion ucx |
      cut -d. -f1,2)" ]; then
    expect=(KVCOMP_EXPECT_DAEMON_UCX="$system_ucx")
  fi
  env "${expect[@]}" KVCOMP_KVCOMPD="$PWD/$BUILD/service/kvcompd" \
    build-ucx122/tests/integration/kvcompd_ucx_interop_test \
    --gtest_filter=UcxInteropTest.PutGetAndLookupPassOnTheDefaults
  done_with build-ucx122
fi

if [ -d tests/python ]; then
  section "Python tests (pytest)"
  PYTHONPATH="$PWD/client/python${PYTHONPATH:+:$PYTHONPATH}" KVCOMP_BUILD_DIR="$PWD/$BUILD" \
    python3 -m pytest -q -rs --junitxml="$RESULTS/python.xml" tests/python
fi

if [ -x tests/packaging/run.sh ]; then
  # The C++ SDK package (find_package, pkg-config) and the Python wheel in a fresh virtual
  # environment, built from this build's libraries, with the examples run against them.
  section "packaging (C++ package, Python wheel, examples)"
  bash tests/packaging/run.sh "$BUILD"
fi

if [ -d tests/helm ]; then
  section "Helm chart tests (pytest)"
  KVCOMP_BUILD_DIR="$PWD/$BUILD" python3 -m pytest -q -rs --junitxml="$RESULTS/helm.xml" tests/helm
fi

section "product text (scripts/check_product_text.sh)"
bash scripts/check_product_text.sh
