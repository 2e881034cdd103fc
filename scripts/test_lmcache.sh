#!/usr/bin/env bash
# The LMCache serde's tests against lmcache 0.5.6's classes (scripts/test_engine.sh lmcache).
exec "$(dirname "$0")/test_engine.sh" lmcache "$@"
