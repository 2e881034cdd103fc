#!/usr/bin/env bash
# Builds .sysroot/: the Debian libraries a CUDA build of core, kernels, tests and bench needs on the
# GPU device machine, which has nvcc, CMake and PyTorch but none of our Debian packages (Abseil,
# GoogleTest, Google Benchmark, Eigen, LAPACKE). Packages are fetched with `apt-get download` and
# unpacked with `dpkg -x` (no install, no root). A GPU run carries the folder (64 MiB limit
# for the whole tree); bench/gpu/run.sh points CMake and the loader at it. It also holds this
# machine's nanobind and CPython 3.12 headers for run.sh's python step (see below).
#
#   bash scripts/gpu_sysroot.sh          # (re)creates .sysroot/ in the repository root
#   run(command="bash bench/gpu/run.sh", carry=[".sysroot"])
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD/.sysroot
LIMIT_MIB=40

PACKAGES=(
  libabsl-dev libabsl20220623
  libgtest-dev libgmock-dev
  libbenchmark-dev libbenchmark1debian
  libeigen3-dev
  liblapacke-dev liblapacke liblapack3 libblas3 libtmglib3 libgfortran5 libquadmath0
)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"  # apt-get download drops to the _apt user
(cd "$work" && apt-get download -q "${PACKAGES[@]}" >/dev/null)

rm -rf "$ROOT"
mkdir -p "$ROOT"
for deb in "$work"/*.deb; do
  dpkg -x "$deb" "$ROOT"
done

# Debian reaches BLAS and LAPACK through the alternatives system, which dpkg -x does not run:
# link the reference implementations where the linker and loader look.
lib=$ROOT/usr/lib/x86_64-linux-gnu
for name in blas lapack; do
  if [ -e "$lib/$name/lib$name.so.3" ]; then
    ln -sf "$name/lib$name.so.3" "$lib/lib$name.so.3"
    ln -sf "lib$name.so.3" "$lib/lib$name.so"
  fi
done
[ -e "$lib/libtmglib.so.3" ] && ln -sf libtmglib.so.3 "$lib/libtmglib.so"

# Only headers, CMake configs and libraries travel: documentation, man pages, static archives of
# libraries that also ship shared objects (GoogleTest and Benchmark configs name their archives: keep those).
rm -rf "$ROOT/usr/share/doc" "$ROOT/usr/share/man" "$ROOT/usr/share/lintian" "$ROOT/usr/src"
find "$lib" -name '*.a' ! -name 'libgtest*' ! -name 'libgmock*' ! -name 'libbenchmark*' -delete

# The Python extension (bench/gpu/run.sh's python step): nanobind as CI builds with it (a pure
# source package: the device's own may be another version), and CPython 3.12 headers in case the
# device's python3 (3.12, a venv) has none; run.sh uses these only when its python lacks them.
nb=$(python3 -m nanobind --cmake_dir 2>/dev/null || true)
if [ -n "$nb" ]; then
  cp -r "$(dirname "$nb")" "$ROOT/nanobind"
  find "$ROOT/nanobind" -name __pycache__ -prune -exec rm -rf {} +
else
  echo "gpu_sysroot: no nanobind for python3 here; run.sh will use the device's" >&2
fi
for py in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
  inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null) ||
    continue
  if [ -f "$inc/Python.h" ]; then
    mkdir -p "$ROOT/python-headers"
    cp -r "$inc" "$ROOT/python-headers/python3.12"
    break
  fi
done
[ -d "$ROOT/python-headers" ] || echo "gpu_sysroot: no CPython 3.12 headers found here" >&2

size_mib=$(du -sm "$ROOT" | cut -f1)
echo "gpu_sysroot: ${#PACKAGES[@]} packages in $ROOT (${size_mib} MiB)"
if [ "$size_mib" -gt "$LIMIT_MIB" ]; then
  echo "gpu_sysroot: larger than ${LIMIT_MIB} MiB; a GPU run carries 64 MiB in all" >&2
  exit 1
fi
