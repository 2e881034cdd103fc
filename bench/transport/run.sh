#!/usr/bin/env bash
# Data-plane ingest throughput next to ucx_perftest, same transport, same run. For each UCX_TLS
# setting, alternately runs `ucx_perftest -t ucp_am_bw -s 1048576` (UCX's own active-message
# bandwidth, two processes) and kvcomp_transport_bench (UcxClient -> UcxServer with 1 MiB
# blocks, CRC32C on both ends, per-block acknowledgement, two processes), REPS times each, and
# records the medians and their ratio in bench/results/transport_ingest_<date>.md.
#
#   bash bench/transport/run.sh [build-dir]
#
# Knobs: KVCOMP_TLS_LIST (default "tcp sm,tcp sm,tcp:noerr posix,tcp"; ":noerr" runs kvcomp
# with UcxConfig::peer_error_handling off, which lets UCX 1.13 use cma), KVCOMP_BLOCKS (2000), KVCOMP_REPS (3),
# KVCOMP_WINDOW (blocks in flight, 16), KVCOMP_VERIFY (server CRC check, 1), KVCOMP_GET_BYTES
# (get-latency cache size, 256 MiB; 0 skips), KVCOMP_GETS (10).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD=${1:-$ROOT/build-transport}
BENCH=$BUILD/bench/transport/kvcomp_transport_bench
TLS_LIST=${KVCOMP_TLS_LIST:-tcp sm,tcp sm,tcp:noerr posix,tcp}
BLOCKS=${KVCOMP_BLOCKS:-2000}
REPS=${KVCOMP_REPS:-3}
WINDOW=${KVCOMP_WINDOW:-16}
VERIFY=${KVCOMP_VERIFY:-1}
GET_BYTES=${KVCOMP_GET_BYTES:-268435456}  # get latency: cache size (0 skips)
GETS=${KVCOMP_GETS:-10}

if [ ! -x "$BENCH" ]; then
  cmake --build "$BUILD" --target kvcomp_transport_bench >/dev/null
fi
command -v ucx_perftest >/dev/null || { echo "run.sh: ucx_perftest missing (apt ucx-utils)" >&2; exit 2; }

PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# ucx_perftest's overall bandwidth in MiB/s (it prints MB/s meaning 2^20 bytes).
perftest_once() {
  local tls=${1%:noerr} port log
  port=$(free_port)
  log=$(mktemp)
  UCX_TLS=$tls ucx_perftest -p "$port" >"$log" 2>&1 &
  local sp=$!
  PIDS+=("$sp")
  sleep 0.5
  local line
  line=$(UCX_TLS=$tls timeout 300 ucx_perftest 127.0.0.1 -p "$port" -t ucp_am_bw -s 1048576 \
           -n "$BLOCKS" -w 100 2>&1 | grep -E '^Final:' || true)
  wait "$sp" 2>/dev/null || true
  rm -f "$log"
  # Final: iters typ_lat avg_lat overall_lat avg_bw overall_bw avg_mr overall_mr
  echo "$line" | awk '{print $7}'
}

# kvcomp's ingest in MiB/s.
kvcomp_once() {
  local tls=${1%:noerr} out peer=1
  [ "$tls" != "$1" ] && peer=0
  out=$(mktemp)
  UCX_TLS=$tls "$BENCH" server --verify="$VERIFY" --peer_errors=$peer >"$out" 2>&1 &
  local sp=$!
  PIDS+=("$sp")
  local port=""
  for _ in $(seq 50); do
    port=$(awk '/^PORT/{print $2}' "$out")
    [ -n "$port" ] && break
    sleep 0.1
  done
  local line
  line=$(UCX_TLS=$tls timeout 300 "$BENCH" client "$port" --blocks="$BLOCKS" --window="$WINDOW" \
           --peer_errors=$peer 2>&1 | grep -E '^RESULT' || true)
  kill "$sp" 2>/dev/null || true
  wait "$sp" 2>/dev/null || true
  rm -f "$out"
  echo "$line" | sed -E 's/.*MiBps=([0-9.]+).*/\1/'
}

# Get latency of a GET_BYTES cache: "p50 p99 p50_into p99_into" in ms.
get_once() {
  local tls=${1%:noerr} out peer=1
  [ "$tls" != "$1" ] && peer=0
  out=$(mktemp)
  UCX_TLS=$tls "$BENCH" server --get_bytes="$GET_BYTES" --peer_errors=$peer >"$out" 2>&1 &
  local sp=$!
  PIDS+=("$sp")
  local port=""
  for _ in $(seq 100); do
    port=$(awk '/^PORT/{print $2}' "$out")
    [ -n "$port" ] && break
    sleep 0.1
  done
  UCX_TLS=$tls timeout 600 "$BENCH" client "$port" --gets="$GETS" --peer_errors=$peer 2>&1 |
    grep -E '^RESULT' | sed -E 's/.*get_p50_ms=([0-9.]+) get_p99_ms=([0-9.]+) getinto_p50_ms=([0-9.]+) getinto_p99_ms=([0-9.]+).*/\1 \2 \3 \4/' || true
  kill "$sp" 2>/dev/null || true
  wait "$sp" 2>/dev/null || true
  rm -f "$out"
}

median() { printf '%s\n' "$@" | grep -E '^[0-9.]+$' | sort -g | awk '{a[NR]=$1} END {if (NR==0) print "nan"; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }

DATE=$(date -u +%Y-%m-%d)
STAMP=$(date -u +%Y-%m-%dT%H:%M:%SZ)
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
DIRTY=$(git status --porcelain -- transport bench/transport 2>/dev/null | head -1)
[ -n "$DIRTY" ] && COMMIT="$COMMIT+dirty(transport)"
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
MACHINE="$(hostname), $(nproc) cores, $CPU, $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
# "# Version 1.13.1" (Debian's UCX) or "# Library version: 1.22.0" (newer releases)
UCXV=$(ucx_info -v | awk '/^# (Library )?[Vv]ersion/{print $NF; exit}')
RESULTS=$ROOT/bench/results/transport_ingest_$DATE.md

{
  echo "# Data-plane ingest vs ucx_perftest ($STAMP)"
  echo
  echo "- machine: $MACHINE"
  echo "- commit: $COMMIT; UCX $UCXV; build: $(basename "$BUILD")"
  echo "- load average at start: $(cut -d' ' -f1-3 /proc/loadavg) (other work on the machine shares the cores)"
  echo "- kvcomp: UcxClient -> UcxServer, 1 MiB blocks (512 KiB K + 512 KiB V of a"
  echo "  Llama-3.1-8B-shaped put), $WINDOW blocks in flight, CRC32C computed by the client and"
  echo "  verified by the server (verify=$VERIFY), every block acknowledged after the handler took it."
  echo "- reference: ucx_perftest -t ucp_am_bw -s 1048576 -n $BLOCKS -w 100 (same UCX_TLS; perftest"
  echo "  uses no peer error handling, so UCX may pick cma for rendezvous on one host)."
  echo "- \":noerr\": kvcomp with UcxConfig::peer_error_handling=false on both sides (cma allowed)."
  echo "- $BLOCKS blocks per run, $REPS runs each, alternating; medians in MiB/s."
  echo
  echo "| UCX_TLS | ucx_perftest MiB/s (runs) | kvcomp MiB/s (runs) | kvcomp / perftest |"
  echo "| --- | --- | --- | --- |"
} >"$RESULTS.tmp"

for tls in $TLS_LIST; do
  P=(); K=()
  for r in $(seq "$REPS"); do
    P+=("$(perftest_once "$tls")")
    K+=("$(kvcomp_once "$tls")")
    echo "  $tls run $r: perftest ${P[-1]} MiB/s, kvcomp ${K[-1]} MiB/s" >&2
  done
  pm=$(median "${P[@]}")
  km=$(median "${K[@]}")
  ratio=$(awk -v a="$km" -v b="$pm" 'BEGIN{ if (b+0>0) printf "%.0f%%", 100*a/b; else print "n/a"}')
  echo "| $tls | $pm (${P[*]}) | $km (${K[*]}) | $ratio |" >>"$RESULTS.tmp"
done

if [ "$GET_BYTES" != 0 ]; then
  {
    echo
    echo "Get latency of a $((GET_BYTES >> 20)) MiB cache (server lends the bytes, CRC32C on both"
    echo "ends; Get allocates a fresh host buffer, GetInto reuses one), $GETS gets after one warm-up:"
    echo
    echo "| UCX_TLS | Get p50 ms | Get p99 ms | GetInto p50 ms | GetInto p99 ms |"
    echo "| --- | --- | --- | --- | --- |"
  } >>"$RESULTS.tmp"
  for tls in $TLS_LIST; do
    read -r g50 g99 i50 i99 <<<"$(get_once "$tls")"
    echo "  $tls get: p50 $g50 ms, p99 $g99 ms" >&2
    echo "| $tls | ${g50:-n/a} | ${g99:-n/a} | ${i50:-n/a} | ${i99:-n/a} |" >>"$RESULTS.tmp"
  done
fi

if [ -f "$RESULTS" ]; then
  { echo; cat "$RESULTS.tmp"; } >>"$RESULTS"
  rm -f "$RESULTS.tmp"
else
  mv "$RESULTS.tmp" "$RESULTS"
fi
cat "$RESULTS"
