#!/usr/bin/env bash
# The serving replay on one GPU machine, in one command: unpacks the daemon bundle
# (scripts/gpu_bundle.sh, built with the Python package for the machine's Python 3.12), writes
# the trace (bench/serving/workload.py), runs every arm (bench/serving/serve.py: the unloaded
# prefill grid, the full-hit probes at 8K and 32K tokens, the trace, the trained model's
# quality column) and writes the tables and the picture under $OUT. Prints its wall time last.
#
#   run(command="bash bench/serving/run_gpu.sh", carry=[".gpubundle"])
#
# Knobs: KVCOMP_SERVING_REQUESTS (trace length, default the h200 preset's 64),
#        KVCOMP_SERVING_ARM_S (seconds of trace per arm, default 55: an arm that is slower serves
#        fewer requests, and every arm's table is cut to the fewest served),
#        KVCOMP_SERVING_ARGS (more serve.py arguments), KVCOMP_SERVING_LIMIT_S (serve.py's
#        time limit, default 420; no arm starts in its last 90 s, so the tables are written), KVCOMP_COMMIT (the commit the results name).
# Local use (CPU, a short trace and the byte model): see tests/python/test_serving_bench.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
ROOT=$PWD
OUT=${OUT:-$ROOT/build-serving-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUNDLE=$ROOT/build-gpu-bundle
if [ -f "$ROOT/.gpubundle/bundle.tar.xz" ]; then
  rm -rf "$BUNDLE" && mkdir -p "$BUNDLE" && tar -C "$BUNDLE" -xJf "$ROOT/.gpubundle/bundle.tar.xz"
fi
if [ ! -x "$BUNDLE/bin/kvcompd" ] || [ ! -d "$BUNDLE/python/kvcomp" ]; then
  echo "run_gpu.sh: no bundle with kvcompd and the Python package: build it with" \
    "scripts/gpu_bundle.sh (see its header) and carry .gpubundle" >&2
  exit 2
fi
# shellcheck disable=SC1091
source "$BUNDLE/env.sh"
export PYTHONPATH=$KVCOMP_BUNDLE_PYTHON${PYTHONPATH:+:$PYTHONPATH}
# The commit: KVCOMP_COMMIT, else the one the bundle was built from (the tree that travels may
# carry a git directory of another commit).
COMMIT=${KVCOMP_COMMIT:-$(cat "$BUNDLE/commit")}
export KVCOMP_COMMIT=$COMMIT
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '-')
STAMP=$(date -u +%Y%m%dT%H%MZ)
echo "date $STAMP, commit $COMMIT, bundle $(cat "$BUNDLE/commit"), card ${CARD:-none}"
python3 -c 'import kvcomp, torch; print("kvcomp", kvcomp.backend_description(), "| torch",
  torch.__version__, "| client", kvcomp.Client.__module__)' || exit 3

python3 bench/serving/workload.py --out "$OUT/trace.jsonl" --preset h200 \
  ${KVCOMP_SERVING_REQUESTS:+--requests $KVCOMP_SERVING_REQUESTS}
PREFIX=$OUT/serving-$STAMP-${CARD:-gpu}-$COMMIT
# The arms, the probes and the quality column; serve.py's own argument list is in the .json.
PYTHONUNBUFFERED=1 timeout "${KVCOMP_SERVING_LIMIT_S:-420}" python3 bench/serving/serve.py \
  --trace "$OUT/trace.jsonl" --model timing --device cuda --kvcompd "$BUNDLE/bin/kvcompd" \
  --probe-lengths 8192,32768 --quality 20,4,4096 --budget-s "${KVCOMP_SERVING_ARM_S:-55}" \
  --deadline-s $(( ${KVCOMP_SERVING_LIMIT_S:-420} - 90 )) \
  --out "$PREFIX" ${KVCOMP_SERVING_ARGS:-} \
  2>&1 | tee "$OUT/serving.log"
rc=${PIPESTATUS[0]}
[ -f "$PREFIX.md" ] && cat "$PREFIX.md"
echo "run_gpu.sh: serve.py exit $rc; wall $(($(date +%s) - T0)) s"
exit "$rc"
