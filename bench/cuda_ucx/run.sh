#!/usr/bin/env bash
# On a GPU machine: device puts and gets over CUDA-aware UCX (UCX 1.22 of the libucx-cu13 wheel)
# from the bundle bench/cuda_ucx/bundle.sh made (carry=["build-cuda-ucx-pack"]): the transport's
# device-payload test, ucx_perftest between two processes with CUDA memory on both sides, and
# kvcomp_cuda_ucx_bench (checks and timings). Logs and a summary under $OUT.
#   KVCOMP_CUDA_UCX_DAEMON_DEVICE  the daemon's GPU (default 0, the client's; 1 on two GPUs)
#   KVCOMP_CUDA_UCX_TOKENS         tokens of the cache (default 32768)
#   KVCOMP_CUDA_UCX_REPS           timed repetitions (default 3)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/build-cuda-ucx-out}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
DD=${KVCOMP_CUDA_UCX_DAEMON_DEVICE:-0}
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
# server on the daemon's GPU, client on GPU 0.
perf() {
  local test=$1 port=$2
  CUDA_VISIBLE_DEVICES=$DD timeout 60 ucx_perftest -t "$test" -m cuda,cuda -s 67108864 -n 40 \
    -w 5 -p "$port" >"$OUT/perftest_${test}_server.log" 2>&1 &
  local spid=$!
  sleep 2
  CUDA_VISIBLE_DEVICES=0 timeout 60 ucx_perftest 127.0.0.1 -t "$test" -m cuda,cuda \
    -s 67108864 -n 40 -w 5 -p "$port" >"$OUT/perftest_${test}.log" 2>&1
  note "ucx_perftest $test exit $?: $(grep -E '^ +Final:|^[ ]*[0-9]+ +' "$OUT/perftest_${test}.log" | tail -1)"
  wait "$spid" 2>/dev/null
}
if [ "$DD" = 0 ]; then
  perf tag_bw 13337
  perf ucp_am_bw 13338
else
  # Two GPUs: each process sees both, the server's buffers on GPU 1 (CUDA_VISIBLE_DEVICES=1,0).
  CUDA_VISIBLE_DEVICES=1,0 timeout 60 ucx_perftest -t tag_bw -m cuda,cuda -s 67108864 -n 40 \
    -w 5 -p 13339 >"$OUT/perftest_tag_bw_server.log" 2>&1 &
  spid=$!
  sleep 2
  CUDA_VISIBLE_DEVICES=0,1 timeout 60 ucx_perftest 127.0.0.1 -t tag_bw -m cuda,cuda \
    -s 67108864 -n 40 -w 5 -p 13339 >"$OUT/perftest_tag_bw.log" 2>&1
  note "ucx_perftest tag_bw exit $?: $(grep -E '^ +Final:|^[ ]*[0-9]+ +' "$OUT/perftest_tag_bw.log" | tail -1)"
  wait "$spid" 2>/dev/null
fi

KVCOMP_UCX_EP_INFO=1 timeout 400 kvcomp_cuda_ucx_bench --kvcompd "$BUNDLE/bin/kvcompd" \
  --tokens "$TOKENS" --reps "${KVCOMP_CUDA_UCX_REPS:-3}" --daemon_device "$DD" \
  >"$OUT/bench.log" 2>&1
note "bench   exit $?"
grep -E '^(RESULT|CHECK|#)' "$OUT/bench.log" | tee -a "$SUMMARY"
echo "================ summary ================"
cat "$SUMMARY"
