#!/usr/bin/env bash
# kvcompd end to end: ingest (1 MiB blocks, pipelined) and get latency of a 32K-token
# Llama-3.1-8B-shaped cache, over UCX tcp and posix (shared memory), on this machine. Writes
# bench/results/service-<date>.yaml with the machine, the commit and both runs.
#   bash bench/service/run.sh [BUILD_DIR]     (env: INGEST_TOKENS, GET_TOKENS, GETS)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
BIN=$BUILD/bench/service/kvcompd_bench
KVCOMPD=$BUILD/service/kvcompd
[ -x "$BIN" ] && [ -x "$KVCOMPD" ] || { echo "build kvcompd_bench and kvcompd first" >&2; exit 2; }
OUT=bench/results/service-$(date -u +%Y%m%d-%H%M).yaml
{
  echo "# kvcompd end-to-end benchmark (bench/service/run.sh)"
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "commit: $(git rev-parse --short HEAD)$(git status --porcelain --untracked-files=no | grep -q . && echo +dirty || true)"
  echo "machine: \"$(uname -m), $(nproc) cpus, $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(free -g | awk '/Mem:/{print $2}') GiB\""
  echo "gpu: \"$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)\""
  echo "load_average_at_start: \"$(cut -d' ' -f1-3 /proc/loadavg)\""
  echo "note: client and daemon share the machine's cpus (and any other work running on it, see the load average); the daemon runs 1 compression worker, durability disk (RocksDB WAL synced)"
  echo "runs:"
} >"$OUT"
for tls in tcp posix,tcp; do
  echo "== $tls" >&2
  echo "  - |" >>"$OUT"
  "$BIN" --kvcompd "$KVCOMPD" --tls "$tls" --ingest_tokens "${INGEST_TOKENS:-8192}" \
      --tokens "${GET_TOKENS:-32768}" --gets "${GETS:-30}" | sed 's/^/    /' | tee -a "$OUT" >&2
done
echo "load_average_at_end: \"$(cut -d' ' -f1-3 /proc/loadavg)\"" >>"$OUT"
echo "wrote $OUT" >&2
