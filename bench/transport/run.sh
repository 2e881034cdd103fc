#!/usr/bin/env bash
# Data-plane ingest throughput next to ucx_perftest, same transport, same run. For each UCX_TLS
# setting, alternately runs `ucx_perftest -t ucp_am_bw -s 1048576` (UCX's own active-message
# bandwidth, two processes) and kvcomp_transport_bench (UcxClient -> UcxServer with 1 MiB
# blocks, CRC32C on both ends, per-block acknowledgement, two processes), REPS times each, and
# records the medians and their ratio in bench/results/transport_<date>.md. Then the get latency
# of a cache the server lends, per setting, and the stored get of a Llama-3.1-8B-shaped cache
# from a real kvcompd over each link, against the transfer time of its bytes at ucx_perftest's
# shared-memory rate of the same run.
#
#   bash bench/transport/run.sh [build-dir]
#
# Knobs: KVCOMP_TLS_LIST (default "tcp sm,tcp:shm sm,tcp:shm-regions sm,tcp"): UCX_TLS,
# optionally with a mode: ":noerr" runs kvcomp with UcxConfig::peer_error_handling off (UCX may
# then use cma), ":noverify" runs the server without checking the blocks' CRC32C (the client
# still computes them), ":shm" moves kvcomp's payloads over the same-host shared-memory link in direct
# mode (one copy), ":shm-regions" over its memfd regions (two copies); the perftest beside them
# runs with the UCX_TLS part; a mode may end in "/N": the server copies shared-memory blocks on
# N threads (data_plane.shm_copy_lanes; default its own, one per 4 CPUs) and the client copies
# blocks into its put region on N (ClientOptions::shm_copy_lanes); "/N/C": the client on C.
# KVCOMP_BLOCKS (2000), KVCOMP_REPS (3), KVCOMP_WINDOW (blocks in
# flight, 16), KVCOMP_VERIFY (server CRC check, 1), KVCOMP_GET_BYTES (get-latency cache size,
# 256 MiB; 0 skips), KVCOMP_GETS (10), KVCOMP_STORED_TOKENS (the stored cache's tokens, 8192;
# 0 skips; needs <build>/service/kvcompd), KVCOMP_STORED_GETS (its gets per call and link,
# KVCOMP_GETS), KVCOMP_RESULTS (the results file, default bench/results/transport_<date>.md;
# appended to when it exists), KVCOMP_COMMIT (the commit, where the tree has no git),
# KVCOMP_STORED_LANES (the daemon's data_plane.shm_copy_lanes for the stored get, a list; default
# "0", its default; each further value another daemon and put, timed over shm-direct only).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD=${1:-$ROOT/build-transport}
BENCH=$BUILD/bench/transport/kvcomp_transport_bench
TLS_LIST=${KVCOMP_TLS_LIST:-tcp sm,tcp:shm sm,tcp:shm-regions sm,tcp}
BLOCKS=${KVCOMP_BLOCKS:-2000}
REPS=${KVCOMP_REPS:-3}
WINDOW=${KVCOMP_WINDOW:-16}
VERIFY=${KVCOMP_VERIFY:-1}
GET_BYTES=${KVCOMP_GET_BYTES:-268435456}  # get latency: cache size (0 skips)
GETS=${KVCOMP_GETS:-10}
STORED_TOKENS=${KVCOMP_STORED_TOKENS:-8192}
STORED_GETS=${KVCOMP_STORED_GETS:-$GETS}
STORED_LANES=${KVCOMP_STORED_LANES:-0}
KVCOMPD=$BUILD/service/kvcompd

if [ ! -x "$BENCH" ]; then
  cmake --build "$BUILD" --target kvcomp_transport_bench >/dev/null
fi
command -v ucx_perftest >/dev/null || { echo "run.sh: ucx_perftest missing (apt ucx-utils)" >&2; exit 2; }

PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# "sm,tcp:shm" -> UCX_TLS "sm,tcp", mode "shm"; kvcomp's flags for a mode.
tls_of() { echo "${1%%:*}"; }
mode_of() { case "$1" in *:*) local m=${1#*:}; echo "${m%%/*}" ;; *) echo "" ;; esac; }
# "mode/S": the server's copy lanes S and the client's S; "mode/S/C": the client's C.
lanes_of() { case "$1" in *:*/*) local m=${1#*/}; echo "${m%%/*}" ;; *) echo 0 ;; esac; }
client_lanes_of() {
  case "$1" in *:*/*/*) echo "${1##*/}" ;; *:*/*) lanes_of "$1" ;; *) echo 0 ;; esac
}
mode_flags() {
  case "$(mode_of "$1")" in
    noerr) echo "--peer_errors=0" ;;
    shm) echo "--link=shm" ;;
    shm-regions) echo "--link=shm --shm_direct=0" ;;
    *) echo "" ;;
  esac
}
server_flags() {
  local f
  f="--shm_copy_lanes=$(lanes_of "$1")"
  [ "$(mode_of "$1")" = noerr ] && f="$f --peer_errors=0"
  if [ "$(mode_of "$1")" = noverify ]; then f="$f --verify=0"; else f="$f --verify=$VERIFY"; fi
  echo "$f"
}
load() { cut -d' ' -f1 /proc/loadavg; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# ucx_perftest's overall bandwidth in MiB/s (it prints MB/s meaning 2^20 bytes).
perftest_once() {
  local tls port log size=${2:-1048576} n=${3:-$BLOCKS}
  tls=$(tls_of "$1")
  port=$(free_port)
  log=$(mktemp)
  UCX_TLS=$tls ucx_perftest -p "$port" >"$log" 2>&1 &
  local sp=$!
  PIDS+=("$sp")
  sleep 0.5
  local line
  line=$(UCX_TLS=$tls timeout 300 ucx_perftest 127.0.0.1 -p "$port" -t ucp_am_bw -s "$size" \
           -n "$n" -w $((n < 100 ? 5 : 100)) 2>&1 | grep -E '^Final:' || true)
  wait "$sp" 2>/dev/null || true
  rm -f "$log"
  # Final: iters typ_lat avg_lat overall_lat avg_bw overall_bw avg_mr overall_mr
  echo "$line" | awk '{print $7}'
}

# kvcomp's ingest in MiB/s.
kvcomp_once() {
  local tls out
  tls=$(tls_of "$1")
  out=$(mktemp)
  # shellcheck disable=SC2046
  UCX_TLS=$tls "$BENCH" server $(server_flags "$1") >"$out" 2>&1 &
  local sp=$!
  PIDS+=("$sp")
  local port=""
  for _ in $(seq 50); do
    port=$(awk '/^PORT/{print $2}' "$out")
    [ -n "$port" ] && break
    sleep 0.1
  done
  local line
  # shellcheck disable=SC2046
  line=$(UCX_TLS=$tls timeout 300 "$BENCH" client "$port" --blocks="$BLOCKS" --window="$WINDOW" \
           $(mode_flags "$1") --shm_copy_lanes="$(client_lanes_of "$1")" 2>&1 |
           grep -E '^RESULT' || true)
  kill "$sp" 2>/dev/null || true
  wait "$sp" 2>/dev/null || true
  rm -f "$out"
  echo "$line" | sed -E 's/.*MiBps=([0-9.]+).*/\1/'
}

# Get latency of a GET_BYTES cache: "p50 p99 p50_into p99_into" in ms.
get_once() {
  local tls out
  tls=$(tls_of "$1")
  out=$(mktemp)
  # shellcheck disable=SC2046
  UCX_TLS=$tls "$BENCH" server --get_bytes="$GET_BYTES" $(server_flags "$1") >"$out" 2>&1 &
  local sp=$!
  PIDS+=("$sp")
  local port=""
  for _ in $(seq 100); do
    port=$(awk '/^PORT/{print $2}' "$out")
    [ -n "$port" ] && break
    sleep 0.1
  done
  # shellcheck disable=SC2046
  UCX_TLS=$tls timeout 600 "$BENCH" client "$port" --gets="$GETS" $(mode_flags "$1") 2>&1 |
    grep -E '^RESULT' | sed -E 's/.*get_p50_ms=([0-9.]+) get_p99_ms=([0-9.]+) getinto_p50_ms=([0-9.]+) getinto_p99_ms=([0-9.]+).*/\1 \2 \3 \4/' || true
  kill "$sp" 2>/dev/null || true
  wait "$sp" 2>/dev/null || true
  rm -f "$out"
}

median() { printf '%s\n' "$@" | grep -E '^[0-9.]+$' | sort -g | awk '{a[NR]=$1} END {if (NR==0) print "nan"; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }

DATE=$(date -u +%Y-%m-%d)
STAMP=$(date -u +%Y-%m-%dT%H:%M:%SZ)
if [ -n "${KVCOMP_COMMIT:-}" ]; then
  COMMIT=$KVCOMP_COMMIT
else
  COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  DIRTY=$(git status --porcelain -- transport bench/transport 2>/dev/null | head -1)
  [ -n "$DIRTY" ] && COMMIT="$COMMIT+dirty(transport)"
fi
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
MACHINE="$(hostname 2>/dev/null || cat /proc/sys/kernel/hostname), $(nproc) cores, $CPU, $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
# "# Version 1.13.1" (Debian's UCX) or "# Library version: 1.22.0" (newer releases)
UCXV=$(ucx_info -v | awk '/^# (Library )?[Vv]ersion/{print $NF; exit}')
RESULTS=${KVCOMP_RESULTS:-$ROOT/bench/results/transport_$DATE.md}

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
  echo "- \":noverify\": the server does not check the blocks' CRC32C (the client still computes them)."
  echo "- one thread here: $("$BENCH" crc 2>/dev/null | sed -E 's/^RESULT //; s/ \(checksum.*//') (1 MiB"
  echo "  pieces of 256 MiB buffers; the server checks a block's CRC32C on its copy threads)."
  echo "- \":shm\": kvcomp's blocks over the same-host shared-memory link (transport/shm_link.h),"
  echo "  direct mode: the server reads each block from the client's memory (one copy, no CRC);"
  echo "  \":shm-regions\": through the client's memfd put region (the client's copy in, the"
  echo "  server's copy out). Requests, acknowledgements and peer error handling stay on UCX."
  echo "- \"/N\" after a mode: the server copies shared-memory blocks on N threads"
  echo "  (data_plane.shm_copy_lanes) and the client copies each block into its put region on N"
  echo "  (ClientOptions::shm_copy_lanes, regions only); \"/N/C\": the client on C. Without it,"
  echo "  each end's default: one per 4 CPUs, 1 to 4."
  echo "- $BLOCKS blocks per run, $REPS runs each, alternating; medians in MiB/s; load = the 1-minute"
  echo "  load average before each pair of runs."
  echo
  echo "| UCX_TLS | ucx_perftest MiB/s (runs) | kvcomp MiB/s (runs) | kvcomp / perftest | load |"
  echo "| --- | --- | --- | --- | --- |"
} >"$RESULTS.tmp"

SM_RATE=""
SM_RUNS=()
for tls in $TLS_LIST; do
  P=(); K=(); L=()
  for r in $(seq "$REPS"); do
    L+=("$(load)")
    P+=("$(perftest_once "$tls")")
    K+=("$(kvcomp_once "$tls")")
    echo "  $tls run $r: perftest ${P[-1]} MiB/s, kvcomp ${K[-1]} MiB/s" >&2
  done
  pm=$(median "${P[@]}")
  km=$(median "${K[@]}")
  ratio=$(awk -v a="$km" -v b="$pm" 'BEGIN{ if (b+0>0) printf "%.0f%%", 100*a/b; else print "n/a"}')
  echo "| $tls | $pm (${P[*]}) | $km (${K[*]}) | $ratio | ${L[*]} |" >>"$RESULTS.tmp"
  # ucx_perftest's shared-memory runs (every row of sm,tcp): their median is the reference of
  # the stored get below.
  if [ "$(tls_of "$tls")" = "sm,tcp" ]; then SM_RUNS+=("${P[@]}"); fi
done
[ "${#SM_RUNS[@]}" -gt 0 ] && SM_RATE=$(median "${SM_RUNS[@]}")

if [ "$GET_BYTES" != 0 ]; then
  {
    echo
    echo "Get latency of a $((GET_BYTES >> 20)) MiB cache (server lends the bytes, CRC32C on both"
    echo "ends; Get allocates a fresh host buffer, GetInto reuses one), $GETS gets after one warm-up:"
    echo
    echo "| UCX_TLS | Get p50 ms | Get p99 ms | GetInto p50 ms | GetInto p99 ms | load |"
    echo "| --- | --- | --- | --- | --- | --- |"
  } >>"$RESULTS.tmp"
  for tls in $TLS_LIST; do
    l=$(load)
    read -r g50 g99 i50 i99 <<<"$(get_once "$tls")"
    echo "  $tls get: p50 $g50 ms, p99 $g99 ms" >&2
    echo "| $tls | ${g50:-n/a} | ${g99:-n/a} | ${i50:-n/a} | ${i99:-n/a} | $l |" >>"$RESULTS.tmp"
  done
fi

# The stored get of a Llama-3.1-8B-shaped cache (bf16, STORED_TOKENS tokens, the daemon's
# default policy, host tier) from a real kvcompd, into one reused host buffer, over each link,
# against the transfer time of its bytes at ucx_perftest's sm,tcp rate measured above.
if [ "$STORED_TOKENS" != 0 ] && [ -x "$KVCOMPD" ]; then
  if [ ! -x "$BENCH" ]; then cmake --build "$BUILD" --target kvcomp_transport_bench >/dev/null; fi
  OUT=""
  LOADS=""
  first=1
  for lanes in $STORED_LANES; do
    modes=shm-direct,shm-regions,ucx
    [ "$first" = 1 ] || modes=shm-direct
    DDIR=$(mktemp -d /tmp/kvcomp-transport-stored-XXXXXX)
    UCX_TLS=sm,tcp "$KVCOMPD" --data_plane.port=0 --control_plane.port=0 --metrics.port=0 \
      --storage.data_dir="$DDIR/data" --process.ready_file="$DDIR/ready.yaml" \
      --storage.durability=memory --storage.host_capacity_bytes=4Gi \
      --data_plane.shm_copy_lanes="$lanes" >"$DDIR/log" 2>&1 &
    KP=$!
    PIDS+=("$KP")
    for _ in $(seq 300); do [ -s "$DDIR/ready.yaml" ] && break; sleep 0.1; done
    DPORT=$(awk '/data_port:/{print $2}' "$DDIR/ready.yaml" 2>/dev/null)
    LOADS="$LOADS $(load)"
    ONE=$(UCX_TLS=sm,tcp timeout 900 "$BENCH" stored "127.0.0.1:$DPORT" --tokens="$STORED_TOKENS" \
            --gets="$STORED_GETS" --modes="$modes" 2>&1 || true)
    kill "$KP" 2>/dev/null || true
    wait "$KP" 2>/dev/null || true
    rm -rf "$DDIR"
    echo "$ONE" | grep -E '^(PUT|RESULT)' >&2 || echo "$ONE" | tail -3 >&2
    # Each result line with the lanes it ran with ("0": the daemon's default for this machine).
    OUT="$OUT"$'\n'"$(echo "$ONE" | sed -E "s/^(RESULT|PUT) /\1 lanes=$lanes /")"
    first=0
  done
  SB=$(echo "$OUT" | awk '/^PUT/{for(i=1;i<=NF;i++) if ($i ~ /^stored_bytes=/) {sub("stored_bytes=","",$i); print $i}}' | head -1)
  {
    echo
    echo "Stored get of a Llama-3.1-8B-shaped cache from kvcompd ($STORED_TOKENS tokens, bf16, the"
    echo "daemon's default policy, host tier, durability memory; ${SB:-?} stored bytes): GetInto one"
    echo "reused host buffer through the payload links, and Get into a new buffer each time (its"
    echo "size unknown beforehand, as the SDK's Get and GetBytes), $STORED_GETS of each after one warm-up;"
    echo "load$LOADS (one per daemon below)."
    echo "Reference: the transfer time of its bytes at ucx_perftest's sm,tcp rate above (the"
    echo "median of its ${#SM_RUNS[@]} runs in this run: ${SM_RATE:-n/a} MiB/s); the target is a get within 2x"
    echo "of it."
    echo
    # The same perftest with 64 MiB messages: buffers far larger than the caches, as the stored
    # get's are (the 1 MiB messages above are served from the CPU's caches).
    BIG=()
    for _ in $(seq "$REPS"); do BIG+=("$(perftest_once sm,tcp 67108864 40)"); done
    echo "ucx_perftest sm,tcp with 64 MiB messages (40 per run, $REPS runs): $(median "${BIG[@]}") MiB/s"
    echo "(${BIG[*]}), for comparison: the stored get moves $((${SB:-0} >> 20)) MiB at once."
    echo
    echo "Copy lanes: the daemon's data_plane.shm_copy_lanes (0 = its default here: one per 4 CPUs,"
    echo "1 to 4: $(( $(nproc) / 4 < 1 ? 1 : ($(nproc) / 4 > 4 ? 4 : $(nproc) / 4) )) on this machine's $(nproc)); of what they carry (blocks copied out of a client's memory, received blocks' CRC32C, a direct get's lanes), only direct gets apply here."
    echo
    echo "| call | link | copy lanes | p50 ms | p99 ms | transfer at perftest sm rate, ms | p50 / transfer |"
    echo "| --- | --- | --- | --- | --- | --- | --- |"
    echo "$OUT" | grep -E '^RESULT lanes=[0-9]+ stored_bytes' | while read -r line; do
      call=GetInto
      case "$line" in *call=get*) call=Get ;; esac
      mode=$(echo "$line" | sed -E 's/.*mode=([^ ]+).*/\1/')
      lanes=$(echo "$line" | sed -E 's/.*lanes=([^ ]+).*/\1/')
      p50=$(echo "$line" | sed -E 's/.*p50_ms=([0-9.]+).*/\1/')
      p99=$(echo "$line" | sed -E 's/.*p99_ms=([0-9.]+).*/\1/')
      awk -v c="$call" -v m="$mode" -v k="$lanes" -v a="$p50" -v b="$p99" -v n="${SB:-0}" -v r="${SM_RATE:-0}" 'BEGIN{
        t = (r > 0) ? n / (r * 1048576) * 1000 : 0;
        printf "| %s | %s | %s | %s | %s | %.1f | %s |\n", c, m, (m == "shm-direct") ? k : "-", a, b, t, (t > 0) ? sprintf("%.2fx", a / t) : "n/a" }'
    done
  } >>"$RESULTS.tmp"
fi

if [ -f "$RESULTS" ]; then
  { echo; cat "$RESULTS.tmp"; } >>"$RESULTS"
  rm -f "$RESULTS.tmp"
else
  mv "$RESULTS.tmp" "$RESULTS"
fi
cat "$RESULTS"
