#!/usr/bin/env bash
# What durable removals cost (docs/storage.md, "Durability"): runs `storage_bench --mode=churn`
# of this tree and, when given, of a baseline build (e.g. the commit before the change),
# alternately, REPS times each, for 64 KiB and 1 MiB values, and writes
# bench/results/storage-churn-<date>.{jsonl,md} with the date, machine, commits and medians.
#   bench/storage/churn.sh <storage_bench> [<baseline storage_bench> <baseline commit>] [scratch]
set -euo pipefail
cd "$(dirname "$0")/../.."
BENCH=${1:?storage_bench binary}
BASE=${2:-}
BASE_COMMIT=${3:-}
SCRATCH=${4:-/tmp/kvcomp_churn_bench}
REPS=${REPS:-3}
NUM=${NUM:-1000}
STAMP=$(date -u +%Y-%m-%dT%H%MZ)
OUT=bench/results/storage-churn-$(date -u +%Y-%m-%d-%H%M)
COMMIT=$(git rev-parse --short HEAD)$(git diff --quiet -- storage bench/storage || echo "+dirty")
mkdir -p "$SCRATCH"
: > "$OUT.jsonl"
run() {  # variant binary size num
  "$2" --mode=churn --dir="$SCRATCH" --value_size="$3" --num="$4" |
    sed "s/^{/{\"variant\":\"$1\",/" >> "$OUT.jsonl"
}
for size in 65536 1048576; do
  num=$NUM
  [ "$size" -gt 65536 ] && num=$((NUM / 4))
  for rep in $(seq "$REPS"); do
    run this "$BENCH" "$size" "$num"
    [ -n "$BASE" ] && run baseline "$BASE" "$size" "$num"
  done
done
# Syncs per case (fdatasync + fsync of the whole process, setup and open included), counted with
# strace once per variant at 64 KiB: a robust figure where timings on a shared VM are not.
: > "$OUT.syncs"
if command -v strace >/dev/null; then
  for case in churn_memory_puts_demote_evict churn_disk_puts_evict overwrite_disk_with_memory \
              overwrite_disk_with_memory_4_threads; do
    for variant in this baseline; do
      bin=$BENCH
      [ "$variant" = baseline ] && bin=$BASE
      [ -z "$bin" ] && continue
      strace -f -c -e trace=fdatasync,fsync -o "$SCRATCH/strace.txt" "$bin" --mode=churn \
        --dir="$SCRATCH" --value_size=65536 --num="$NUM" --only="$case" >/dev/null
      n=$(awk '$NF=="fdatasync"||$NF=="fsync"{s+=$4} END{print s+0}' "$SCRATCH/strace.txt")
      echo "$case $variant $n" >> "$OUT.syncs"
    done
  done
fi
python3 - "$OUT" "$STAMP" "$COMMIT" "$BASE_COMMIT" <<'PY'
import json, statistics, sys, os, platform, subprocess
out, stamp, commit, base_commit = sys.argv[1:5]
rows = [json.loads(l) for l in open(out + ".jsonl")]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
load = open("/proc/loadavg").read().split()[:3]
groups = {}
for r in rows:
    groups.setdefault((r["bench"], r["value_size"], r["variant"]), []).append(r["ops_per_s"])
lines = [f"# Storage churn: cost of durable removals ({stamp})", "",
         f"- machine: {cpu}, {os.cpu_count()} vCPUs, load average at the end {' '.join(load)}",
         f"- this: {commit}; baseline: {base_commit or 'none'}",
         f"- medians of ops/s over the repetitions (raw lines in {os.path.basename(out)}.jsonl)", "",
         "| bench | value | this ops/s | baseline ops/s | this / baseline |", "| --- | --- | --- | --- | --- |"]
for (bench, size, variant), v in sorted(groups.items()):
    if variant != "this":
        continue
    this = statistics.median(v)
    base = groups.get((bench, size, "baseline"))
    b = statistics.median(base) if base else None
    ratio = f"{this / b:.2f}" if b else "-"
    lines.append(f"| {bench} | {size // 1024} KiB | {this:.0f} | {b:.0f} | {ratio} |" if b
                 else f"| {bench} | {size // 1024} KiB | {this:.0f} | - | - |")
syncs = {}
for l in open(out + ".syncs"):
    case, variant, n = l.split()
    syncs.setdefault(case, {})[variant] = int(n)
if syncs:
    lines += ["", "WAL and file syncs per case at 64 KiB (fdatasync + fsync counted by strace over the",
              "whole process, including the store's open and each case's untimed setup):", "",
              "| case | this | baseline | extra |", "| --- | --- | --- | --- |"]
    for case, v in syncs.items():
        t, b = v.get("this"), v.get("baseline")
        extra = t - b if t is not None and b is not None else "-"
        lines.append(f"| {case} | {t} | {b if b is not None else '-'} | {extra} |")
open(out + ".md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
