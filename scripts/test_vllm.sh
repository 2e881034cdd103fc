#!/usr/bin/env bash
# Runs the vLLM connector's tests (tests/python/test_vllm_connector.py) against vLLM's own
# classes: its Scheduler with a CPU device config and a tiny local Llama config (no weights, no
# network), connectors built by vLLM's KVConnectorFactory from kv_connector_module_path, three
# real kvcompd processes on loopback.
#
# vLLM pins its own torch (vllm 0.33.0: torch 2.14.0, a 336 MB wheel plus CUDA libraries), more
# than CI installs, so make test runs the same file without vllm (the vLLM-independent tests)
# and this script runs all of it in a virtual environment of its own:
#
#   VLLM_VENV   the environment (default /tmp/vllm-venv); created when missing, from the
#               system Python with its site packages (torch, transformers, numpy, pytest), with
#               vllm==$VLLM_VERSION installed --no-deps plus the pure-Python packages its
#               scheduler imports (torch itself is not replaced).
#   VLLM_VERSION  default 0.33.0
#   KVCOMPD     the daemon (default: the newest build*/service/kvcompd)
#   PYTHONPATH  a kvcomp package with its extension (default: client/python)
#
# Usage: scripts/test_vllm.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-/tmp/vllm-venv}
VERSION=${VLLM_VERSION:-0.33.0}
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv --system-site-packages "$VENV"
  "$VENV/bin/pip" install --no-deps "vllm==$VERSION"
  "$VENV/bin/pip" install "llguidance>=1.7,<1.8" lm-format-enforcer==0.11.3 \
    outlines_core==0.2.14 lark==1.2.2 partial-json-parser msgspec pyzmq cbor2 ijson \
    setproctitle pybase64 cloudpickle blake3 py-cpuinfo prometheus_client \
    prometheus-fastapi-instrumentator tiktoken einops watchfiles python-json-logger openai
  "$VENV/bin/pip" install --no-deps xgrammar==0.2.8 compressed-tensors==0.17.0 depyf==0.20.0
fi
"$VENV/bin/python" -c "import vllm.v1.core.sched.scheduler, \
vllm.distributed.kv_transfer.kv_connector.v1.base; import vllm; print('vllm', vllm.__version__)"
export PYTHONPATH=${PYTHONPATH:-$PWD/client/python}
exec "$VENV/bin/python" -m pytest -v -rs tests/python/test_vllm_connector.py "$@"
