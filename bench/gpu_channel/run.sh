#!/usr/bin/env bash
# On a GPU machine (two GPUs for the NCCL parts): the GPU channel's GPU test and benchmark from
# the bundle bench/gpu_channel/bundle.sh made (carry=["build-gpu-channel-pack"]). NCCL is PyTorch's
# (nvidia/nccl/lib of the machine's python), named to every process by KVCOMP_NCCL_LIBRARY;
# NVLink multicast stays off. Logs and a summary under $OUT.
#   KVCOMP_GPU_CHANNEL_STEPS  "test bench" (default); also "python" (the Python SDK's device
#                             path from torch tensors, tests/python/test_gpu_device_path.py, with
#                             the bundle's extension), "one" (one GPU: the C++ benchmark with the
#                             daemon on GPU 0, CUDA IPC, and bench/gpu_channel/ipc_bench.py),
#                             "cudaucx" (the Python device path over CUDA-aware UCX and the
#                             transport's device-payload test, with UCX 1.22 from the CUDA-UCX
#                             bundle: carry=["build-gpu-channel-pack", "build-cuda-ucx-pack"])
#   KVCOMP_GPU_CHANNEL_BACKEND / _TIER  kvcompd's engine and put tier (default cuda / device)
#   KVCOMP_GPU_CHANNEL_TOKENS tokens of the benchmark's cache (default 32768)
#   KVCOMP_GPU_CHANNEL_REPS   repetitions (default 3)
#   KVCOMP_GPU_CHANNEL_DEFAULT_PUTS  puts with the default policy, the first a warm-up (default 2)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/build-gpu-out}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
STEPS=" ${KVCOMP_GPU_CHANNEL_STEPS:-test bench} "
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
BUNDLE=$PWD/build-gpu-channel-bundle
rm -rf "$BUNDLE" && mkdir -p "$BUNDLE" &&
  tar -C "$BUNDLE" -xJf build-gpu-channel-pack/bundle.tar.xz || {
  note "no bundle (build-gpu-channel-pack/bundle.tar.xz: bench/gpu_channel/bundle.sh)"; exit 2; }
# shellcheck disable=SC1091
source "$BUNDLE/env.sh"
note "date    $(date -u +%Y-%m-%dT%H:%MZ)"
note "commit  ${KVCOMP_COMMIT:-?} (bundle built at $(cat "$BUNDLE/commit"))"
note "cards   $(nvidia-smi --query-gpu=name --format=csv,noheader | paste -sd, -)"
nvidia-smi topo -m >"$OUT/topo.txt" 2>&1
# The binaries' compiled-in paths of kvcompd and the peer point at the bundle's copies.
link() {
  local built=$1 real=$2
  if [ ! -e "$built" ] || [ -L "$built" ]; then
    mkdir -p "$(dirname "$built")" && ln -sf "$real" "$built"
  fi
}
link "$(cat "$BUNDLE/kvcompd.build_path")" "$BUNDLE/bin/kvcompd"
link "$(cat "$BUNDLE/gpu_channel_peer.build_path")" "$BUNDLE/bin/gpu_channel_peer"
if [ -z "${KVCOMP_NCCL_LIBRARY:-}" ]; then
  KVCOMP_NCCL_LIBRARY=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
  export KVCOMP_NCCL_LIBRARY
fi
note "nccl    ${KVCOMP_NCCL_LIBRARY:-not found}"
if [[ "$STEPS" == *" test "* ]]; then
  timeout 130 "$BUNDLE/bin/client_gpu_channel_gpu_test" 2>&1 | tee "$OUT/test.log" |
    grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]' | tee -a "$SUMMARY"
fi
BACKEND=${KVCOMP_GPU_CHANNEL_BACKEND:-cuda}
TIER=${KVCOMP_GPU_CHANNEL_TIER:-device}
if [[ "$STEPS" == *" python "* ]]; then
  if [ -n "${KVCOMP_BUNDLE_PYTHON:-}" ]; then
    KVCOMPD="$BUNDLE/bin/kvcompd" PYTHONPATH="$KVCOMP_BUNDLE_PYTHON:tests/python:tests/integration" \
      timeout 110 python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu_device_path.py \
      -rs -s >"$OUT/python.log" 2>&1
    note "python  exit $? ($(tail -1 "$OUT/python.log"))"
    grep -E 'took|kernel still|PASSED|FAILED|Error' "$OUT/python.log" | head -20 | tee -a "$SUMMARY"
  else
    note "python  no extension in the bundle"
  fi
fi
if [[ "$STEPS" == *" bench "* ]]; then
  timeout 120 "$BUNDLE/bin/kvcomp_gpu_channel_bench" --kvcompd "$BUNDLE/bin/kvcompd" \
    --tokens "${KVCOMP_GPU_CHANNEL_TOKENS:-32768}" --reps "${KVCOMP_GPU_CHANNEL_REPS:-3}" \
    --default_puts "${KVCOMP_GPU_CHANNEL_DEFAULT_PUTS:-2}" --backend "$BACKEND" --tier "$TIER" \
    >"$OUT/bench.log" 2>&1
  note "bench   exit $?"
  grep -E '^(RESULT|#)' "$OUT/bench.log" | tee -a "$SUMMARY"
fi
if [[ "$STEPS" == *" one "* ]]; then
  CUDA_VISIBLE_DEVICES=0 timeout 70 "$BUNDLE/bin/kvcomp_gpu_channel_bench" \
    --kvcompd "$BUNDLE/bin/kvcompd" --tokens "${KVCOMP_GPU_CHANNEL_TOKENS:-32768}" \
    --reps "${KVCOMP_GPU_CHANNEL_REPS:-3}" --default_puts 0 --backend "$BACKEND" --tier "$TIER" \
    --one_gpu >"$OUT/bench-one.log" 2>&1
  note "one     exit $?"
  grep -E '^(RESULT|#)' "$OUT/bench-one.log" | tee -a "$SUMMARY"
  if [ -n "${KVCOMP_BUNDLE_PYTHON:-}" ]; then
    CUDA_VISIBLE_DEVICES=0 PYTHONPATH="$KVCOMP_BUNDLE_PYTHON" timeout 70 python3 \
      bench/gpu_channel/ipc_bench.py --kvcompd "$BUNDLE/bin/kvcompd" \
      --tokens "${KVCOMP_GPU_CHANNEL_TOKENS:-32768}" --reps "${KVCOMP_GPU_CHANNEL_REPS:-3}" \
      --backend "$BACKEND" --tier "$TIER" >"$OUT/ipc-bench.log" 2>&1
    note "ipcpy   exit $?"
    grep -E '^(RESULT|#)' "$OUT/ipc-bench.log" | tee -a "$SUMMARY"
  fi
fi
if [[ "$STEPS" == *" cudaucx "* ]]; then
  # The Python SDK's device path over CUDA-aware UCX (tests/python/test_cuda_ucx_path.py) with
  # UCX 1.22 from the CUDA-UCX bundle (bench/cuda_ucx/bundle.sh, carry=["build-cuda-ucx-pack"])
  # in front of the channel bundle's UCX, then the transport's device-payload test.
  UCXB=$PWD/build-cuda-ucx-bundle
  if rm -rf "$UCXB" && mkdir -p "$UCXB" && tar -C "$UCXB" -xJf build-cuda-ucx-pack/bundle.tar.xz; then
    note "cudaucx bundle built at $(cat "$UCXB/commit")"
    if [ -n "${KVCOMP_BUNDLE_PYTHON:-}" ]; then
      LD_LIBRARY_PATH="$UCXB/lib:$LD_LIBRARY_PATH" UCX_MODULE_DIR="$UCXB/lib/ucx" \
        KVCOMP_TEST_CUDA_UCX=1 KVCOMPD="$BUNDLE/bin/kvcompd" \
        PYTHONPATH="$KVCOMP_BUNDLE_PYTHON:tests/python:tests/integration" timeout 120 python3 -m \
        pytest -q -p no:cacheprovider tests/python/test_cuda_ucx_path.py -rs -s \
        >"$OUT/cuda-ucx-python.log" 2>&1
      note "cudaucx python exit $? ($(tail -1 "$OUT/cuda-ucx-python.log"))"
      grep -E 'ucx-cuda|GPU channel|PASSED|FAILED|Error' "$OUT/cuda-ucx-python.log" | head -10 |
        tee -a "$SUMMARY"
    fi
    LD_LIBRARY_PATH="$UCXB/lib:$LD_LIBRARY_PATH" UCX_MODULE_DIR="$UCXB/lib/ucx" timeout 60 \
      "$UCXB/bin/transport_cuda_ucx_test" >"$OUT/cuda-ucx-transport.log" 2>&1
    note "cudaucx transport_cuda_ucx_test exit $?: $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' "$OUT/cuda-ucx-transport.log" | paste -sd' ' -)"
  else
    note "cudaucx no bundle (build-cuda-ucx-pack/bundle.tar.xz: bench/cuda_ucx/bundle.sh)"
  fi
fi
echo "================ summary ================"
cat "$SUMMARY"
