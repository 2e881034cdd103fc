#!/usr/bin/env bash
# The daemon bundle (scripts/gpu_bundle.sh) plus the GPU channel's GPU test, its peer process and
# its benchmark, for bench/gpu_channel/run.sh on a GPU machine. The GPU channel needs no CUDA
# build (the driver and NCCL are opened at run time), so any build directory with these targets
# does; a CUDA build also gives the daemon its CUDA engine.
#   cmake --build BUILD -j 2 --target kvcompd client_gpu_channel_gpu_test gpu_channel_peer \
#     kvcomp_gpu_channel_bench
#   bash bench/gpu_channel/bundle.sh BUILD
#   run(command="bash bench/gpu_channel/run.sh", carry=[".gpubundle"], kind="nvidia-h100-x2")
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:?build directory}
bash scripts/gpu_bundle.sh "$BUILD"
DEST=build-gpu-bundle
PACK=.gpubundle/bundle.tar.xz
extra=(tests/client/client_gpu_channel_gpu_test tests/client/gpu_channel_peer
       bench/gpu_channel/kvcomp_gpu_channel_bench)
for b in "${extra[@]}"; do
  [ -x "$BUILD/$b" ] || { echo "bundle: $BUILD/$b missing: build it first" >&2; exit 2; }
  strip --strip-all -o "$DEST/bin/$(basename "$b")" "$BUILD/$b"
  realpath "$BUILD/$b" >"$DEST/$(basename "$b").build_path"
done
# Their libraries beyond the daemon's (the same skip list as gpu_bundle.sh).
SKIP='^(linux-vdso|ld-linux-x86-64|libc|libm|libpthread|libdl|librt|libutil|libresolv|libstdc\+\+|libgcc_s|libcuda|libcudart)\.so'
ldd "${extra[@]/#/$BUILD/}" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r soname path; do
    [[ "$soname" =~ $SKIP ]] && continue
    [ -e "$DEST/lib/$soname" ] || strip --strip-unneeded -o "$DEST/lib/$soname" "$path"
  done
tar -C "$DEST" -cf - . | xz -T2 -6 >"$PACK"
echo "bundle: $(ls "$DEST/bin" | wc -l) binaries, $(( $(stat -c %s "$PACK") / 1048576 + 1 )) MiB packed"
