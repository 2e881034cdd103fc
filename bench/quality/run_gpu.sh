#!/usr/bin/env bash
# One GPU command for the quality work on two GPUs (G0, G1; both 0 on a one-GPU machine):
# continue training g16 (on G0) and d8 (on G1) from their packed weights while the code model's
# suite runs beside them (one shard on each GPU), then the RULER-style suite of the presets, the
# default policy and the single scorers on g16 (G0) and d8 (G1), several processes per GPU (the
# small models leave a GPU idle between kernels). Into $OUT: the trained weights int8-packed
# (lm/pack_weights.py, about 15 MB per model) first, then one tarball with every suite JSON and
# Markdown, the training logs and the pooled table.
#
#   IN=.dev/quality OUT=/tmp/out bash bench/quality/run_gpu.sh
#
# IN holds corpus.tar.xz, {g16,d8}.npz (lm/pack_weights.py pack) and {g16,d8}/config.json,
# generation_config.json, train_log.json. Knobs: TS training seconds; BS57 the code model's
# suite budget (runs during training); BS the new models' suite budget; LENS; N (rounds per
# length: each round is one sample of every task and one loss window); SHARDS processes per
# length and model (SHARDS57 for the code model, beside the training); LR; TASK_WEIGHTS
# (train.py --task-weights); CONFIG_SET (suite.py --config-set); DEVICE; WORKERS (batch-building
# processes per training run); TRAIN_EXTRA (extra train.py arguments, e.g. for a CPU dry run).
set -u
IN=${IN:-.dev/quality}
OUT=${OUT:?set OUT}
W=${W:-/tmp/quality-work}
TS=${TS:-170}
BS57=${BS57:-$TS}
BS=${BS:-100}
LENS=${LENS:-4096 8192}
N=${N:-80}
SHARDS=${SHARDS:-2}
CONFIG_SET=${CONFIG_SET:-policies}
DEVICE=${DEVICE:-cuda}
G0=${G0:-0}
G1=${G1:-1}
WORKERS=${WORKERS:-6}
LR=${LR:-2e-3}
TASK_WEIGHTS=${TASK_WEIGHTS:-2,2,1,1,1,0.5,0.5}  # niah single/multikey first: ruler.TASKS order
SHARDS57=${SHARDS57:-1}
TRAIN_EXTRA=${TRAIN_EXTRA:-}
STAMP=$(date -u +%Y%m%dT%H%MZ)
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
mkdir -p "$W" "$OUT"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

for m in g16 d8; do
  python3 bench/quality/lm/pack_weights.py unpack "$IN/$m.npz" "$IN/$m" "$W/${m}_init" || exit 1
  cp "$IN/$m/train_log.json" "$W/${m}_init/" 2>/dev/null
done
say "unpacked"

train() {  # model en_frac seed gpu
  CUDA_VISIBLE_DEVICES=$4 python3 bench/quality/lm/train.py --out "$W/$1" --arch "$1" \
    --corpus "$IN/corpus.tar.xz" --init-from "$W/${1}_init" --seq-len 4096 --short-len 1024 \
    --short-frac 0.6 --batch 16 --lr "$LR" --warmup 30 --task-frac 0.5 --en-frac "$2" \
    --task-weights "$TASK_WEIGHTS" \
    --seed "$3" --seconds "$TS" --checkpoint-seconds 100000 --eval-n 0 --workers "$WORKERS" \
    --device "$DEVICE" $TRAIN_EXTRA > "$W/train-$1.out" 2>&1
}
suite() {  # model_dir name budget gpu [gpu2]: SHARDS processes per length (on gpu, or
           # alternating gpu and gpu2), then one merged result
  local ps=() parts=() k=0 g ns=${6:-$SHARDS}
  for L in $LENS; do
    for ((i = 0; i < ns; i++)); do
      g=$4; if [ $# -ge 5 ] && [ $((k % 2)) = 1 ]; then g=$5; fi; k=$((k + 1))
      CUDA_VISIBLE_DEVICES=$g python3 bench/quality/suite.py --model "$1" \
        --corpus "$IN/corpus.tar.xz" --lengths "$L" --n "$N" --n-loss "$N" \
        --config-set "$CONFIG_SET" --shard "$i/$ns" --budget-seconds "$3" \
        --device "$DEVICE" --out "$W/part-$2-$L-$i" > "$W/suite-$2-$L-$i.out" 2>&1 & ps+=($!)
      parts+=("$W/part-$2-$L-$i.json")
    done
  done
  wait "${ps[@]}"
  python3 bench/quality/suite.py --merge "${parts[@]}" --out "$W/ruler-suite-$STAMP-$2" \
    > "$W/merge-$2.out" 2>&1
}

train g16 0.6 21 "$G0" & pg=$!
train d8 0.4 22 "$G1" & pd=$!
suite bench/quality/lm/model code57 "$BS57" "$G0" "$G1" "$SHARDS57" & p57=$!
wait $pg; say "g16 trained: $(grep -a 'trained' "$W/train-g16.out" | tail -1)"
wait $pd; say "d8 trained: $(grep -a 'trained' "$W/train-d8.out" | tail -1)"
suite "$W/g16" g16 "$BS" "$G0" & p1=$!
suite "$W/d8" d8 "$BS" "$G1" & p2=$!
for m in g16 d8; do  # the weights first: they come back even if the suites overrun
  python3 bench/quality/lm/pack_weights.py pack "$W/$m" "$OUT/$m.npz" > "$W/pack-$m.out" 2>&1
done
say "packed: $(ls -la "$OUT" | tr '\n' ' ')"
wait $p57; say "code57 suite done"
wait $p1; wait $p2; say "suites done"
python3 bench/quality/suite.py --pool "$W"/ruler-suite-$STAMP-{code57,g16,d8}.json \
  --out "$W/ruler-suite-$STAMP-pooled" > "$W/pool.out" 2>&1
for m in g16 d8; do
  cp "$W/$m/train_log.json" "$W/train_log-$m.json"; cp "$W/$m/train.log" "$W/train-$m.log"
  cp "$W/$m/config.json" "$W/config-$m.json"
done
(cd "$W" && tar czf "$OUT/results.tgz" ruler-suite-* train_log-*.json train-*.log train-*.out \
  suite-*.out merge-*.out pool.out pack-*.out config-*.json)
say "done"; ls -la "$OUT"; tail -n 3 "$W"/suite-*.out; cat "$W"/pool.out "$W"/merge-*.out
