#!/usr/bin/env bash
# The long fault campaign, outside make test:
#   bench/reliability/run.sh kill [build dir] [cycles]     SIGKILL cycles under concurrent puts
#   bench/reliability/run.sh soak [build dir] [seconds]    8 clients of mixed put/get/delete
#   bench/reliability/run.sh lockout [build dir] [seconds] valid clients beside 256 strangers
#   bench/reliability/run.sh restart [build dir] [MiB]     restart time after a write burst
#   bench/reliability/run.sh diskfull [build dir] [cycles] puts on a volume that fills and frees
#   bench/reliability/run.sh peer [build dir] [cycles]     puts cut between PutBegin and Commit
#   bench/reliability/run.sh tables [build dir] [cycles]   a RocksDB table file damaged after
#       every second (clean) stop: a data block, its tail (index, footer) or cut short, in turn
#   bench/reliability/run.sh roundtrips [build dir] [cycles]
#       round trips of small lossless caches (16-63 KiB of K and V) compared byte for byte, under
#       SIGKILLs every 5-15 s with readers getting across every restart; resumable: its journal
#       and data live in $KVCOMP_CAMPAIGN_DIR (default /var/tmp/kvcomp-roundtrips), kept until a
#       run reaches [cycles] (default 10000) cleanly. Stop it by ending the process group
#       (kill -- -PGID); the same command resumes from the journal. Runs at nice 10. To go on
#       building in the same tree meanwhile, copy the two binaries aside and name them:
#         mkdir -p /var/tmp/kvcomp-rt-bin && cp build/service/kvcompd \
#           build/bench/reliability/kvcomp_campaign /var/tmp/kvcomp-rt-bin/
#         KVCOMP_BIN=/var/tmp/kvcomp-rt-bin KVCOMP_COMMIT=<commit built> setsid \
#           bench/reliability/run.sh roundtrips build 10000 &
# Builds kvcomp_campaign (and kvcompd) in the build dir (default build-reliability), runs it in a
# scratch directory and appends its figures, with date, machine and commit, to
# bench/results/reliability-<date>.md. Meant to run in the background (nohup/setsid); progress
# lines are appended every 50 kill cycles, so an interrupted run still leaves what it did.
# KVCOMP_COMMIT names what the build dir was built from when it is not HEAD of this tree.
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:?usage: run.sh kill|soak|lockout|restart|diskfull|peer|tables|roundtrips [build dir] [amount]}
build=${2:-build-reliability}
amount=${3:-}
# The long round-trip run shares the build machine: it yields to everything else.
[[ $mode == roundtrips ]] && renice -n 10 $$ >/dev/null
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVCOMP_CUDA=OFF \
    -DKVCOMP_PYTHON=OFF -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
fi
# KVCOMP_BIN: a directory holding copies of kvcomp_campaign and kvcompd to run instead of the
# build dir's (then nothing is built): a long run then survives rebuilds of the tree meanwhile.
if [[ -n ${KVCOMP_BIN:-} ]]; then
  campaign=$KVCOMP_BIN/kvcomp_campaign
  daemon_arg=(--kvcompd="$KVCOMP_BIN/kvcompd")
else
  ninja -C "$build" -j 2 kvcomp_campaign kvcompd >/dev/null
  campaign=$build/bench/reliability/kvcomp_campaign
  daemon_arg=()
fi
date_utc=$(date -u +%Y-%m-%d)
out=bench/results/reliability-${date_utc}.md
if [[ $mode == roundtrips ]]; then
  scratch=${KVCOMP_CAMPAIGN_DIR:-/var/tmp/kvcomp-roundtrips}
  mkdir -p "$scratch"
else
  scratch=$(mktemp -d /tmp/kvcomp-campaign-XXXXXX)
fi
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
  diskfull) args=(--mode=diskfull --cycles="${amount:-20}") ;;
  peer) args=(--mode=peer --cycles="${amount:-300}") ;;
  tables) args=(--mode=kill --cycles="${amount:-100}" --writers=2 --window=48 --sst_every=2) ;;
  roundtrips) args=(--mode=kill --cycles="${amount:-10000}" --chunk=10 --writers=2 --window=16
                    --lossless --readers=2 --run_ms=5000:15000) ;;
  *) echo "mode must be kill, soak, lockout, restart, diskfull, peer, tables or roundtrips" >&2
     exit 2 ;;
esac
set +e
# Kill mode runs 100 cycles per process and resumes from its journal (exit status 3: more to
# do); a driver that dies (its status is logged) is followed by a new one on the same journal.
deaths=0
while true; do
  "$campaign" "${args[@]}" "${daemon_arg[@]}" --dir="$scratch" --out="$out" \
    2>>"$scratch.stderr"
  rc=$?
  [[ ($mode == kill || $mode == roundtrips) && $rc == 3 ]] && continue
  if [[ ($mode == kill || $mode == roundtrips) && $rc -gt 128 && $deaths -lt 20 ]]; then
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
