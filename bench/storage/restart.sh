#!/usr/bin/env bash
# Restart time against the number of stored caches: for each count (default 500 and 15000
# caches of 96 KiB), fills a store once, then times TieredStore::Open with the payloads checked
# inside Open ("sync", what every open did before background verification) and checked in the
# background ("background", the daemon's mode), and the whole daemon from exec to ready on the
# same data. Writes bench/results/storage-restart-<date>.{jsonl,md} with date, machine, commit.
#   bench/storage/restart.sh [build dir] [scratch dir] [counts...]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-storage}
scratch=${2:-/tmp/kvcomp-restart-bench}
shift 2 || true
counts=("$@")
[[ ${#counts[@]} -gt 0 ]] || counts=(500 15000)
ninja -C "$build" -j 2 restart_bench kvcompd >/dev/null
bench="$build/bench/storage/restart_bench"
kvcompd="$build/service/kvcompd"
stamp=$(date -u +%Y-%m-%d-%H%M)
jsonl=bench/results/storage-restart-${stamp}.jsonl
md=bench/results/storage-restart-${stamp}.md
: >"$jsonl"

daemon_ready_s() {  # seconds from exec to the ready file, on data dir $1
  local data=$1 ready="$1.ready.yaml" log="$1.log"
  rm -f "$ready"
  local t0 t1
  t0=$(date +%s.%N)
  "$kvcompd" --storage.data_dir="$data" --process.ready_file="$ready" --data_plane.port=0 \
    --control_plane.port=0 --metrics.port=0 >"$log" 2>&1 &
  local pid=$!
  while [[ ! -s "$ready" ]]; do
    kill -0 "$pid" 2>/dev/null || { echo "kvcompd exited" >&2; tail "$log" >&2; return 1; }
    sleep 0.01
  done
  t1=$(date +%s.%N)
  kill -TERM "$pid"; wait "$pid" || true
  python3 -c "print(round($t1 - $t0, 3))"
}

for n in "${counts[@]}"; do
  dir="$scratch/$n"
  rm -rf "$dir"; mkdir -p "$dir"
  "$bench" --dir="$dir" --num="$n" --fill --repeat=0
  for mode in sync background; do
    "$bench" --dir="$dir" --num="$n" --verify="$mode" --repeat=3 | tee -a "$jsonl"
  done
  for r in 1 2 3; do
    s=$(daemon_ready_s "$dir")
    echo "{\"caches\": $n, \"daemon_exec_to_ready_s\": $s}" | tee -a "$jsonl"
  done
  rm -rf "$dir"
done

{
  echo "# Restart time against stored caches ($(date -u +%Y-%m-%d))"
  echo
  echo "Machine: $(nproc) vCPU $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
       "load average $(cut -d' ' -f1-3 /proc/loadavg) at the end; commit" \
       "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- storage service || echo ' with uncommitted storage/service changes')."
  echo "Caches of 96 KiB in a RocksDB-only store (blob files), page cache warm."
  echo
  python3 - "$jsonl" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
counts = sorted({r["caches"] for r in rows})
print("| caches | Open, payloads checked inside (s) | Open, checked in background (s) | background pass done after (s) | kvcompd exec to ready (s) |")
print("| --- | --- | --- | --- | --- |")
for n in counts:
    def med(mode, key):
        v = [r[key] for r in rows if r["caches"] == n and r.get("verify") == mode]
        return statistics.median(v) if v else float("nan")
    d = [r["daemon_exec_to_ready_s"] for r in rows if r["caches"] == n and "daemon_exec_to_ready_s" in r]
    print(f"| {n} | {med('sync','open_s'):.3f} | {med('background','open_s'):.3f} | "
          f"{med('background','all_verified_s'):.3f} | {statistics.median(d) if d else float('nan'):.3f} |")
print()
print("Medians of 3 runs each; raw lines in the .jsonl next to this file.")
PY
} >"$md"
cat "$md"
