#!/usr/bin/env bash
# The SGLang HiCache backend's tests against sglang 0.5.23's classes (scripts/test_engine.sh sglang).
exec "$(dirname "$0")/test_engine.sh" sglang "$@"
