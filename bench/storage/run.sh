#!/usr/bin/env bash
# Storage benchmarks: put/get GB/s of the RocksDB tier for 64 KiB, 1 MiB and 16 MiB
# values next to RocksDB's own db_bench given the same options, in the same run on the same disk;
# and the host tier next to memcpy. Writes bench/results/storage-<date>-<HHMM>.{jsonl,md} with the date,
# machine and commit.
#   bench/storage/run.sh [build dir (default build)] [scratch dir (default /tmp/kvcomp_storage_bench)]
# KVCOMP_BENCH_MB sets the bytes written per case (default 512 MiB; a quarter for synced puts),
# KVCOMP_BENCH_REPS the repetitions (default 3; medians reported).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
SCRATCH=${2:-/tmp/kvcomp_storage_bench}
TOTAL_MB=${KVCOMP_BENCH_MB:-512}
SYNC_MB=$((TOTAL_MB / 4))
REPS=${KVCOMP_BENCH_REPS:-3}  # repetitions of the RocksDB cases; the tables show medians
BENCH="$BUILD/bench/storage/storage_bench"
DB_BENCH=$(command -v db_bench || command -v rocksdb_db_bench || true)
[ -x "$BENCH" ] || cmake --build "$BUILD" --target storage_bench
[ -n "$DB_BENCH" ] || { echo "db_bench not found (apt package rocksdb-tools)"; exit 1; }
mkdir -p "$SCRATCH" bench/results
LOAD=$(cut -d' ' -f1-3 /proc/loadavg)
DATE=$(date -u +%Y-%m-%d)
OUT=bench/results/storage-$DATE-$(date -u +%H%M).jsonl
: > "$OUT"

# The options RocksDbTierOptions uses by default (storage/include/kvcomp/storage/options.h),
# spelled as db_bench flags. Everything else is each tool's default.
DB_FLAGS=(--compression_type=none --blob_compression_type=none --enable_blob_files=true
          --min_blob_size=65536 --enable_blob_garbage_collection=true
          --write_buffer_size=67108864 --cache_size=268435456 --max_background_jobs=2
          --key_size=16 --threads=1 --histogram=false)

run_db_bench() {  # size num sync
  local size=$1 num=$2 sync=$3
  rm -rf "$SCRATCH/db_bench"
  "$DB_BENCH" --db="$SCRATCH/db_bench" --benchmarks=filluniquerandom,readrandom \
    --value_size="$size" --num="$num" --sync="$sync" "${DB_FLAGS[@]}" 2>&1 |
    awk -v size="$size" -v num="$num" -v sync="$sync" '
      /^(filluniquerandom|readrandom) *:/ {
        for (i = 1; i <= NF; i++) if ($(i) == "MB/s") mbs = $(i - 1)
        name = ($1 == "readrandom") ? "db_bench_get" : "db_bench_put"
        printf "{\"bench\":\"%s\",\"value_size\":%d,\"num\":%d,\"sync\":%d,\"gb_per_s\":%.4f}\n",
               name, size, num, sync, mbs * 1048576 / 1e9
      }'
  rm -rf "$SCRATCH/db_bench"
}

for rep in $(seq 1 "$REPS"); do
for sync in 0 1; do
  mb=$TOTAL_MB
  [ "$sync" = 1 ] && mb=$SYNC_MB
  for size in 65536 1048576 16777216; do
    num=$((mb * 1048576 / size))
    echo "-- rocksdb: value $size bytes x $num, sync=$sync" >&2
    # Alternate the two, and write back the page cache before each, so neither starts while
    # the other's dirty pages are still being written.
    sync
    "$BENCH" --mode=rocksdb --dir="$SCRATCH" --value_size="$size" --num="$num" --sync="$sync" | tee -a "$OUT"
    sync
    run_db_bench "$size" "$num" "$sync" | tee -a "$OUT"
  done
done
done
for size in 65536 1048576 16777216; do
  num=$((TOTAL_MB * 1048576 / size))
  echo "-- host: value $size bytes x $num" >&2
  "$BENCH" --mode=host --value_size="$size" --num="$num" | tee -a "$OUT"
done

COMMIT=$(git rev-parse --short HEAD)
git diff --quiet HEAD -- storage bench/storage || COMMIT="$COMMIT+local-changes"
CPU=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
FS=$(df -T "$SCRATCH" | awk 'NR==2 {print $2 " on " $1}')
python3 - "$OUT" "$DATE" "$COMMIT" "$CPU" "$(nproc)" "$(free -g | awk '/Mem:/ {print $2}')" "$FS" \
  "$(uname -r)" "$TOTAL_MB" "$REPS" "$LOAD" <<'PY'
import json, sys
out, date, commit, cpu, cores, mem, fs, kernel, total_mb, reps, load = sys.argv[1:]
rows = [json.loads(l) for l in open(out) if l.strip()]
def get(bench, size, sync=0):
    v = sorted(r["gb_per_s"] for r in rows
               if r["bench"] == bench and r["value_size"] == size and r.get("sync", 0) == sync)
    return v[len(v) // 2] if v else None
sizes = [(65536, "64 KiB"), (1048576, "1 MiB"), (16777216, "16 MiB")]
md = [f"# Storage benchmarks, {date}", "",
      f"- commit: {commit}", f"- machine: {cpu}, {cores} cores, {mem} GiB RAM, kernel {kernel}",
      f"- load average at start (other work on the machine): {load}",
      f"- scratch disk: {fs}", f"- bytes per case: {total_mb} MiB (synced puts: a quarter); median of {reps} runs, alternating kvcomp and db_bench",
      "- RocksDB 7.8.3 (Debian); db_bench from rocksdb-tools with the tier's options as flags",
      "  (no compression, blob files for values >= 64 KiB, 64 MiB memtable, 256 MiB block cache,",
      "  2 background jobs, 16-byte keys, one thread); puts in unique random key order, gets random.",
      "- GB/s = 1e9 bytes of values per second. `tier` is RocksDbTier alone; `store` is TieredStore",
      "  over it (adds CRC32C of every payload on put and get, and the index).", ""]
for sync in (0, 1):
    md += [f"## RocksDB tier, WAL {'synced on every put' if sync else 'written, not synced'}", "",
           "| value | tier put | store put | db_bench put | tier/db_bench | tier get | store get | db_bench get | tier/db_bench |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for size, name in sizes:
        tp, sp, dp = get("rocksdb_tier_put", size, sync), get("store_rocksdb_put", size, sync), get("db_bench_put", size, sync)
        tg, sg, dg = get("rocksdb_tier_get", size, sync), get("store_rocksdb_get", size, sync), get("db_bench_get", size, sync)
        f = lambda x: "-" if x is None else f"{x:.2f}"
        r = lambda a, b: "-" if not a or not b else f"{100 * a / b:.0f}%"
        md.append(f"| {name} | {f(tp)} | {f(sp)} | {f(dp)} | {r(tp, dp)} | {f(tg)} | {f(sg)} | {f(dg)} | {r(tg, dg)} |")
    md.append("")
md += ["## Host tier next to memcpy (GB/s)", "",
       "| value | memcpy into new buffers | host tier put (copy in) | store put (host) | memcpy out | host tier get + copy out | store get + copy out |",
       "| --- | --- | --- | --- | --- | --- | --- |"]
for size, name in sizes:
    vals = [get(b, size) for b in ("memcpy_new_buffer", "host_tier_put_copy", "store_host_put",
                                     "memcpy_out", "host_tier_get_and_copy_out", "store_host_get_and_copy_out")]
    md.append(f"| {name} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in vals) + " |")
open(out.replace(".jsonl", ".md"), "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
echo "results: $OUT and ${OUT%.jsonl}.md"
