#!/usr/bin/env bash
# Fails when a tracked file speaks of how kvcomp was made instead of what it is: issue numbers,
# work-log words, numbered research seeds or documents the
# repository does not hold (DESIGN.md, ../shared). Code, tests, benchmarks, results and docs say
# what a component does and where it stands; history lives in git.
#   bash scripts/check_product_text.sh        (run by scripts/run_tests.sh)
set -uo pipefail
cd "$(dirname "$0")/.."

patterns=(
  '\bissues? ?#?[0-9]+'
  '_issue[0-9]'
  '\bseed 0[0-9]{2}\b'
  'DESIGN\.md'
  '\.\./shared\b'
  '\b(this|that|previous|next|earlier|later|first|second|third|last) session\b'
  '\bsession notes?\b'
)
regex=$(IFS='|'; echo "${patterns[*]}")

# Text files only (-I); this script names the patterns itself.
hits=$(git grep -nIiE "$regex" -- . ':!scripts/check_product_text.sh' || true)
if [ -n "$hits" ]; then
  echo "check_product_text: references to how the code was made (say what it is instead):" >&2
  echo "$hits" >&2
  echo "check_product_text: $(echo "$hits" | wc -l) line(s)" >&2
  exit 1
fi
echo "check_product_text: ok"
