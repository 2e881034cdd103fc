#!/usr/bin/env bash
# The long fault campaign, outside make test:
#   bench/reliability/run.sh kill [build dir] [cycles]     SIGKILL cycles under concurrent puts
#   bench/reliability/run.sh soak [build dir] [seconds]    8 clients of mixed put/get/delete
#   bench/reliability/run.sh lockout [build dir] [seconds] valid clients beside 256 strangers
#   bench/reliability/run.sh restart [build dir] [MiB]     restart time after a write burst
# Builds kvcomp_campaign (and kvcompd) in the build dir (default build-reliability), runs it in a
# scratch directory and appends its figures, with date, machine and commit, to
# bench/results/reliability-<date>.md. Meant to run in the background (nohup/setsid); progress
# lines are appended every 50 kill cycles, so an interrupted run still leaves what it did.
# KVCOMP_COMMIT names what the build dir was built from when it is not HEAD of this tree.
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:?usage: run.sh kill|soak|lockout|restart [build dir] [cycles|seconds|MiB]}
build=${2:-build-reliability}
amount=${3:-}
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVCOMP_CUDA=OFF \
    -DKVCOMP_PYTHON=OFF -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
fi
ninja -C "$build" -j 2 kvcomp_campaign kvcompd >/dev/null
date_utc=$(date -u +%Y-%m-%d)
out=bench/results/reliability-${date_utc}.md
scratch=$(mktemp -d /tmp/kvcomp-campaign-XXXXXX)
{
  echo
  echo "## ${mode}: started $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "machine: $(nproc) vCPU, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
       "load average at start $(cut -d' ' -f1-3 /proc/loadavg); commit ${KVCOMP_COMMIT:-$(git rev-parse --short HEAD)}" \
       "$(git diff --quiet HEAD -- storage service transport client || echo '(with uncommitted changes in the tree)')"
  echo
} >>"$out"
case "$mode" in
  kill) args=(--mode=kill --cycles="${amount:-1000}" --chunk=100 --writers=4 --window=16) ;;
  soak) args=(--mode=soak --clients=8 --seconds="${amount:-600}") ;;
  lockout) args=(--mode=lockout --strangers=256 --stranger_period=20 --seconds="${amount:-60}") ;;
  restart) args=(--mode=restart --burst_mb="${amount:-4096}") ;;
  *) echo "mode must be kill, soak, lockout or restart" >&2; exit 2 ;;
esac
set +e
# Kill mode runs 100 cycles per process and resumes from its journal (exit status 3: more to
# do); a driver that dies (its status is logged) is followed by a new one on the same journal.
deaths=0
while true; do
  "$build/bench/reliability/kvcomp_campaign" "${args[@]}" --dir="$scratch" --out="$out" \
    2>>"$scratch.stderr"
  rc=$?
  [[ $mode == kill && $rc == 3 ]] && continue
  if [[ $mode == kill && $rc -gt 128 && $deaths -lt 20 ]]; then
    deaths=$((deaths + 1))
    echo "the campaign driver died (exit status $rc, signal $((rc - 128))); resuming from its journal" >>"$out"
    continue
  fi
  break
done
set -e
{
  echo
  echo "${mode} finished $(date -u +%Y-%m-%dT%H:%MZ), exit status ${rc}" \
       "(0: nothing lost, corrupted or resurrected, no errors)"
} >>"$out"
tail -n 20 "$scratch.stderr" >&2 || true
# The scratch data (GiBs after a restart burst) goes after a clean run; a failed run keeps it
# for inspection and says where.
if [[ $rc == 0 ]]; then
  rm -rf "$scratch" "$scratch.stderr"
else
  echo "scratch kept for inspection (remove it when done): $scratch ($scratch.stderr)" >&2
fi
exit "$rc"
