#!/usr/bin/env bash
# Packaging, as a user installs kvcomp, from the build `make test` made (no second compile of the
# libraries):
#   1. the C++ SDK package: cmake --install <build> --component devel into a fresh prefix;
#   2. the C++ example built against it twice, with find_package(kvcomp) (examples/cpp) and with
#      pkg-config (kvcomp.pc);
#   3. the Python wheel: pip wheel . in a fresh virtual environment, the extension compiled
#      against the installed package (KVCOMP_PYTHON_FROM_INSTALLED, so only the binding builds),
#      then the wheel installed there;
#   4. tests/packaging/test_installed.py with that environment's python, outside the source tree:
#      the installed package, its `kvcomp` command, the examples and both C++ builds against a
#      real kvcompd on loopback.
#
#   bash tests/packaging/run.sh [build-dir]        (KVCOMP_PACKAGING_KEEP=1 keeps the work dir)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD=$(cd "${1:-build}" && pwd)
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvcomp-packaging.XXXXXX")
[ "${KVCOMP_PACKAGING_KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
T0=$(date +%s)
step() { echo "-- $1 ($(($(date +%s) - T0)) s)"; }
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)

step "C++ SDK package (cmake --install --component devel)"
PREFIX=$WORK/prefix
cmake --install "$BUILD" --prefix "$PREFIX" --component devel >"$WORK/install.log"

step "C++ example against it: find_package(kvcomp)"
cmake -S examples/cpp -B "$WORK/cpp" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PREFIX" "${launcher[@]}" >"$WORK/cpp.log"
cmake --build "$WORK/cpp" >>"$WORK/cpp.log"

step "C++ example against it: pkg-config kvcomp"
PKG_CONFIG_PATH="$PREFIX/lib/pkgconfig" pkg-config --exists --print-errors kvcomp
# shellcheck disable=SC2046
${CXX:-c++} -std=c++17 -O1 examples/cpp/put_get.cc -o "$WORK/put_get_pkgconfig" \
  $(PKG_CONFIG_PATH="$PREFIX/lib/pkgconfig" pkg-config --cflags --libs kvcomp)

step "Python wheel in a fresh virtual environment"
# --system-site-packages: the build tools (scikit-build-core, nanobind) and numpy come from what
# scripts/bootstrap.sh installed, so nothing is downloaded; kvcomp itself is nowhere but here.
"$PY" -m venv --system-site-packages "$WORK/venv"
VPY=$WORK/venv/bin/python
pip_cfg=(-Ccmake.define.KVCOMP_PYTHON_FROM_INSTALLED=ON -Ccmake.define.CMAKE_PREFIX_PATH="$PREFIX"
         -Cbuild-dir="$WORK/wheel-build")
[ ${#launcher[@]} = 0 ] || pip_cfg+=(-Ccmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache)
env -u PYTHONPATH "$VPY" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/dist" \
  "${pip_cfg[@]}" "$ROOT" >"$WORK/wheel.log" 2>&1 || { cat "$WORK/wheel.log"; exit 1; }
ls "$WORK"/dist/kvcomp-*.whl
env -u PYTHONPATH "$VPY" -m pip install -q --no-deps --no-index "$WORK"/dist/kvcomp-*.whl

step "the installed package, the examples and the C++ builds against kvcompd"
(cd "$WORK" && env -u PYTHONPATH KVCOMP_PACKAGING_VENV="$WORK/venv" KVCOMP_BUILD_DIR="$BUILD" \
  KVCOMP_PACKAGING_CPP="$WORK/cpp/put_get:$WORK/put_get_pkgconfig" KVCOMP_REPO="$ROOT" \
  "$VPY" -m pytest -q -p no:cacheprovider --rootdir "$WORK" "$ROOT/tests/packaging/test_installed.py")
step "done"
