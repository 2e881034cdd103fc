#!/usr/bin/env bash
# The team's one command on the GPU device machine: configure and build kvcomp with CUDA against
# the carried Debian sysroot (scripts/gpu_sysroot.sh), run the gpu-labelled tests and the unit
# tests, run every GPU benchmark, write logs under $OUT and print a short table last.
#
#   run(command="bash bench/gpu/run.sh", carry=[".sysroot"])
#
# Environment knobs (all optional):
#   KVCOMP_GPU_STEPS   phases to run, default "env build test bench"; "python" (not a default)
#                      builds the Python extension (core only) in $KVCOMP_GPU_PYBUILD (default
#                      <build>-python) with $KVCOMP_GPU_PYTHON (default python3) and runs
#                      tests/python/test_cuda_roundtrip.py, then the other Python tests (python.log)
#   KVCOMP_GPU_TARGETS build only these targets (default: all)
#   KVCOMP_CTEST_ARGS  extra ctest arguments, e.g. "-R scoring"
#   KVCOMP_BENCH_ARGS  extra arguments for every benchmark binary
#   KVCOMP_BENCH_FILTER run only benchmark binaries matching this regex (default: all)
#   KVCOMP_TORCH_REF   1 (default) to time the PyTorch reference in the same run
#   KVCOMP_KVPRESS     1 (default) to time kvpress's presses per layer (bench/gpu/kvpress_bench.py)
#                      when its wheel is carried: pip download kvpress into .whl/, carry=[".whl"]
#   KVCOMP_GPU_EXTRA   a further command run last with the same environment (extra.log)
#   daemon             (not a default step) the whole daemon from the bundle that
#                      scripts/gpu_bundle.sh makes on the build machine (carry=[".gpubundle"]; no
#                      sysroot, no build here). KVCOMP_DAEMON_PARTS (default "devpath channel
#                      multigpu decode integration bench pipeline") picks the in-process test of
#                      the device put path (service_device_path_test), the GPU channel and device
#                      payload tests with the Python device-path tests, the engines on every GPU
#                      (service_multi_gpu_test, kvcompd_bench with
#                      engine.cuda_devices naming every GPU), the decode GPU test and benchmark
#                      (KVCOMP_DECODE_BENCH_ARGS), the GPU-link fault campaign ("faults", not a
#                      default part: KVCOMP_FAULT_SECONDS per link, bench/reliability/
#                      gpu_campaign.cc), the integration tests against kvcompd with
#                      the CUDA backend and the GPU tier (failed cases again with the host
#                      tier), the end-to-end benchmark
#                      (KVCOMP_DAEMON_BENCH_TOKENS, default "8192 32768"; KVCOMP_DAEMON_BACKENDS,
#                      default cuda, "cuda cpu" adds the CPU backend at KVCOMP_DAEMON_CPU_TOKENS,
#                      default 8192), its KVSplice case (kvcompd_bench --kvsplice at
#                      KVCOMP_DAEMON_KVSPLICE_TOKENS, default "8192 32768") and the pipeline
#                      benchmark (KVCOMP_PIPELINE_ARGS); logs in daemon.log
#   run(command="KVCOMP_GPU_STEPS=daemon bash bench/gpu/run.sh", carry=[".gpubundle"])
# The host transports and durable writes on this machine's cores and disk are a step of their
# own, from a CPU build's bundle (bench/transport/device.sh says how to make and carry it):
#   run(command="bash bench/transport/device.sh .dev/host/bundle.tar.xz", carry=[".dev/host"])
# Local use (no device): OUT=/tmp/out bash bench/gpu/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/build-gpu-out}
mkdir -p "$OUT"
SYSROOT=$ROOT/.sysroot/usr
BUILD=${KVCOMP_GPU_BUILD:-$ROOT/build-gpu}
STEPS=${KVCOMP_GPU_STEPS:-env build test bench}
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/usr/local/cuda/bin:$PATH
export LD_LIBRARY_PATH=$SYSROOT/lib/x86_64-linux-gnu:$SYSROOT/lib/x86_64-linux-gnu/blas:$SYSROOT/lib/x86_64-linux-gnu/lapack${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
JOBS=$(nproc)
T0=$(date +%s)

note() { echo "$*" | tee -a "$SUMMARY"; }
phase() { echo "== $1 ($(($(date +%s) - T0)) s)"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }

if { has build || has python; } && [ ! -d "$SYSROOT" ]; then
  echo "run.sh: $SYSROOT missing: run scripts/gpu_sysroot.sh here and pass carry=[\".sysroot\"]" >&2
  exit 2
fi

COMMIT=${KVCOMP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
DIRTY=$(git status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo "+dirty" || true)
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
note "date    $(date -u +%Y-%m-%dT%H:%MZ)"
note "commit  ${COMMIT}${DIRTY}"
note "card    ${CARD:-none}"

if has env; then
  phase env
  {
    nvidia-smi
    head -2 /etc/os-release
    ldd --version | head -1
    nvcc --version
    c++ --version
    cmake --version
    ninja --version
    python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
    ls /usr/local/cuda/lib64 | grep -E 'cublas|cusolver|cudart' | head -20
    nproc
    free -g
  } >"$OUT/env.log" 2>&1
fi

build_ok=1
if has build; then
  phase configure
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DKVCOMP_CUDA=ON -DKVCOMP_CORE_ONLY=ON -DKVCOMP_PYTHON=OFF \
    -DCMAKE_PREFIX_PATH="$SYSROOT" -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
    -DCMAKE_BUILD_RPATH="$SYSROOT/lib/x86_64-linux-gnu" >"$OUT/build.log" 2>&1 || build_ok=0
  if [ "$build_ok" = 1 ]; then
    phase build
    # -k 0: keep going past a broken target so the other targets' tests still run.
    cmake --build "$BUILD" -j "$JOBS" -- -k 0 ${KVCOMP_GPU_TARGETS:-} >>"$OUT/build.log" 2>&1 || build_ok=0
  fi
  if [ "$build_ok" = 1 ]; then
    note "build   ok ($(($(date +%s) - T0)) s)"
  else
    note "build   FAILED (see build.log; errors below)"
    grep -E "error|FAILED|Error" "$OUT/build.log" | head -40
  fi
fi

if has test && [ -d "$BUILD" ]; then
  phase test
  ctest --test-dir "$BUILD" -L gpu --output-on-failure -j 4 --timeout 300 ${KVCOMP_CTEST_ARGS:-} \
    >"$OUT/ctest-gpu.log" 2>&1
  note "gpu     $(grep -E 'tests passed|No tests were found' "$OUT/ctest-gpu.log" | tail -1)"
  ctest --test-dir "$BUILD" -LE gpu --output-on-failure -j "$JOBS" --timeout 300 ${KVCOMP_CTEST_ARGS:-} \
    >"$OUT/ctest-unit.log" 2>&1
  note "unit    $(grep -E 'tests passed|No tests were found' "$OUT/ctest-unit.log" | tail -1)"
  grep -hE '^\s+[0-9]+ - .*\((Failed|SEGFAULT|Timeout|Subprocess aborted|Child aborted|Exception)' \
    "$OUT/ctest-gpu.log" "$OUT/ctest-unit.log" | head -20 | tee -a "$SUMMARY"
fi

# python: the extension in its own build (KVCOMP_CORE_ONLY: no kvcomp.Client), then the CUDA
# round trip through kvcomp.compress/decompress/calibrate against the CPU (python.log), then the
# other Python tests that need no daemon (all into python.log).
if has python; then
  phase python
  PY=${KVCOMP_GPU_PYTHON:-$(command -v python3)}
  PYBUILD=${KVCOMP_GPU_PYBUILD:-$BUILD-python}
  py_args=(-DPython_EXECUTABLE="$PY" -DKVCOMP_PYTHON_PACKAGE_DIR="$PYBUILD/pkg")
  # nanobind as CI builds with it, and CPython headers where the interpreter has none (both
  # carried in the sysroot by scripts/gpu_sysroot.sh); else the interpreter's own.
  nb_dir=$ROOT/.sysroot/nanobind/cmake
  [ -f "$nb_dir/nanobind-config.cmake" ] || nb_dir=$("$PY" -m nanobind --cmake_dir 2>/dev/null)
  [ -n "$nb_dir" ] && py_args+=(-Dnanobind_DIR="$nb_dir")
  py_inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)
  py_ver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
  carried_inc=$ROOT/.sysroot/python-headers/python$py_ver
  if [ ! -f "$py_inc/Python.h" ] && [ -f "$carried_inc/Python.h" ]; then
    py_inc=$carried_inc
    py_args+=(-DPython_INCLUDE_DIR="$py_inc")
  fi
  PYLOG=$OUT/python.log  # build, then both pytest runs (the device returns at most 8 files)
  echo "python $PY ($py_ver), headers $py_inc, nanobind $nb_dir" >"$PYLOG"
  py_ok=1
  cmake -S "$ROOT" -B "$PYBUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DKVCOMP_CUDA=ON -DKVCOMP_CORE_ONLY=ON -DKVCOMP_PYTHON=ON "${py_args[@]}" \
    -DCMAKE_PREFIX_PATH="$SYSROOT" -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
    -DCMAKE_BUILD_RPATH="$SYSROOT/lib/x86_64-linux-gnu" >>"$PYLOG" 2>&1 &&
    cmake --build "$PYBUILD" -j "$JOBS" --target _kvcomp >>"$PYLOG" 2>&1 || py_ok=0
  if [ "$py_ok" = 1 ]; then
    # -rfEs: failures, errors and skip reasons in the short summary (a skip of the round trip
    # means Python could not use the GPU); COLUMNS: room for the assertion messages there.
    for part in roundtrip others; do
      if [ "$part" = roundtrip ]; then sel=(tests/python/test_cuda_roundtrip.py); else
        # Not here: the client (needs kvcompd, not built core-only) and the quality harness smoke
        # (runs the harness with PYTHONPATH=client/python, where this build puts no extension).
        sel=(tests/python --ignore=tests/python/test_cuda_roundtrip.py
          --ignore=tests/python/test_client.py
          --deselect tests/python/test_moments.py::test_quality_harness_smoke); fi
      echo "### pytest $part" >>"$PYLOG"
      PYTHONPATH="$PYBUILD/pkg" KVCOMP_BUILD_DIR="$PYBUILD" PYTHONUNBUFFERED=1 COLUMNS=200 \
        timeout 300 "$PY" -m pytest -q -rfEs -p no:cacheprovider "${sel[@]}" \
        >"$PYBUILD/pytest-$part.log" 2>&1
      rc=$?
      cat "$PYBUILD/pytest-$part.log" >>"$PYLOG"
      res=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)' \
        "$PYBUILD/pytest-$part.log" | tail -1)
      note "python  $part: ${res:-no result (exit $rc)}"
      grep -E '^(SKIPPED|FAILED|ERROR)' "$PYBUILD/pytest-$part.log" | head -8 | tee -a "$SUMMARY"
    done
  else
    note "python  build FAILED (see python.log; errors below)"
    grep -E "error|FAILED|Error" "$PYLOG" | head -40
  fi
fi

if has bench && [ -d "$BUILD" ]; then
  phase bench
  : >"$OUT/bench.log"
  # Every GPU benchmark binary is named kvcomp_bench_gpu_*; each prints RESULT lines.
  for b in $(find "$BUILD" -maxdepth 3 -type f -name 'kvcomp_bench_gpu_*' -perm -u+x | sort |
      grep -E "${KVCOMP_BENCH_FILTER:-.}"); do
    echo "### $b" >>"$OUT/bench.log"
    timeout 240 "$b" ${KVCOMP_BENCH_ARGS:-} >>"$OUT/bench.log" 2>&1 ||
      note "bench   $(basename "$b") exited $?"
  done
  # The device work of the daemon's default put alone (CompressToDevice, plain and staged input)
  # at the short and long lengths of the kernel table.
  pipe=$BUILD/bench/gpu/kvcomp_bench_gpu_pipeline
  if [ -x "$pipe" ] && [[ "kvcomp_bench_gpu_pipeline" =~ ${KVCOMP_BENCH_FILTER:-.} ]]; then
    echo "### $pipe --device-only" >>"$OUT/bench.log"
    timeout 240 "$pipe" --device-only --tokens 2048,8192,32768,65536 >>"$OUT/bench.log" 2>&1 ||
      note "bench   kvcomp_bench_gpu_pipeline --device-only exited $?"
  fi
  if [ "${KVCOMP_TORCH_REF:-1}" = 1 ] && [ -f bench/gpu/torch_reference.py ]; then
    echo "### torch_reference.py" >>"$OUT/bench.log"
    PYTHONUNBUFFERED=1 timeout 180 python3 bench/gpu/torch_reference.py >>"$OUT/bench.log" 2>&1 ||
      note "bench   torch_reference.py exited $?"
  fi
  if [ "${KVCOMP_KVPRESS:-1}" = 1 ] && ls .whl/kvpress-*.whl >/dev/null 2>&1; then
    echo "### kvpress_bench.py" >>"$OUT/bench.log"
    PYTHONUNBUFFERED=1 timeout 180 python3 bench/gpu/kvpress_bench.py >>"$OUT/bench.log" 2>&1 ||
      note "bench   kvpress_bench.py exited $?"
  fi
  grep -h '^RESULT' "$OUT/bench.log" | sed 's/^RESULT //' | column -t >>"$SUMMARY" 2>/dev/null ||
    grep -h '^RESULT' "$OUT/bench.log" >>"$SUMMARY"
fi

# daemon: kvcompd as a whole on this machine, from the bundle scripts/gpu_bundle.sh builds
# elsewhere (this machine has none of the service's libraries). The integration tests start their
# own daemons; the CUDA backend and the GPU tier reach every one of them through the daemon's
# environment variables (docs/configuration.md), which a flag a test passes still overrides.
if has daemon; then
  phase daemon
  BUNDLE=$ROOT/build-gpu-bundle
  DLOG=$OUT/daemon.log
  : >"$DLOG"
  if [ -f "$ROOT/.gpubundle/bundle.tar.xz" ]; then
    rm -rf "$BUNDLE" && mkdir -p "$BUNDLE" && tar -C "$BUNDLE" -xJf "$ROOT/.gpubundle/bundle.tar.xz"
  fi
  if [ ! -x "$BUNDLE/bin/kvcompd" ]; then
    note "daemon  no bundle: run scripts/gpu_bundle.sh where it was built, carry=[\".gpubundle\"]"
  else
    (
      # shellcheck disable=SC1091
      source "$BUNDLE/env.sh"
      note "bundle  built at $(tr '\n' ' ' <"$BUNDLE/commit")"
      note "os      $(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-?}"), $(ldd --version 2>&1 | head -1)"
      missing=$(ldd "$BUNDLE"/bin/* 2>&1 | grep 'not found' | sort -u)
      [ -z "$missing" ] || note "daemon  unresolved libraries: $(echo $missing)"
      # The tests start the kvcompd whose path was compiled into them: point it at the bundle's.
      built=$(cat "$BUNDLE/kvcompd_build_path")
      # (Where that path is the real build, as on the machine that built the bundle, it stays.)
      if [ ! -e "$built" ] || [ -L "$built" ]; then
        mkdir -p "$(dirname "$built")" && ln -sf "$BUNDLE/bin/kvcompd" "$built"
      fi
      # And the GPU channel test at its peer process's.
      if [ -f "$BUNDLE/gpu_channel_peer_build_path" ]; then
        peer=$(cat "$BUNDLE/gpu_channel_peer_build_path")
        if [ ! -e "$peer" ] || [ -L "$peer" ]; then
          mkdir -p "$(dirname "$peer")" && ln -sf "$BUNDLE/bin/gpu_channel_peer" "$peer"
        fi
      fi
      # NCCL for every process (the daemon, the tests, the Python SDK): PyTorch's, one library.
      if [ -z "${KVCOMP_NCCL_LIBRARY:-}" ]; then
        KVCOMP_NCCL_LIBRARY=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
        export KVCOMP_NCCL_LIBRARY
      fi
      note "nccl    ${KVCOMP_NCCL_LIBRARY:-not found}"
      export KVCOMP_ENGINE_BACKEND=cuda KVCOMP_STORAGE_PUT_TIER=device
      export KVCOMP_STORAGE_DEVICE_CAPACITY_BYTES=${KVCOMP_DAEMON_DEVICE_BYTES:-8Gi}
      PARTS=" ${KVCOMP_DAEMON_PARTS:-devpath channel multigpu decode integration bench pipeline} "
      TMPD=$(mktemp -d)

      # One gtest binary: its output into daemon.log, its totals into the summary.
      gtest() {  # binary, time limit, optional label of the run
        local b=$1 limit=$2 label=${3:+ ($3)} rc log=$TMPD/$1${3:+-$3}.log
        [ -x "$BUNDLE/bin/$b" ] || { note "daemon  $b: not in the bundle"; return; }
        local t0=$(date +%s)
        echo "### $b$label" >>"$DLOG"
        # Streamed into daemon.log as it runs (what a run cut short by its limit still returns).
        timeout "$limit" "$BUNDLE/bin/$b" --gtest_brief=1 ${KVCOMP_GTEST_ARGS:-} 2>&1 |
          tee "$log" >>"$DLOG"
        rc=${PIPESTATUS[0]}
        echo "### $b$label: exit $rc, $(($(date +%s) - t0)) s" >>"$DLOG"
        # --gtest_brief prints the failures and the totals of tests run and passed.
        local ran passed failed
        ran=$(sed -n 's/^\[==========\] \([0-9]*\) tests\{0,1\} from.*ran.*/\1/p' "$log" | tail -1)
        passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$log" | tail -1)
        failed=$(grep -cE '^\[  FAILED  \] .*\([0-9]+ ms\)$' "$log")
        note "daemon  $b$label: ${ran:-0} run, ${passed:-0} passed, $failed failed, exit $rc, $(($(date +%s) - t0)) s"
        grep -E '^\[  FAILED  \] .*\([0-9]+ ms\)$' "$log" | sort -u | head -10 | tee -a "$SUMMARY"
      }

      if [[ "$PARTS" == *" decode "* ]]; then
        gtest decode_attention_cuda_test 120
        if [ -x "$BUNDLE/bin/kvcomp_bench_gpu_decode" ]; then
          echo "### kvcomp_bench_gpu_decode" >>"$DLOG"
          timeout 180 "$BUNDLE/bin/kvcomp_bench_gpu_decode" ${KVCOMP_DECODE_BENCH_ARGS:-} 2>&1 |
            tee -a "$DLOG" | grep '^RESULT' | sed 's/^RESULT /decode  /' >>"$SUMMARY"
        fi
      fi

      if [[ "$PARTS" == *" devpath "* ]]; then
        # The device-resident put path in process (bytes across host and device per put, the
        # GPU memory cap, device-memory blocks, an injected sticky error, the CPU twin).
        gtest service_device_path_test 120
      fi

      if [[ "$PARTS" == *" channel "* ]]; then
        # The GPU channel and the device payloads against the bundle's kvcompd: the SDK's GPU
        # channel (CUDA IPC on one GPU; its NCCL cases need two), device payloads into the
        # GPU tier and the device CRC and format kernels; then the Python SDK's device paths
        # (torch tensors in, the GPU channel, CUDA-aware UCX where the bundle's UCX has it).
        for t in client_gpu_channel_gpu_test storage_device_payload_test \
            kernels_device_crc32c_test kernels_device_format_test; do
          gtest "$t" 180
        done
        if [ -n "${KVCOMP_BUNDLE_PYTHON:-}" ]; then
          plog=$TMPD/pytest-channel.log
          echo "### pytest (GPU channel, device paths)" >>"$DLOG"
          PYTHONPATH=$KVCOMP_BUNDLE_PYTHON:$ROOT/tests/integration KVCOMPD=$BUNDLE/bin/kvcompd \
            timeout 240 python3 -m pytest -q -rfEs -p no:cacheprovider \
            tests/python/test_gpu_channel.py tests/python/test_gpu_device_path.py \
            tests/python/test_cuda_ucx_path.py >"$plog" 2>&1
          cat "$plog" >>"$DLOG"
          note "daemon  pytest channel: $(grep -E '(passed|failed|skipped|error)' "$plog" | tail -1)"
          grep -E '^(SKIPPED|FAILED|ERROR)' "$plog" | head -8 | tee -a "$SUMMARY"
        fi
      fi

      if [[ "$PARTS" == *" multigpu "* ]]; then
        # Engines on two GPUs in process (placement, the GPU tier's pool per device, the cap per
        # device, one engine's sticky error; skipped with one GPU), then kvcompd end to end with
        # engine.cuda_devices naming every GPU: the bench's puts spread over the engines.
        gtest service_multi_gpu_test 180
        ngpu=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
        if [ "$ngpu" -ge 2 ] && [ -x "$BUNDLE/bin/kvcompd_bench" ]; then
          devs=$(seq -s, 0 $((ngpu - 1)))
          mlog=$TMPD/bench-multigpu.yaml
          echo "### kvcompd_bench cuda_devices=$devs" >>"$DLOG"
          KVCOMP_ENGINE_BACKEND=cuda timeout 150 "$BUNDLE/bin/kvcompd_bench" \
            --kvcompd "$BUNDLE/bin/kvcompd" --tls tcp --ingest_tokens 32768 --tokens 32768 \
            --gets 4 -- --engine.backend=cuda --engine.cuda_devices="$devs" \
            --storage.put_tier=device --storage.device_capacity_bytes=32Gi >"$mlog" 2>>"$DLOG"
          rc=$?
          cat "$mlog" >>"$DLOG"
          note "multi   kvcompd_bench 32768 tok on GPUs $devs: exit $rc, $(grep -m1 -oE 'put_s: [0-9.]+' "$mlog" || echo 'no put'), $(grep -m1 -oE 'stored_bytes: [0-9]+' "$mlog")"
        fi
      fi

      if [[ "$PARTS" == *" faults "* ]] && [ -x "$BUNDLE/bin/kvcomp_gpu_campaign" ]; then
        # Faults on the GPU links (bench/reliability/gpu_campaign.cc): client processes killed or
        # stopped in the middle of device puts and gets, over NCCL (two GPUs) and CUDA IPC, for
        # KVCOMP_FAULT_SECONDS (default 90) each, beside a healthy client's byte-compared round
        # trips; wrong outputs must be 0.
        fsec=${KVCOMP_FAULT_SECONDS:-90}
        flog=$TMPD/faults.log
        echo "### kvcomp_gpu_campaign ${fsec} s per link" >>"$DLOG"
        timeout $((2 * fsec + 150)) "$BUNDLE/bin/kvcomp_gpu_campaign" \
          --kvcompd="$BUNDLE/bin/kvcompd" --dir="$TMPD/faults" --seconds="$fsec" >"$flog" 2>&1
        frc=$?
        cat "$flog" >>"$DLOG"
        note "faults  kvcomp_gpu_campaign: exit $frc"
        grep -E '^RESULT|skipped|# problem' "$flog" | sed 's/^RESULT /faults  /' | head -12 | tee -a "$SUMMARY"
      fi

      if [[ "$PARTS" == *" integration "* ]]; then
        # First one daemon by hand: its engine line says which backend it took.
        dd=$TMPD/smoke
        mkdir -p "$dd"
        "$BUNDLE/bin/kvcompd" --data_plane.port=0 --control_plane.port=0 --metrics.port=0 \
          --storage.data_dir="$dd/data" --process.ready_file="$dd/ready.yaml" >"$dd/log" 2>&1 &
        pid=$!
        for _ in $(seq 150); do [ -s "$dd/ready.yaml" ] && break; sleep 0.2; done
        kill -TERM "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
        { echo "### kvcompd started by hand"; cat "$dd/log"; } >>"$DLOG"
        note "daemon  $(grep -m1 -o 'engine: .*' "$dd/log" || echo 'no engine line (see daemon.log)')"
        for t in kvcompd_daemon_test kvcompd_control_security_lifecycle_test \
            kvcompd_housekeeping_test client_daemon_test; do
          gtest "$t" "${KVCOMP_DAEMON_TEST_TIMEOUT:-150}"
          # Cases that failed, again with the host tier (still the CUDA backend): tells a case
          # that expects the default tier from one the GPU path breaks.
          failed=$(sed -n 's/^\[  FAILED  \] \([^ ,]*\).*([0-9]* ms)$/\1/p' "$TMPD/$t.log" |
            sort -u | paste -sd: -)
          if [ -n "$failed" ]; then
            (
              export KVCOMP_STORAGE_PUT_TIER=host KVCOMP_GTEST_ARGS="--gtest_filter=$failed"
              gtest "$t" "${KVCOMP_DAEMON_TEST_TIMEOUT:-150}" host-tier
            )
          fi
        done
      fi

      if [[ "$PARTS" == *" bench "* ]] && [ -x "$BUNDLE/bin/kvcompd_bench" ]; then
        # kvcompd end to end: a Llama-3.1-8B-shaped cache (32 layers, 8 kv heads, d 128, bf16)
        # pushed over UCX tcp and fetched back, the default policy (manifold, ratio 0.5,
        # moments); the daemon's stage sums over its three puts (two ingests, one for the gets).
        for backend in ${KVCOMP_DAEMON_BACKENDS:-cuda}; do
          tokens_list=${KVCOMP_DAEMON_BENCH_TOKENS:-8192 32768}
          [ "$backend" = cpu ] && tokens_list=${KVCOMP_DAEMON_CPU_TOKENS:-8192}
          for tokens in $tokens_list; do
            echo "### kvcompd_bench $backend $tokens" >>"$DLOG"
            blog=$TMPD/bench-$backend-$tokens.yaml
            tier=(--storage.put_tier=device --storage.device_capacity_bytes=32Gi)
            [ "$backend" = cpu ] && tier=(--storage.put_tier=host)
            KVCOMP_ENGINE_BACKEND=$backend timeout 150 "$BUNDLE/bin/kvcompd_bench" \
              --kvcompd "$BUNDLE/bin/kvcompd" --tls tcp --ingest_tokens "$tokens" \
              --tokens "$tokens" --gets "${KVCOMP_DAEMON_GETS:-10}" -- \
              --engine.backend="$backend" "${tier[@]}" >"$blog" 2>>"$DLOG" ||
              note "bench   kvcompd_bench $backend $tokens exited $?"
            cat "$blog" >>"$DLOG"
            python3 - "$blog" "$backend" "$tokens" <<'PY' | tee -a "$SUMMARY"
import re, sys
text = open(sys.argv[1]).read()
def num(key, block=""):
    m = re.search(block + r".*?\b" + key + r": ([0-9.]+)", text, re.S)
    return float(m.group(1)) if m else float("nan")
ingest = [(float(b), float(s), float(r), float(p)) for b, s, r, p in re.findall(
    r"bytes: (\d+)\n\s+stored_bytes: (\d+)\n\s+receive_s: ([0-9.]+)\n.*?put_s: ([0-9.]+)",
    text, re.S)]
if not ingest:
    print(f"e2e     {sys.argv[2]} {sys.argv[3]} tokens: no result")
    sys.exit()
orig, stored = ingest[0][0], ingest[0][1]
stages = {k: num(k, "daemon_stage_seconds_sum:")
          for k in ("receive", "to_device", "compress", "download", "encode", "store", "serve")}
puts = 3  # two ingest puts and the put for the gets, all the same size
comp = stages["compress"] / puts
saved_s = (orig - stored) / 50e9  # a 400 Gb/s link
print(f"e2e     {sys.argv[2]:4s} {int(sys.argv[3]):6d} tok: {orig/1e9:.2f} GB -> {stored/1e9:.2f} GB, "
      f"receive {ingest[0][2]:.3f}/{ingest[1][2] if len(ingest) > 1 else float('nan'):.3f} s, "
      f"put {ingest[0][3]:.3f}/{ingest[1][3] if len(ingest) > 1 else float('nan'):.3f} s; per put: "
      f"receive {stages['receive']/puts:.3f} to_device {stages['to_device']/puts:.4f} "
      f"compress {comp:.4f} download {stages['download']/puts:.4f} "
      f"encode {stages['encode']/puts:.4f} store {stages['store']/puts:.3f} s; "
      f"serve {stages['serve']:.3f} s total, get p50 {num('p50_ms', 'get:'):.1f} ms; "
      f"compress / transfer saved at 400 Gb/s = {comp / saved_s * 100:.0f}%, with the download "
      f"{(comp + stages['download'] / puts) / saved_s * 100:.0f}%")
PY
          done
        done
        # The KVSplice case (kvcompd_bench --kvsplice) on the CUDA backend and the GPU tier: an
        # earlier request stored with raw values, the SDK's Calibrate (error budget 0.1), then the
        # same cache put with the default eviction and with int8 keys + KVSplice values; bytes,
        # the daemon's stages per put, h2d/d2h bytes, gets as stored and decoded, the decoded
        # values checked. KVCOMP_DAEMON_KVSPLICE_TOKENS (default "8192 32768"; "" skips it).
        for tokens in ${KVCOMP_DAEMON_KVSPLICE_TOKENS-8192 32768}; do
          echo "### kvcompd_bench --kvsplice cuda $tokens" >>"$DLOG"
          klog=$TMPD/bench-kvsplice-$tokens.yaml
          KVCOMP_ENGINE_BACKEND=cuda timeout 300 "$BUNDLE/bin/kvcompd_bench" \
            --kvcompd "$BUNDLE/bin/kvcompd" --tls tcp --kvsplice --tokens "$tokens" \
            --gets "${KVCOMP_DAEMON_KVSPLICE_GETS:-5}" -- --engine.backend=cuda \
            --storage.put_tier=device --storage.device_capacity_bytes=32Gi >"$klog" 2>>"$DLOG" ||
            note "bench   kvcompd_bench --kvsplice $tokens exited $?"
          cat "$klog" >>"$DLOG"
          grep '^RESULT' "$klog" | sed 's/^RESULT /e2e-ks  /' >>"$SUMMARY"
        done
      fi
      if [[ "$PARTS" == *" pipeline "* ]] && [ -x "$BUNDLE/bin/kvcomp_bench_gpu_pipeline" ]; then
        # The compression stage alone, in process: staging, Compress from host and from device
        # memory, serialisation, with and without KVSplice (bench/gpu/pipeline_bench.cc).
        echo "### kvcomp_bench_gpu_pipeline" >>"$DLOG"
        timeout 240 "$BUNDLE/bin/kvcomp_bench_gpu_pipeline" ${KVCOMP_PIPELINE_ARGS:-} 2>&1 |
          tee -a "$DLOG" | grep '^RESULT' | sed 's/^RESULT /pipe    /' >>"$SUMMARY"
      fi
      rm -rf "$TMPD"
    )
  fi
fi

# KVCOMP_GPU_EXTRA: one more command, run in this environment (sysroot on the loader path, the
# build in $BUILD), e.g. a profiler over one benchmark; its output goes to $OUT/extra.log.
if [ -n "${KVCOMP_GPU_EXTRA:-}" ]; then
  phase extra
  export BUILD
  (eval "$KVCOMP_GPU_EXTRA") >"$OUT/extra.log" 2>&1 || note "extra   exited $?"
fi

phase done
echo
echo "================ summary ================"
cat "$SUMMARY"
