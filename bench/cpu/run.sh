#!/usr/bin/env bash
# Runs the CPU engine benchmark and records it in bench/results/ (JSON from Google Benchmark plus
# a Markdown table with GB/s, memcpy GB/s on the same threads, and their ratio), stamped with the
# date, the machine and the git commit. Usage: bench/cpu/run.sh [build-dir] [extra benchmark flags]
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
shift || true
BIN="$BUILD/bench/cpu/bench_cpu_scoring"
[ -x "$BIN" ] || cmake --build "$BUILD" --target bench_cpu_scoring
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
COMMIT=${KVCOMP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet -- kernels bench/cpu 2>/dev/null || echo "-dirty")}
# RESULTS_DIR: where the files go (default bench/results; on the device machine, $OUT).
RESULTS_DIR=${RESULTS_DIR:-bench/results}
mkdir -p "$RESULTS_DIR"
OUT=$RESULTS_DIR/cpu_scoring_${STAMP}
# BM_Stage (the stages one at a time) and BM_AssembleKeys (the keys' sums where kvcompd makes
# them) run only when asked: --benchmark_filter=BM_Stage or BM_AssembleKeys (printed, not recorded).
"$BIN" --benchmark_filter='BM_(Memcpy|ScoreSelectCompact)/' \
  --benchmark_out="$OUT.json" --benchmark_out_format=json --benchmark_repetitions=3 \
  --benchmark_report_aggregates_only=true --benchmark_min_time=0.5 "$@"
python3 - "$OUT.json" "$OUT.md" "$COMMIT" <<'PY'
import json, platform, re, subprocess, sys
src, dst, commit = sys.argv[1:4]
data = json.load(open(src))
ctx = data["context"]
cpu = "unknown"
try:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
except OSError:
    pass
rows = {}
memcpy = {}
benches = data["benchmarks"]
if any(b.get("aggregate_name") == "median" for b in benches):
    benches = [b for b in benches if b.get("aggregate_name") == "median"]
for b in benches:
    m = re.match(r"BM_(\w+)/tokens:(\d+)/(?:scorer:(\d+)/)?threads:(\d+)", b["run_name"])
    if m is None:
        continue
    kind, tokens, scorer, _ = m.groups()
    threads = int(b["workers"])
    gbs = b["bytes_per_second"] / 1e9
    key = (int(tokens), threads)
    if kind == "Memcpy":
        memcpy[key] = gbs
    else:
        inrun = b.get("memcpy_bytes_per_second", float("nan")) / 1e9
        rows.setdefault(key, []).append((b.get("label", scorer), gbs, b["real_time"], inrun))
with open(dst, "w") as f:
    f.write(f"# CPU score + select + compact\n\n")
    f.write(f"- date: {ctx['date']}\n- commit: {commit}\n- machine: {platform.node()}, {cpu}, "
            f"{ctx['num_cpus']} CPUs, {ctx.get('mhz_per_cpu', '?')} MHz\n"
            f"- load average at start: {ctx.get('load_avg', '?')}\n"
            f"- shape: 8 kv heads, head_dim 128, bf16, ratio 0.5, one layer per iteration\n"
            f"- GB/s = (read K and V + write kept K and V) / time. memcpy GB/s = (read + write of "
            f"K and V) / time on the same threads, timed right after each iteration of the op "
            f"(interleaved, so both see the same load); ratio = GB/s / that memcpy GB/s. "
            f"'standalone memcpy' is BM_Memcpy, run separately. Median of 3 repetitions.\n\n")
    f.write("| tokens | threads | scorer | ms/layer | GB/s | memcpy GB/s | ratio | standalone memcpy GB/s |\n")
    f.write("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |\n")
    for key in sorted(rows):
        for name, gbs, ms, inrun in rows[key]:
            mc = memcpy.get(key, float("nan"))
            f.write(f"| {key[0]} | {key[1]} | {name} | {ms:.1f} | {gbs:.2f} | {inrun:.2f} | "
                    f"{gbs / inrun:.0%} | {mc:.2f} |\n")
print(open(dst).read())
PY
