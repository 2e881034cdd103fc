#!/usr/bin/env bash
# Nsight Compute summaries of the GPU benchmarks' kernels, as text: per kernel launch its time,
# DRAM bytes read and written, DRAM throughput against the card's peak and active warps. Run on
# the GPU machine after bench/gpu/run.sh's build (BUILD is its build directory), e.g. as
#   KVCOMP_GPU_EXTRA='bash bench/gpu/ncu_profile.sh "$BUILD"' bash bench/gpu/run.sh
# Cases (KVCOMP_NCU_CASES, ';'-separated): "scoring TOKENS SCORER BATCH SUMS" profiles
# kvcomp_bench_gpu_scoring on that one case; "moments" and "decode" their benchmarks. Each case
# profiles the first KVCOMP_NCU_LAUNCHES launches (default 12) with caches flushed between
# kernels and the clocks left alone. "put TOKENS VARIANTS" profiles every kernel of one put of
# kvcomp_bench_gpu_device_codec (--put-only --profile: the staged put's CompressToDevice and
# EncodeOnDevice, after the timed runs; VARIANTS as KVCOMP_BENCH_VARIANTS) with the caches left
# as the put leaves them, and sums the launches by kernel (time, DRAM bytes, count), largest
# first, with the sum of every kernel's time.
set -uo pipefail
BUILD=${1:?build directory}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
LAUNCHES=${KVCOMP_NCU_LAUNCHES:-12}
CASES=${KVCOMP_NCU_CASES:-scoring 8192 knorm 1 0;scoring 8192 manifold 1 1;scoring 131072 knorm 1 0;scoring 131072 manifold 1 1;scoring 2048 knorm 64 0;moments;decode}
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size
[ -x "$NCU" ] || { echo "ncu_profile: no ncu ($NCU)"; exit 2; }
"$NCU" --version | tail -1
IFS=';' read -ra cases <<<"$CASES"
for c in "${cases[@]}"; do
  read -ra w <<<"$c"
  case ${w[0]} in
    scoring) cmd=("$BUILD/bench/gpu/kvcomp_bench_gpu_scoring" "${w[@]:1}") ;;
    moments) cmd=("$BUILD/bench/gpu/kvcomp_bench_gpu_moments" "${w[@]:1}") ;;
    decode) cmd=("$BUILD/bench/gpu/kvcomp_bench_gpu_decode" "${w[@]:1}") ;;
    put) cmd=(env KVCOMP_BENCH_VARIANTS="${w[2]:-}" "$BUILD/bench/gpu/kvcomp_bench_gpu_device_codec"
              --tokens "${w[1]:-8192}" --reps 1 --put-only --profile) ;;
    *) echo "ncu_profile: unknown case '$c'"; continue ;;
  esac
  echo "ncu case: $c"
  csv=$(mktemp)
  # Only the product's kernels (the benchmarks' own input generators are left out).
  if [ "${w[0]}" = put ]; then
    timeout 300 "$NCU" --clock-control none --cache-control none --profile-from-start off --csv \
      --kernel-name-base function --metrics "$METRICS" "${cmd[@]}" >"$csv" 2>/dev/null ||
      echo "  ncu exited $?"
  else
    timeout 300 "$NCU" --clock-control none --cache-control all -c "$LAUNCHES" --csv \
      --kernel-name-base function --kernel-name "regex:Kernel|CheckLists" \
      --metrics "$METRICS" "${cmd[@]}" >"$csv" 2>/dev/null || echo "  ncu exited $?"
  fi
  grep '^RESULT' "$csv" | sed 's/^/  /'
  python3 - "$csv" "${w[0]}" <<'PY'
import csv, io, sys
text = open(sys.argv[1]).read()
# ncu's CSV follows the program's own output: it starts at the header line.
start = text.find('"ID","Process ID"')
if start < 0:
    print("  no profile (see the program's output above)")
    sys.exit()
rows = {}
for r in csv.DictReader(io.StringIO(text[start:])):
    k = (int(r["ID"]), r["Kernel Name"])
    rows.setdefault(k, {})[r["Metric Name"]] = (r["Metric Unit"], r["Metric Value"].replace(",", ""))
def val(m, name, scale):
    unit, v = m.get(name, ("", "nan"))
    x = float(v)
    mult = {"ns": 1e-3, "nsecond": 1e-3, "us": 1, "usecond": 1, "ms": 1e3, "msecond": 1e3,
            "B": 1e-6, "byte": 1e-6, "KB": 1e-3, "Kbyte": 1e-3, "MB": 1, "Mbyte": 1,
            "GB": 1e3, "Gbyte": 1e3}.get(unit, 1)
    return x * mult if scale else x
if sys.argv[2] == "put":
    agg = {}
    for (i, name), m in rows.items():
        short = name.split("(")[0][:70]
        a = agg.setdefault(short, [0, 0.0, 0.0, 0.0])
        a[0] += 1
        a[1] += val(m, 'gpu__time_duration.sum', 1)
        a[2] += val(m, 'dram__bytes_read.sum', 1)
        a[3] += val(m, 'dram__bytes_write.sum', 1)
    total = sum(a[1] for a in agg.values())
    print(f"  kernels {sum(a[0] for a in agg.values())} launches, {total:.1f} us in all")
    print("  kernel launches time_us pct dram_read_MB dram_write_MB GBps")
    for short, a in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        gbps = (a[2] + a[3]) / a[1] * 1e3 if a[1] > 0 else 0.0
        print(f"  {short} {a[0]} {a[1]:.1f} {100 * a[1] / total:.1f} {a[2]:.1f} {a[3]:.1f} {gbps:.0f}")
    sys.exit()
print("  id kernel time_us dram_read_MB dram_write_MB dram_pct_peak warps_active_pct grid")
for (i, name), m in sorted(rows.items()):
    short = name.split("(")[0][:60]
    print(f"  {i} {short} {val(m, 'gpu__time_duration.sum', 1):.1f} "
          f"{val(m, 'dram__bytes_read.sum', 1):.1f} {val(m, 'dram__bytes_write.sum', 1):.1f} "
          f"{val(m, 'dram__throughput.avg.pct_of_peak_sustained_elapsed', 0):.1f} "
          f"{val(m, 'sm__warps_active.avg.pct_of_peak_sustained_active', 0):.1f} "
          f"{val(m, 'launch__grid_size', 0):.0f}")
PY
  rm -f "$csv"
done
