#!/usr/bin/env bash
# The vLLM integrations' tests against vLLM 0.33.0's own classes (scripts/test_engine.sh vllm):
# the KV connector (tests/python/test_vllm_connector.py) and the native offloading secondary
# tier (tests/python/test_vllm_offload.py). Usage: scripts/test_vllm.sh [pytest args]
exec "$(dirname "$0")/test_engine.sh" vllm "$@"
