#!/usr/bin/env bash
# On a GPU machine: device puts and gets over CUDA-aware UCX (UCX 1.22 of the libucx-cu13 wheel)
# from the bundle bench/cuda_ucx/bundle.sh made (carry=["build-cuda-ucx-pack"]): the transport's
# device-payload test, ucx_perftest between two processes with CUDA memory on both sides, and
# kvcomp_cuda_ucx_bench (checks and timings). Logs and a summary under $OUT.
#   KVCOMP_CUDA_UCX_DAEMON_DEVICES the daemon's GPUs, one run each (default "0": the client's
#                                  GPU; "0 1" on two GPUs: also the other one, over cuda_ipc)
#   KVCOMP_CUDA_UCX_TOKENS         tokens of the cache (default 32768)
#   KVCOMP_CUDA_UCX_REPS           timed repetitions (default 2)
#   KVCOMP_CUDA_UCX_RECV           kvcompd's device receive buffers, one bench run each (default
#                                  "perblock pool": one buffer allocated and freed per block
#                                  (KVCOMP_DEVICE_RECV_POOL_BYTES=0), then the pooled buffers)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/build-cuda-ucx-out}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
DEVICES=${KVCOMP_CUDA_UCX_DAEMON_DEVICES:-0}
TOKENS=${KVCOMP_CUDA_UCX_TOKENS:-32768}
BUNDLE=$PWD/build-cuda-ucx-bundle
rm -rf "$BUNDLE" && mkdir -p "$BUNDLE" && tar -C "$BUNDLE" -xJf build-cuda-ucx-pack/bundle.tar.xz || {
  note "no bundle (build-cuda-ucx-pack/bundle.tar.xz: bench/cuda_ucx/bundle.sh)"; exit 2; }
# shellcheck disable=SC1091
source "$BUNDLE/env.sh"
note "date    $(date -u +%Y-%m-%dT%H:%MZ)"
note "commit  ${KVCOMP_COMMIT:-?} (bundle built at $(cat "$BUNDLE/commit"))"
note "cards   $(nvidia-smi --query-gpu=name --format=csv,noheader | paste -sd, -)"
note "ucx     $(ucx_info -v 2>&1 | head -1)"
ucx_info -d >"$OUT/ucx_info_d.txt" 2>&1
note "ucx tls $(grep -E '^# +Transport:' "$OUT/ucx_info_d.txt" | awk '{print $3}' | sort -u | paste -sd, -)"
# The kvcompd path compiled into the benchmark's defaults is not used: --kvcompd names the copy.

timeout 60 transport_cuda_ucx_test >"$OUT/transport_test.log" 2>&1
note "transport_cuda_ucx_test exit $?: $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' "$OUT/transport_test.log" | paste -sd' ' -)"

# ucx_perftest: 64 MiB messages (one layer's keys at 32K tokens), CUDA memory on both sides,
# the server's buffers on the daemon's GPU (listed first in its CUDA_VISIBLE_DEVICES), the
# client's on GPU 0; both processes see every GPU, as kvcompd and its client do.
all=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)
perf() {
  local test=$1 port=$2 dd=$3
  local order=$dd${all:+,$(echo "$all" | tr ',' '\n' | grep -vx "$dd" | paste -sd, -)}
  CUDA_VISIBLE_DEVICES=${order%,} timeout 60 ucx_perftest -t "$test" -m cuda,cuda -s 67108864 \
    -n 40 -w 5 -p "$port" >"$OUT/perftest_${test}_gpu${dd}_server.log" 2>&1 &
  local spid=$!
  sleep 2
  CUDA_VISIBLE_DEVICES=$all timeout 60 ucx_perftest 127.0.0.1 -t "$test" -m cuda,cuda \
    -s 67108864 -n 40 -w 5 -p "$port" >"$OUT/perftest_${test}_gpu${dd}.log" 2>&1
  note "ucx_perftest $test, server on GPU $dd: exit $?: $(grep -E '^ *Final:' "$OUT/perftest_${test}_gpu${dd}.log" | tail -1)"
  wait "$spid" 2>/dev/null
}
port=13337
for dd in $DEVICES; do
  perf tag_bw $port "$dd"
  perf ucp_am_bw $((port + 1)) "$dd"
  port=$((port + 2))
  for recv in ${KVCOMP_CUDA_UCX_RECV:-perblock pool}; do
    pool_env=()
    [ "$recv" = perblock ] && pool_env=(KVCOMP_DEVICE_RECV_POOL_BYTES=0)
    log=$OUT/bench_gpu${dd}_$recv.log
    env "${pool_env[@]}" KVCOMP_UCX_EP_INFO=1 timeout 300 kvcomp_cuda_ucx_bench \
      --kvcompd "$BUNDLE/bin/kvcompd" --tokens "$TOKENS" --reps "${KVCOMP_CUDA_UCX_REPS:-2}" \
      --daemon_device "$dd" >"$log" 2>&1
    note "bench, kvcompd on GPU $dd, receive buffers $recv: exit $?"
    grep -E '^(RESULT|CHECK|# [0-9]|# kvcompd|# all|# CHECKS|# blocks)' "$log" | tee -a "$SUMMARY"
    grep -E 'lane\[' "$log" | sort -u >"$OUT/lanes_gpu${dd}_$recv.txt"
  done
done
echo "================ summary ================"
cat "$SUMMARY"
