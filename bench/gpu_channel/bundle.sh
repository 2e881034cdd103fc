#!/usr/bin/env bash
# Packs kvcompd, the GPU channel's GPU test, its peer process and its benchmark, with the shared
# libraries a GPU machine lacks (as scripts/gpu_bundle.sh does for the daemon bundle), into
# build-gpu-channel-pack/bundle.tar.xz (gitignored) for bench/gpu_channel/run.sh. The GPU
# channel needs no CUDA build (the driver and NCCL are opened at run time), so any build
# directory with these targets does; a CUDA build also gives the daemon its CUDA engine. When
# the build has the Python extension in BUILD/pkg (KVCOMP_PYTHON_PACKAGE_DIR, built for the GPU
# machine's Python 3.12 with the SDK client), the package travels too (python/kvcomp).
#   cmake -S . -B BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCOMP_CUDA=ON \
#     -DCMAKE_CUDA_ARCHITECTURES=90 -DKVCOMP_PYTHON=ON \
#     -DPython_EXECUTABLE=/root/.pyenv/versions/3.12.1/bin/python3 \
#     -Dnanobind_DIR=$PWD/.sysroot/nanobind/cmake -DKVCOMP_PYTHON_PACKAGE_DIR=$PWD/BUILD/pkg
#   cmake --build BUILD -j 2 --target kvcompd client_gpu_channel_gpu_test gpu_channel_peer \
#     kvcomp_gpu_channel_bench _kvcomp
#   bash bench/gpu_channel/bundle.sh BUILD
#   run(command="bash bench/gpu_channel/run.sh", carry=["build-gpu-channel-pack"])
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:?build directory}
PACKDIR=build-gpu-channel-pack
DEST=$(mktemp -d)
trap 'rm -rf "$DEST"' EXIT
mkdir -p "$DEST/bin" "$DEST/lib/ucx" "$PACKDIR"
bins=(service/kvcompd tests/client/client_gpu_channel_gpu_test tests/client/gpu_channel_peer
      bench/gpu_channel/kvcomp_gpu_channel_bench)
for b in "${bins[@]}"; do
  [ -x "$BUILD/$b" ] || { echo "bundle: $BUILD/$b missing: build it first" >&2; exit 2; }
  strip --strip-all -o "$DEST/bin/$(basename "$b")" "$BUILD/$b"
  realpath "$BUILD/$b" >"$DEST/$(basename "$b").build_path"
done
ext=$(ls "$BUILD"/pkg/kvcomp/_kvcomp.cpython-*.so 2>/dev/null | head -1 || true)
if [ -n "$ext" ]; then
  mkdir -p "$DEST/python/kvcomp"
  cp client/python/kvcomp/*.py "$DEST/python/kvcomp/"
  mkdir -p "$DEST/python/kvcomp/integrations"
  cp client/python/kvcomp/integrations/*.py "$DEST/python/kvcomp/integrations/"
  strip --strip-unneeded -o "$DEST/python/kvcomp/$(basename "$ext")" "$ext"
fi
# UCX's shared-memory module (tcp is built in); what the binaries load, less what the GPU
# machine has (glibc, the C++ runtime, CUDA).
for m in /usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so.0; do [ -e "$m" ] && cp -L "$m" "$DEST/lib/ucx/"; done
SKIP='^(linux-vdso|ld-linux-x86-64|libc|libm|libpthread|libdl|librt|libutil|libresolv|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcublasLt|libcusolver|libcusparse|libcufft|libcurand|libnvJitLink|libnvrtc)\.so'
ldd "${bins[@]/#/$BUILD/}" "$DEST"/lib/ucx/* ${ext:+"$ext"} 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' |
  sort -u | while read -r soname path; do
    [[ "$soname" =~ $SKIP ]] && continue
    [ -e "$DEST/lib/$soname" ] || strip --strip-unneeded -o "$DEST/lib/$soname" "$path"
  done
src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt")
git -C "$src" rev-parse --short HEAD >"$DEST/commit"
cat >"$DEST/env.sh" <<'ENV'
KVCOMP_BUNDLE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export KVCOMP_BUNDLE
export LD_LIBRARY_PATH=$KVCOMP_BUNDLE/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_MODULE_DIR=$KVCOMP_BUNDLE/lib/ucx
export PATH=$KVCOMP_BUNDLE/bin:$PATH
[ -d "$KVCOMP_BUNDLE/python" ] && export KVCOMP_BUNDLE_PYTHON=$KVCOMP_BUNDLE/python
ENV
tar -C "$DEST" -cf - . | xz -T2 -6 >"$PACKDIR/bundle.tar.xz"
echo "bundle: $(ls "$DEST/bin" | wc -l) binaries, $(ls "$DEST/lib" | grep -c '\.so') libraries," \
  "$(( $(stat -c %s "$PACKDIR/bundle.tar.xz") / 1048576 + 1 )) MiB in $PACKDIR/bundle.tar.xz"
