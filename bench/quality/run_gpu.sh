#!/usr/bin/env bash
# One GPU command for the quality work: continue training g16 and d8 from their packed weights
# (both at once, with the code model's suite beside them), then the RULER-style suite on g16 and
# d8; everything lands in $OUT (the trained weights first, in pieces of at most 15 MB, then the
# suite's JSON and Markdown, the training logs and the pooled table in one tarball).
#
#   IN=.dev/quality OUT=/tmp/out bash bench/quality/run_gpu.sh
#
# IN holds corpus.tar.xz, {g16,d8}.npz (lm/pack_weights.py pack) and {g16,d8}/config.json,
# generation_config.json, train_log.json. Knobs (seconds): TS training, BS57 the code model's
# suite, BS the new models' suites; LENS, N (samples per task), DEVICE, TRAIN_EXTRA (extra
# train.py arguments, for a dry run on a CPU).
set -u
IN=${IN:-.dev/quality}
OUT=${OUT:?set OUT}
W=${W:-/tmp/quality-work}
TS=${TS:-100}
BS57=${BS57:-270}
BS=${BS:-150}
LENS=${LENS:-4096 8192}
N=${N:-50}
DEVICE=${DEVICE:-cuda}
TRAIN_EXTRA=${TRAIN_EXTRA:-}
STAMP=$(date -u +%Y%m%dT%H%MZ)
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}  # eight processes on the machine's cores
mkdir -p "$W" "$OUT"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

for m in g16 d8; do
  python3 bench/quality/lm/pack_weights.py unpack "$IN/$m.npz" "$IN/$m" "$W/${m}_init" || exit 1
  cp "$IN/$m/train_log.json" "$W/${m}_init/" 2>/dev/null
done
say "unpacked"

train() {  # model en_frac seed
  python3 bench/quality/lm/train.py --out "$W/$1" --arch "$1" --corpus "$IN/corpus.tar.xz" \
    --init-from "$W/${1}_init" --seq-len 8192 --short-len 2048 --short-frac 0.5 --batch 16 \
    --lr 1e-3 --warmup 30 --task-frac 0.4 --en-frac "$2" --seed "$3" --seconds "$TS" \
    --checkpoint-seconds 100000 --eval-n 20 --device "$DEVICE" $TRAIN_EXTRA > "$W/train-$1.out" 2>&1
}
suite() {  # model_dir name budget: one process per length (the small models leave the GPU idle
           # between kernels; several processes fill it), then their results merged
  local ps=() parts=()
  for L in $LENS; do
    python3 bench/quality/suite.py --model "$1" --corpus "$IN/corpus.tar.xz" --lengths "$L" \
      --n "$N" --n-loss "$N" --budget-seconds "$3" --device "$DEVICE" \
      --out "$W/part-$2-$L" > "$W/suite-$2-$L.out" 2>&1 & ps+=($!)
    parts+=("$W/part-$2-$L.json")
  done
  wait "${ps[@]}"
  python3 bench/quality/suite.py --merge "${parts[@]}" --out "$W/ruler-suite-$STAMP-$2" \
    > "$W/merge-$2.out" 2>&1
}

train g16 0.6 11 & pg=$!
train d8 0.4 12 & pd=$!
suite bench/quality/lm/model code57 "$BS57" & p57=$!
wait $pg; say "g16 trained: $(tail -1 "$W/train-g16.out")"
wait $pd; say "d8 trained: $(tail -1 "$W/train-d8.out")"
for m in g16 d8; do  # the weights first: they come back even if the suites overrun
  split -b 15000000 -d "$W/$m/model.safetensors" "$OUT/$m.safetensors.part"
done
suite "$W/g16" g16 "$BS" & p1=$!
suite "$W/d8" d8 "$BS" & p2=$!
wait $p57; say "code57 suite done"
wait $p1; wait $p2; say "suites done"
python3 bench/quality/suite.py --pool "$W"/ruler-suite-$STAMP-{code57,g16,d8}.json \
  --out "$W/ruler-suite-$STAMP-pooled" > "$W/pool.out" 2>&1
for m in g16 d8; do
  cp "$W/$m/train_log.json" "$W/train_log-$m.json"; cp "$W/$m/train.log" "$W/train-$m.log"
  cp "$W/$m/config.json" "$W/config-$m.json"
done
(cd "$W" && tar czf "$OUT/results.tgz" ruler-suite-* train_log-*.json train-*.log train-*.out \
  suite-*.out merge-*.out pool.out config-*.json)
say "done"; ls -la "$OUT"
