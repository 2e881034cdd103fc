#!/usr/bin/env bash
# Two kvcompd builds back to back under one bench binary: kvcompd_bench --kvsplice (eviction and
# KVSplice puts, calibration through the SDK, gets, decoded values checked) against daemon A, then
# B, for ROUNDS rounds (A B A B ...), so both see the same machine and load. Typical use: A is a
# base commit's kvcompd (a git worktree with its own build directory), B the current one.
#   bash bench/service/ab.sh BENCH KVCOMPD_A KVCOMPD_B OUT_DIR [ROUNDS] [-- bench args]
# Default bench args: --tokens 8192 --calibration_tokens 2048 --gets 5 --tls tcp. Writes one
# YAML per run into OUT_DIR (a-1.yaml, b-1.yaml, ...) and prints a markdown table of the
# RESULT lines, with the load average before each run.
set -euo pipefail
[ $# -ge 4 ] || { sed -n '2,9p' "$0" >&2; exit 2; }
BENCH=$1 A=$2 B=$3 OUT=$4
shift 4
ROUNDS=3
if [ $# -gt 0 ] && [ "$1" != "--" ]; then ROUNDS=$1; shift; fi
[ "${1:-}" = "--" ] && shift
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(--tokens 8192 --calibration_tokens 2048 --gets 5 --tls tcp)
mkdir -p "$OUT"
for r in $(seq "$ROUNDS"); do
  for side in a b; do
    d=$A
    [ "$side" = b ] && d=$B
    f=$OUT/$side-$r.yaml
    echo "load_average_at_start: \"$(cut -d' ' -f1-3 /proc/loadavg)\"" >"$f"
    echo "== $side round $r ($d)" >&2
    "$BENCH" --kvcompd "$d" --kvsplice "${ARGS[@]}" >>"$f" 2>"$OUT/$side-$r.err" ||
      echo "   exited $? (see $OUT/$side-$r.err)" >&2
  done
done
python3 - "$OUT" "$ROUNDS" <<'PY'
import os, re, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def fields(line):
    return dict(kv.split("=", 1) for kv in line.split()[1:])
print("| run | load | calibrate s | case | ratio | put s | receive s | compress s | store s "
      "| get p50 ms | decoded get s | value err | verified |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for r in range(1, rounds + 1):
    for side in "ab":
        path = os.path.join(out, f"{side}-{r}.yaml")
        if not os.path.exists(path):
            continue
        text = open(path).read()
        load = re.search(r'load_average_at_start: "([^"]*)"', text).group(1).split()[0]
        res = [fields(l) for l in text.splitlines() if l.startswith("RESULT ")]
        cal = next((x for x in res if x["bench"] == "kvcompd_calibrate"), {})
        gets = {x["case"]: x for x in res if x["bench"] == "kvcompd_get"}
        for p in (x for x in res if x["bench"] == "kvcompd_put"):
            g = gets.get(p["case"], {})
            print(f"| {side.upper()}{r} | {load} | {cal.get('calibrate_s', '-')} | {p['case']} "
                  f"| {p['ratio']} | {p['put_s']} | {p['receive_s']} | {p['compress_s']} "
                  f"| {p['store_s']} | {g.get('stored_get_p50_ms', '-')} "
                  f"| {g.get('decoded_get_s', '-')} | {g.get('value_err_max', '-')} "
                  f"| {g.get('verified', '-')} |")
        if not res:
            print(f"| {side.upper()}{r} | {load} | no result | | | | | | | | | | |")
PY
