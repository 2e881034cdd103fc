#!/usr/bin/env bash
# Host transports and durable writes on a machine that has none of kvcomp's libraries (the GPU
# machine), from a bundle that scripts/gpu_bundle.sh makes of a CPU build: kvcompd,
# kvcomp_transport_bench, storage_bench, the libraries they load, and ucx_perftest, ucx_info and
# dd from Debian's packages. Runs, in one go and within a time budget:
#   1. bench/storage/durable.sh: durable puts (direct files, one and 4 putters) against dd's
#      fsync'd sequential write of the same bytes on the same disk;
#   2. bench/transport/run.sh: ingest over the shared-memory link (direct and regions) against
#      ucx_perftest sm,tcp, and over UCX tcp against ucx_perftest tcp; then the stored get of a
#      Llama-3.1-8B-shaped 8K cache from a real kvcompd against the transfer time of its bytes at
#      ucx_perftest's shared-memory rate of the same run, with the daemon's default copy lanes
#      for direct gets and with one lane (data_plane.shm_copy_lanes).
# Results (markdown and jsonl), the machine's description and the logs go to $OUT.
#
# Here (2 cores):
#   KVCOMP_BUNDLE_BINARIES="bench/transport/kvcomp_transport_bench bench/storage/storage_bench" \
#   KVCOMP_BUNDLE_PYTHON=0 KVCOMP_BUNDLE_DEST=build-host-bundle \
#   KVCOMP_BUNDLE_PACK=.dev/host/bundle.tar.xz bash scripts/gpu_bundle.sh build
#   OUT=/tmp/host-out bash bench/transport/device.sh .dev/host/bundle.tar.xz   # the same, here
# On the GPU machine:
#   run(command="bash bench/transport/device.sh .dev/host/bundle.tar.xz", carry=[".dev/host"])
#
# Knobs: KVCOMP_SCRIPTS_COMMIT, KVCOMP_HOST_SECONDS (whole budget, default 110), KVCOMP_HOST_STEPS (default
# "durable transport"), KVCOMP_DURABLE_SECONDS (default 30: no durable repetition starts later),
# KVCOMP_DURABLE_DIR (scratch; default the first of /var/tmp, the repository, /tmp not on tmpfs),
# and those of the two scripts (KVCOMP_BENCH_MB, KVCOMP_DURABLE_SIZES, KVCOMP_BENCH_REPS,
# KVCOMP_TLS_LIST, KVCOMP_REPS, KVCOMP_BLOCKS, KVCOMP_STORED_TOKENS, KVCOMP_STORED_GETS, ...),
# whose defaults here are sized for the budget.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD
PACK=${1:-.dev/host/bundle.tar.xz}
OUT=${OUT:-$ROOT/build-host-out}
BUDGET=${KVCOMP_HOST_SECONDS:-110}
STEPS=${KVCOMP_HOST_STEPS:-durable transport}
T0=$(date +%s)
mkdir -p "$OUT"
INFO=$OUT/machine.txt
LOG=$OUT/host.log
: >"$INFO"
: >"$LOG"
elapsed() { echo $(($(date +%s) - T0)); }
say() { echo "$*" | tee -a "$INFO"; }

[ -f "$PACK" ] || { echo "device.sh: $PACK missing (scripts/gpu_bundle.sh makes it)" >&2; exit 2; }
B=$(mktemp -d /tmp/kvcomp-host-XXXXXX)
trap 'rm -rf "$B"' EXIT
tar -C "$B" -xJf "$PACK" || { echo "device.sh: cannot unpack $PACK" >&2; exit 2; }

# The bundle's programs run with the bundle's libraries; everything else (python3, awk, git) with
# the machine's own: small wrappers that exec, so a wrapper's pid is the program's.
W=$B/wrap
mkdir -p "$W"
for p in "$B"/bin/*; do
  cat >"$W/$(basename "$p")" <<EOF
#!/bin/sh
LD_LIBRARY_PATH=$B/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH} UCX_MODULE_DIR=$B/lib/ucx exec $p "\$@"
EOF
  chmod +x "$W/$(basename "$p")"
done
export PATH=$W:$PATH
# The layout the two scripts expect of a build directory.
BUILD=$B/build
mkdir -p "$BUILD/bench/transport" "$BUILD/bench/storage" "$BUILD/service"
ln -s "$W/kvcomp_transport_bench" "$BUILD/bench/transport/kvcomp_transport_bench"
ln -s "$W/storage_bench" "$BUILD/bench/storage/storage_bench"
ln -s "$W/kvcompd" "$BUILD/service/kvcompd"

COMMIT="bundle $(cat "$B/commit" 2>/dev/null || echo unknown)"
# The scripts' commit: KVCOMP_SCRIPTS_COMMIT where the tree's git directory does not name it (the
# GPU machine's copy of the tree carries one that may name an older commit).
SCRIPTS=${KVCOMP_SCRIPTS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || true)}
[ -n "$SCRIPTS" ] && COMMIT="$COMMIT, scripts $SCRIPTS"
export KVCOMP_COMMIT=$COMMIT

say "date       $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say "commit     $COMMIT"
say "cpu        $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
say "memory     $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo) (MemTotal now)"
say "kernel     $(uname -r); $(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-?}")"
say "glibc      $(ldd --version 2>&1 | head -1 | awk '{print $NF}'); the bundle needs $(cat "$B/glibc_needed" 2>/dev/null | sed 's/GLIBC_//')"
say "gpu        $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo none)"
say "load       $(cut -d' ' -f1-3 /proc/loadavg)"
say "tools      $(tr '\n' ' ' <"$B/tools" 2>/dev/null)"
say "ucx        $(ucx_info -v 2>&1 | head -1)"
missing=$(LD_LIBRARY_PATH=$B/lib ldd "$B"/bin/* 2>&1 | grep 'not found' | sort -u)
[ -z "$missing" ] || say "unresolved $(echo $missing)"
{
  echo "--- lscpu"; lscpu 2>&1 | head -30
  echo "--- mounts"; findmnt -D 2>&1 | head -20 || df -hT 2>&1 | head -20
  echo "--- block"; lsblk -o NAME,SIZE,ROTA,TYPE,MOUNTPOINT 2>&1 | head -20
  echo "--- /dev/shm"; df -h /dev/shm 2>&1
  echo "--- ptrace"; cat /proc/sys/kernel/yama/ptrace_scope 2>&1
  echo "--- ucx_info -d (transports)"; ucx_info -d 2>&1 | grep -E 'Transport|Device' | head -30
} >>"$INFO" 2>&1

if [[ " $STEPS " == *" durable "* ]]; then
  dir=${KVCOMP_DURABLE_DIR:-}
  if [ -z "$dir" ]; then
    for d in /var/tmp "$ROOT" /tmp; do
      t=$(stat -f -c %T "$d" 2>/dev/null)
      if [ -n "$t" ] && [ "$t" != tmpfs ] && [ "$t" != ramfs ] && [ -w "$d" ]; then dir=$d; break; fi
    done
  fi
  dir=${dir:-/tmp}/kvcomp-durable-$$
  say "durable    scratch $dir ($(stat -f -c %T "$(dirname "$dir")"), $(df -h "$(dirname "$dir")" | awk 'NR==2{print $2 " size, " $4 " free"}')); from $(elapsed) s"
  KVCOMP_RESULTS_DIR=$OUT KVCOMP_BENCH_MB=${KVCOMP_BENCH_MB:-512} \
    KVCOMP_DURABLE_SIZES=${KVCOMP_DURABLE_SIZES:-16 64} KVCOMP_BENCH_REPS=${KVCOMP_BENCH_REPS:-3} \
    KVCOMP_DURABLE_WAL=${KVCOMP_DURABLE_WAL:-0} KVCOMP_DURABLE_SECONDS=${KVCOMP_DURABLE_SECONDS:-30} \
    timeout $((BUDGET - $(elapsed))) bash bench/storage/durable.sh "$BUILD" "$dir" >>"$LOG" 2>&1 ||
    say "durable    exited $?"
  rm -rf "$dir"
fi

if [[ " $STEPS " == *" transport "* ]]; then
  say "transport  from $(elapsed) s"
  KVCOMP_RESULTS=$OUT/transport.md KVCOMP_TLS_LIST=${KVCOMP_TLS_LIST:-tcp sm,tcp:shm sm,tcp:shm-regions} \
    KVCOMP_GET_BYTES=${KVCOMP_GET_BYTES:-0} KVCOMP_STORED_GETS=${KVCOMP_STORED_GETS:-5} \
    KVCOMP_STORED_LANES=${KVCOMP_STORED_LANES:-0 1} \
    timeout $((BUDGET - $(elapsed))) bash bench/transport/run.sh "$BUILD" >>"$LOG" 2>&1 ||
    say "transport  exited $?"
fi
say "done       $(elapsed) s; load $(cut -d' ' -f1-3 /proc/loadavg)"
echo
cat "$OUT"/storage-durable-*.md "$OUT/transport.md" 2>/dev/null || true
