#!/usr/bin/env bash
# The campaign's scratch directory (used when no --dir is given) is removed after a clean run
# (here a restart burst of 8 MiB) and kept, named on stderr, after a failed one (a daemon binary
# that does not exist). Usage: scratch_check.sh <kvcomp_campaign binary>
set -euo pipefail
campaign=$1
err=$(mktemp)
trap 'rm -f "$err"' EXIT
"$campaign" --mode=restart --burst_mb=8 >/dev/null 2>"$err"
dir=$(sed -n 's/^scratch directory: //p' "$err")
[[ -n $dir ]] || { echo "no scratch directory named:"; cat "$err"; exit 1; }
[[ ! -e $dir ]] || { echo "scratch directory $dir left after a clean run"; exit 1; }
if "$campaign" --mode=soak --clients=1 --seconds=1 --kvcompd=/nonexistent >/dev/null 2>"$err"; then
  echo "a soak without a daemon passed"
  exit 1
fi
kept=$(sed -n 's/^scratch directory kept for inspection (remove it when done): //p' "$err")
[[ -n $kept && -d $kept ]] || { echo "a failed run did not keep and name its scratch:"; cat "$err"; exit 1; }
rm -rf "$kept"
echo "scratch removed after a clean run ($dir), kept and named after a failed one ($kept)"
