#!/usr/bin/env bash
# Collects the whole daemon for the GPU device machine into .gpubundle/bundle.tar.xz (gitignored;
# unpacked, build-gpu-bundle/ here): stripped binaries built here with the CUDA backend (kvcompd,
# the integration tests, the SDK's tests against real daemons, the kvcompd, pipeline and decode
# benchmarks, the decode GPU test) and the shared libraries they load that the device lacks (UCX
# and its transport modules, Thrift, RocksDB, prometheus-cpp, Abseil, yaml-cpp, LAPACKE/BLAS,
# libevent, OpenSSL, compression libraries...). The device has glibc, libstdc++ and the CUDA
# libraries; those are left out. bench/gpu/run.sh's `daemon` step unpacks it, sources its env.sh,
# which puts lib/ on the loader path and UCX's module directory at lib/ucx, and runs the binaries
# there. Unpacked it is about 240 MiB, packed about 15 MiB: a GPU run carries 64 MiB with the
# working tree, so the archive travels.
#
# Build first (nvcc 13, sm_90, the CUDA backend; any build directory, best from a clean checkout
# of one commit, e.g. a `git worktree`, so the bundle names the commit it was built from):
#   cmake -S . -B build-gpu-daemon -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCOMP_CUDA=ON \
#     -DKVCOMP_PYTHON=OFF -DCMAKE_CUDA_ARCHITECTURES=90
#   cmake --build build-gpu-daemon -j 2 --target kvcompd kvcompd_daemon_test \
#     kvcompd_control_security_lifecycle_test kvcompd_housekeeping_test kvcompd_bench \
#     client_daemon_test client_gpu_channel_gpu_test gpu_channel_peer kvcomp_bench_gpu_pipeline kvcomp_bench_gpu_decode \
#     decode_attention_cuda_test service_device_path_test service_multi_gpu_test kvcomp_gpu_campaign
#   bash scripts/gpu_bundle.sh build-gpu-daemon
#   run(command="KVCOMP_GPU_STEPS=daemon bash bench/gpu/run.sh", carry=[".gpubundle"])
#
# The host benchmarks (bench/transport/device.sh) need no CUDA: a CPU build's kvcompd and
# benchmarks do, with the tools below, into a bundle of their own:
#   KVCOMP_BUNDLE_BINARIES="bench/transport/kvcomp_transport_bench bench/storage/storage_bench" \
#   KVCOMP_BUNDLE_PYTHON=0 KVCOMP_BUNDLE_DEST=build-host-bundle \
#   KVCOMP_BUNDLE_PACK=.dev/host/bundle.tar.xz bash scripts/gpu_bundle.sh build
#
# Tools from Debian packages (KVCOMP_BUNDLE_TOOLS, "package:path-in-package" words; default
# ucx_perftest and ucx_info of the UCX the binaries load, and coreutils' dd; "" for none): each
# package is fetched with `apt-get download` (the same release as the installed libraries),
# checked to be amd64, unpacked with `dpkg-deb -x` and the program copied into bin/ with the
# libraries it loads; the newest glibc symbol version the bundle needs is written to
# glibc_needed (the device's glibc must be at least that).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-gpu-daemon}
DEST=${KVCOMP_BUNDLE_DEST:-build-gpu-bundle}
PACK=${KVCOMP_BUNDLE_PACK:-.gpubundle/bundle.tar.xz}
LIMIT_MIB=${KVCOMP_BUNDLE_LIMIT_MIB:-40}  # the archive; a GPU run carries 64 MiB with the tree
TOOLS=${KVCOMP_BUNDLE_TOOLS-ucx-utils:usr/bin/ucx_perftest ucx-utils:usr/bin/ucx_info coreutils:bin/dd}

# Binaries: path in the build directory. A missing optional one is skipped with a note.
REQUIRED=(service/kvcompd)
OPTIONAL=(
  tests/integration/kvcompd_daemon_test
  tests/integration/kvcompd_control_security_lifecycle_test
  tests/integration/kvcompd_housekeeping_test
  bench/service/kvcompd_bench
  bench/gpu/kvcomp_bench_gpu_pipeline
  bench/gpu/kvcomp_bench_gpu_decode
  tests/decode/decode_attention_cuda_test
  tests/client/client_daemon_test
  tests/client/client_gpu_channel_gpu_test
  tests/client/gpu_channel_peer
  tests/service/service_device_path_test
  tests/service/service_multi_gpu_test
  tests/kernels/kernels_device_crc32c_test
  tests/kernels/kernels_device_format_test
  tests/storage/storage_device_payload_test
  bench/gpu/kvcomp_bench_gpu_crc32c
  bench/reliability/kvcomp_gpu_campaign
  bench/transport/kvcomp_transport_bench
  bench/storage/storage_bench
)
# KVCOMP_BUNDLE_BINARIES: these optional binaries instead of the list above (space-separated).
if [ -n "${KVCOMP_BUNDLE_BINARIES:-}" ]; then read -ra OPTIONAL <<<"$KVCOMP_BUNDLE_BINARIES"; fi
# Libraries the device machine has (its own glibc, C++ runtime and CUDA), by soname prefix.
SKIP='^(linux-vdso|ld-linux-x86-64|libc|libm|libpthread|libdl|librt|libutil|libresolv|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcublasLt|libcusolver|libcusparse|libnvJitLink|libcurand|libcufft)\.so'

for b in "${REQUIRED[@]}"; do
  [ -x "$BUILD/$b" ] || { echo "gpu_bundle: $BUILD/$b missing: build it first" >&2; exit 2; }
done
rm -rf "$DEST"
mkdir -p "$DEST/bin" "$DEST/lib/ucx"

bins=()
for b in "${REQUIRED[@]}" "${OPTIONAL[@]}"; do
  if [ -x "$BUILD/$b" ]; then
    strip --strip-all -o "$DEST/bin/$(basename "$b")" "$BUILD/$b"
    bins+=("$BUILD/$b")
  else
    echo "gpu_bundle: $BUILD/$b not built, left out" >&2
  fi
done

# Programs from Debian packages, unpacked here (not installed).
if [ -n "$TOOLS" ]; then
  debs=$(mktemp -d)
  for t in $TOOLS; do
    pkg=${t%%:*} path=${t#*:}
    if [ ! -d "$debs/$pkg" ]; then
      if ! (cd "$debs" && apt-get download "$pkg" >/dev/null 2>&1); then
        echo "gpu_bundle: apt-get download $pkg failed, $path left out" >&2
        continue
      fi
      deb=$(ls "$debs"/"${pkg}"_*.deb | head -1)
      arch=$(dpkg-deb -f "$deb" Architecture)
      if [ "$arch" != amd64 ]; then
        echo "gpu_bundle: $pkg is $arch, not amd64: $path left out" >&2
        continue
      fi
      dpkg-deb -x "$deb" "$debs/$pkg"
      basename "$deb" >>"$DEST/tools"
    fi
    [ -x "$debs/$pkg/$path" ] || { echo "gpu_bundle: $pkg has no $path" >&2; continue; }
    strip --strip-all -o "$DEST/bin/$(basename "$path")" "$debs/$pkg/$path"
    bins+=("$debs/$pkg/$path")
  done
fi

# The Python package with the SDK client, where the build made its extension for the device's
# Python (3.12; configure with -DPython_EXECUTABLE=<a python3.12> -DKVCOMP_PYTHON_PACKAGE_DIR=
# <build>/pkg and build _kvcomp too): python/kvcomp, named by env.sh as KVCOMP_BUNDLE_PYTHON.
ext=""  # KVCOMP_BUNDLE_PYTHON=0 leaves it out
[ "${KVCOMP_BUNDLE_PYTHON:-1}" = 0 ] ||
  ext=$(ls "$BUILD"/pkg/kvcomp/_kvcomp.cpython-*.so 2>/dev/null | head -1 || true)
if [ -n "$ext" ]; then
  mkdir -p "$DEST/python/kvcomp/integrations"
  cp client/python/kvcomp/*.py "$DEST/python/kvcomp/"
  cp client/python/kvcomp/integrations/*.py "$DEST/python/kvcomp/integrations/"
  strip --strip-unneeded -o "$DEST/python/kvcomp/$(basename "$ext")" "$ext"
  bins+=("$ext")
else
  echo "gpu_bundle: no Python extension in $BUILD/pkg, the bundle has no Python package" >&2
fi

# UCX loads its transport modules from <libucs dir>/ucx or UCX_MODULE_DIR. Shared memory (cma)
# and TCP are what loopback needs; the InfiniBand and RDMA-CM modules need verbs libraries that
# a machine without those adapters does not have, so they stay behind.
ucx_modules=()
for m in /usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so.0; do
  [ -e "$m" ] || continue
  cp -L "$m" "$DEST/lib/ucx/"
  ucx_modules+=("$m")
done

# Every library the binaries and modules load (ldd resolves the whole tree), by soname.
ldd "${bins[@]}" "${ucx_modules[@]}" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' |
  sort -u | while read -r soname path; do
    if [[ "$soname" =~ $SKIP ]]; then continue; fi
    [ -e "$DEST/lib/$soname" ] || strip --strip-unneeded -o "$DEST/lib/$soname" "$path"
  done
missing=$(ldd "${bins[@]}" 2>/dev/null | grep 'not found' | grep -v 'libpython' | sort -u || true)
if [ -n "$missing" ]; then
  echo "gpu_bundle: unresolved here too:" >&2
  echo "$missing" >&2
  exit 1
fi

# The newest glibc symbol version anything in the bundle asks for.
objdump -T "$DEST"/bin/* "$DEST"/lib/*.so* "$DEST"/lib/ucx/* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' |
  sort -uV | tail -1 >"$DEST/glibc_needed"
[ -n "${debs:-}" ] && rm -rf "$debs"

# The integration tests start the kvcompd whose path was compiled in; run.sh links that path to
# the bundle's copy on the device.
realpath "$BUILD/service/kvcompd" >"$DEST/kvcompd_build_path"
# The GPU channel's test starts its peer process by the path it was built at, too.
if [ -x "$BUILD/tests/client/gpu_channel_peer" ]; then
  realpath "$BUILD/tests/client/gpu_channel_peer" >"$DEST/gpu_channel_peer_build_path"
fi
# The commit the binaries were built from (the build's source tree; "+changes" when it had any).
src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt")
{
  git -C "$src" rev-parse --short HEAD 2>/dev/null || echo unknown
  git -C "$src" status --porcelain 2>/dev/null | grep -q . && echo "+changes" || true
} | tr -d '\n' >"$DEST/commit"
cat >"$DEST/env.sh" <<'EOF'
# Sourced by bench/gpu/run.sh on the device: the bundle's libraries first, then CUDA's.
KVCOMP_BUNDLE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export KVCOMP_BUNDLE
export LD_LIBRARY_PATH=$KVCOMP_BUNDLE/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_MODULE_DIR=$KVCOMP_BUNDLE/lib/ucx
export PATH=$KVCOMP_BUNDLE/bin:$PATH
if [ -d "$KVCOMP_BUNDLE/python" ]; then export KVCOMP_BUNDLE_PYTHON=$KVCOMP_BUNDLE/python; fi
EOF

rm -f "$PACK"
mkdir -p "$(dirname "$PACK")"
# One stream with a dictionary larger than the bundle: the binaries share their device code, so xz
# finds it again across files (about 15 MiB instead of 47).
tar -C "$DEST" -cf - . | xz -T1 --lzma2=preset=6,dict=128MiB >"$PACK"
size_mib=$(( $(stat -c %s "$PACK") / 1048576 + 1 ))
echo "gpu_bundle: $(ls "$DEST/bin" | wc -l) binaries, $(ls "$DEST/lib" | grep -c '\.so') libraries," \
  "$(du -sm "$DEST" | cut -f1) MiB in $DEST, ${size_mib} MiB packed in $PACK"
du -sh "$DEST"/bin/* "$DEST"/lib/* 2>/dev/null | sort -h | tail -6
if [ "$size_mib" -gt "$LIMIT_MIB" ]; then
  echo "gpu_bundle: $PACK is larger than ${LIMIT_MIB} MiB; a GPU run carries 64 MiB with the tree" >&2
  exit 1
fi
