#!/usr/bin/env bash
# Packs what bench/cuda_ucx/run.sh runs on a GPU machine into build-cuda-ucx-pack/bundle.tar.xz
# (gitignored): kvcompd (a CUDA build, so its engine runs on the GPU), the benchmark and the
# transport's device-payload test, stripped, with the shared libraries the GPU machine lacks, and
# UCX 1.22 from the libucx-cu13 wheel in place of Debian's UCX: its four libraries, the cuda
# (cuda_copy, cuda_ipc, gdr_copy) and cma modules, the CUDA runtime and OpenMP copies its
# modules load, ucx_info and ucx_perftest with its CUDA memory module. The binaries were linked
# against Debian's UCX 1.13; UCX keeps its ABI within 1.x, so they load 1.22 by soname.
#   cmake -S . -B BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCOMP_CUDA=ON -DKVCOMP_PYTHON=OFF \
#     -DCMAKE_CUDA_ARCHITECTURES=90
#   cmake --build BUILD -j 2 --target kvcompd kvcomp_cuda_ucx_bench transport_cuda_ucx_test
#   bash bench/cuda_ucx/bundle.sh BUILD
#   run(command="bash bench/cuda_ucx/run.sh", carry=["build-cuda-ucx-pack"])
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:?build directory}
PACKDIR=build-cuda-ucx-pack
UCX_WHEEL=${UCX_WHEEL:-$(python3 -c 'import libucx, os; print(os.path.dirname(libucx.__file__))')}
WHEEL_LIBS=$(dirname "$UCX_WHEEL")/libucx_cu13.libs
DEST=$(mktemp -d)
trap 'rm -rf "$DEST"' EXIT
mkdir -p "$DEST/bin" "$DEST/lib/ucx" "$PACKDIR"
bins=(service/kvcompd bench/cuda_ucx/kvcomp_cuda_ucx_bench tests/transport/transport_cuda_ucx_test)
for b in "${bins[@]}"; do
  [ -x "$BUILD/$b" ] || { echo "bundle: $BUILD/$b missing: build it first" >&2; exit 2; }
  strip --strip-all -o "$DEST/bin/$(basename "$b")" "$BUILD/$b"
  realpath "$BUILD/$b" >"$DEST/$(basename "$b").build_path"
done
# UCX 1.22, by soname (the wheel holds each library under three names).
for l in libucp libuct libucs libucm; do
  strip --strip-unneeded -o "$DEST/lib/$l.so.0" "$UCX_WHEEL/lib/$l.so.0"
done
for m in libuct_cuda libucm_cuda libuct_cma libucx_perftest_cuda; do
  strip --strip-unneeded -o "$DEST/lib/ucx/$m.so.0" "$UCX_WHEEL/lib/ucx/$m.so.0"
done
cp "$WHEEL_LIBS"/libcudart-*.so.* "$WHEEL_LIBS"/libgomp-*.so.* "$DEST/lib/"
for t in ucx_info ucx_perftest; do strip --strip-all -o "$DEST/bin/$t" "$UCX_WHEEL/bin/$t"; done
# What else the binaries load, less what the GPU machine has (glibc, the C++ runtime, CUDA) and
# Debian's UCX (replaced above).
SKIP='^(linux-vdso|ld-linux-x86-64|libc|libm|libpthread|libdl|librt|libutil|libresolv|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcublasLt|libcusolver|libcusparse|libnvJitLink|libcurand|libcufft|libucp|libuct|libucs|libucm)\.so'
ldd "${bins[@]/#/$BUILD/}" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' |
  sort -u | while read -r soname path; do
    [[ "$soname" =~ $SKIP ]] && continue
    [ -e "$DEST/lib/$soname" ] || strip --strip-unneeded -o "$DEST/lib/$soname" "$path"
  done
src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt")
# The commit the binaries were built from ("+changes" when its tree had uncommitted edits).
{
  git -C "$src" rev-parse --short HEAD
  git -C "$src" status --porcelain --untracked-files=no | grep -q . && echo "+changes" || true
} | tr -d '\n' >"$DEST/commit"
cat >"$DEST/env.sh" <<'ENV'
KVCOMP_BUNDLE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export KVCOMP_BUNDLE
export LD_LIBRARY_PATH=$KVCOMP_BUNDLE/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_MODULE_DIR=$KVCOMP_BUNDLE/lib/ucx
export PATH=$KVCOMP_BUNDLE/bin:$PATH
ENV
tar -C "$DEST" -cf - . | xz -T2 -6 >"$PACKDIR/bundle.tar.xz"
echo "bundle: $(ls "$DEST/bin" | wc -l) binaries, $(find "$DEST/lib" -name '*.so*' | wc -l) libraries," \
  "$(du -sm "$DEST" | cut -f1) MiB unpacked, $(( $(stat -c %s "$PACKDIR/bundle.tar.xz") / 1048576 + 1 )) MiB in $PACKDIR/bundle.tar.xz"
