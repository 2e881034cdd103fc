#!/usr/bin/env bash
# Runs kvcomp's tests against a serving engine's own classes, in a virtual environment of that
# engine's own, on CPU, with real kvcompd processes on loopback:
#
#   scripts/test_engine.sh vllm     tests/python/test_vllm_connector.py (the KV connector, vLLM's
#                                   Scheduler and KVConnectorFactory, TP=2 as two processes)
#                                   and tests/python/test_vllm_offload.py (the native offloading
#                                   secondary tier under vLLM's TieringOffloadingSpec)
#   scripts/test_engine.sh lmcache  tests/python/test_lmcache_serde.py (the LMCache serde)
#   scripts/test_engine.sh sglang   tests/python/test_sglang_hicache.py (the HiCache backend)
#
# The environment (ENGINE_VENV, default /tmp/kvcomp-<engine>-venv) is made from the system
# Python with its site packages (torch, transformers, numpy, pytest: scripts/bootstrap.sh), and
# the engine plus what it imports are installed --no-deps at the versions pinned in
# scripts/engines/<engine>.txt (the engines pin their own torch builds, which are not installed).
# It is made again when that list changes. make test runs the same files without the engines
# (their engine-independent tests; the rest skip).
#
#   KVCOMPD     the daemon (default: the newest build*/service/kvcompd)
#   PYTHONPATH  a kvcomp package with its extension (default: client/python)
#
# Usage: scripts/test_engine.sh vllm|lmcache|sglang [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=${1:?usage: scripts/test_engine.sh vllm|lmcache|sglang [pytest args]}
shift
case "$ENGINE" in
  vllm) TESTS=(tests/python/test_vllm_connector.py tests/python/test_vllm_offload.py)
        PROBE="import vllm.v1.core.sched.scheduler, vllm.v1.kv_offload.tiering.spec" ;;
  lmcache) TESTS=(tests/python/test_lmcache_serde.py)
           PROBE="import lmcache.v1.distributed.serde, lmcache.v1.memory_management" ;;
  sglang) TESTS=(tests/python/test_sglang_hicache.py)
          PROBE="import sglang.srt.mem_cache.pool_host.mha, sglang.srt.managers.cache_controller" ;;
  *) echo "unknown engine $ENGINE (vllm, lmcache, sglang)" >&2; exit 2 ;;
esac
PINS=scripts/engines/$ENGINE.txt
VENV=${ENGINE_VENV:-/tmp/kvcomp-$ENGINE-venv}
STAMP=$VENV/.kvcomp-pins
if [[ ! -x "$VENV/bin/python" ]] || ! cmp -s "$PINS" "$STAMP"; then
  rm -rf "$VENV"
  python3 -m venv --system-site-packages "$VENV"
  "$VENV/bin/pip" install -q --no-deps -r "$PINS"
  cp "$PINS" "$STAMP"
fi
"$VENV/bin/python" -W ignore -c "$PROBE"
"$VENV/bin/python" -c "import importlib.metadata as m; print('$ENGINE', m.version('$ENGINE'))"
export PYTHONPATH=${PYTHONPATH:-$PWD/client/python}
exec "$VENV/bin/python" -m pytest -v -rs "${TESTS[@]}" "$@"
