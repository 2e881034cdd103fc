#!/usr/bin/env bash
# One GPU command (two GPUs, G0 and G1; both 0 on a one-GPU machine) for choosing the default
# policy across models: the RULER-style suite of the default's candidates (manifold with 0, 50,
# 75 and 90% of the kept budget recent), the single scorers and kvpress's query-aware presses at
# 4K on the code model, g16 and d8 (suite.py --config-set defaults), and the presets with the
# candidates at a long context on g16 and d8 (--config-set long); every process runs to the same
# time budget, then each model's shards are merged, and the pooled and scorer tables written.
# No training. Into $OUT: one tarball with every suite JSON and Markdown and the logs.
#
#   IN=.dev/quality OUT=/tmp/out bash bench/quality/run_gpu_policies.sh
#
# The window candidates (recent share 0.75-0.9, larger sinks) and eviction under them + the
# codec, at 4K only, four processes per model:
#
#   CONFIG_SET=window LONG= SHARDS=4 IN=.dev/quality OUT=/tmp/out bash bench/quality/run_gpu_policies.sh
#
# The calibrated decorrelation codec (pca) against the hq codecs, alone and under eviction, at 4K
# (IN also holds calib.tar.xz: a slice of the corpus' training split, train_en.bin and
# train_code.bin, that calibrates the bases):
#
#   CONFIG_SET=codec8 LONG= SHARDS=4 IN=.dev/quality OUT=/tmp/out bash bench/quality/run_gpu_policies.sh
#
# IN holds corpus.tar.xz, {g16,d8}.npz (lm/pack_weights.py pack), {g16,d8}/config.json and
# generation_config.json, and kvpress-*.whl (its PyPI wheel; without it the kvpress rows are left
# out). Knobs: BS seconds per process; LEN the short length, LONG the long one ("" = none); N
# rounds per length (each round one sample of every task and one loss window); SHARDS processes
# per model at LEN, SHARDSL at LONG; CONFIG_SET, CONFIG_SET_LONG; DEVICE; MODELS57 (the code
# model's directory, "" to leave it out).
set -u
IN=${IN:-.dev/quality}
OUT=${OUT:?set OUT}
W=${W:-/tmp/quality-work}
BS=${BS:-200}
LEN=${LEN:-4096}
LONG=${LONG-16384}
N=${N:-80}
NL=${NL:-40}
SHARDS=${SHARDS:-3}
SHARDSL=${SHARDSL:-2}
CONFIG_SET=${CONFIG_SET:-defaults}
CONFIG_SET_LONG=${CONFIG_SET_LONG:-long}
DEVICE=${DEVICE:-cuda}
G0=${G0:-0}
G1=${G1:-1}
MODEL57=${MODEL57-bench/quality/lm/model}
STAMP=$(date -u +%Y%m%dT%H%MZ)
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
KVPRESS=$(ls "$IN"/kvpress-*.whl 2>/dev/null | tail -1)
CALIB=()
if [ -f "$IN/calib.tar.xz" ]; then CALIB=(--calib "$IN/calib.tar.xz"); fi
mkdir -p "$W" "$OUT"
if [ -n "$KVPRESS" ]; then  # unpacked once, read by every process
  rm -rf "$W/kvpress" && python3 -m zipfile -e "$KVPRESS" "$W/kvpress" && KVPRESS=$W/kvpress
fi
export KVCOMP_KVPRESS_WHEEL=$KVPRESS
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

for m in g16 d8; do
  python3 bench/quality/lm/pack_weights.py unpack "$IN/$m.npz" "$IN/$m" "$W/$m" || exit 1
done
say "unpacked; kvpress wheel: ${KVPRESS:-none}"

ps=()
k=0
part() {  # model_dir name length n config_set shard/k: one process, GPUs in turn
  local g=$G0
  if [ $((k % 2)) = 1 ]; then g=$G1; fi
  k=$((k + 1))
  local tag="$2-$3-${6%/*}"
  CUDA_VISIBLE_DEVICES=$g python3 bench/quality/suite.py --model "$1" \
    --corpus "$IN/corpus.tar.xz" --lengths "$3" --n "$4" --n-loss "$4" --config-set "$5" \
    --shard "$6" --budget-seconds "$BS" --device "$DEVICE" --out "$W/part-$tag" "${CALIB[@]}" \
    > "$W/suite-$tag.out" 2>&1 &
  ps+=($!)
}
names=()
if [ -n "$MODEL57" ]; then names+=(code57); fi
names+=(g16 d8)
dir_of() { if [ "$1" = code57 ]; then echo "$MODEL57"; else echo "$W/$1"; fi; }
for i in $(seq 0 $((SHARDS - 1))); do
  for m in "${names[@]}"; do part "$(dir_of "$m")" "$m" "$LEN" "$N" "$CONFIG_SET" "$i/$SHARDS"; done
done
if [ -n "$LONG" ]; then
  for i in $(seq 0 $((SHARDSL - 1))); do
    for m in g16 d8; do part "$W/$m" "$m" "$LONG" "$NL" "$CONFIG_SET_LONG" "$i/$SHARDSL"; done
  done
fi
say "${#ps[@]} suite processes started"
wait "${ps[@]}"
say "suites done"
for m in "${names[@]}"; do
  python3 bench/quality/suite.py --merge "$W"/part-"$m"-*.json --out "$W/ruler-suite-$STAMP-$m" \
    > "$W/merge-$m.out" 2>&1 || say "merge $m failed"
done
jsons=()
for m in "${names[@]}"; do jsons+=("$W/ruler-suite-$STAMP-$m.json"); done
python3 bench/quality/suite.py --pool "${jsons[@]}" --out "$W/ruler-suite-$STAMP-pooled" \
  > "$W/pool.out" 2>&1 || say "pool failed"
python3 bench/quality/suite.py --scorers "${jsons[@]}" --out "$W/scorers-$STAMP" \
  > "$W/scorers.out" 2>&1 || say "scorers failed"
(cd "$W" && tar czf "$OUT/results.tgz" ruler-suite-* scorers-* part-*.json suite-*.out \
  merge-*.out pool.out scorers.out)
say "done"
ls -la "$OUT"
grep -h "kvpress\|rounds\|wrote\|Error\|error" "$W"/suite-*.out | sort | uniq -c | head -40
cat "$W"/merge-*.out "$W"/pool.out "$W"/scorers.out
