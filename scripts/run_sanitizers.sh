#!/usr/bin/env bash
# Part of `make test`: the core tests (format parser included) under ASan+UBSan, and a bounded
# libFuzzer run of the format parser (KVCOMP_FUZZ_SECONDS, default 90) and of the token file and
# configuration parsers and the wire protocol and Thrift request decoders
# (KVCOMP_PARSER_FUZZ_SECONDS each, default 10).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=$(nproc)
FUZZ_SECONDS=${KVCOMP_FUZZ_SECONDS:-90}
# Line tables only (-g1): what the sanitizers' and libFuzzer's reports need for file:line, at a
# fraction of full debug information's disk and compile time.
g1=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG"
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG")
common=(-G Ninja -DKVCOMP_CORE_ONLY=ON -DKVCOMP_CUDA=OFF -DKVCOMP_PYTHON=OFF "${g1[@]}")
# In CI (CI=true) each of these builds is removed once its tests have passed (disk: README.md,
# "Disk"); elsewhere they stay for the next run.
done_with() { if [ "${CI:-}" = true ]; then rm -rf "$@"; fi; }

echo "-- ASan+UBSan build of the core tests"
cmake -S . -B build-asan "${common[@]}" -DKVCOMP_SANITIZE=address,undefined >/dev/null
# Every core test that tests/core/CMakeLists.txt declares, so a new one is built and run here too.
mapfile -t core_tests < <(sed -n 's/.*kvcomp_cc_test(NAME \(core_[A-Za-z0-9_]*\).*/\1/p' \
  tests/core/CMakeLists.txt)
cmake --build build-asan -j "$JOBS" --target "${core_tests[@]}"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan -R '^core_' --output-on-failure
done_with build-asan

echo "-- libFuzzer: format parser for ${FUZZ_SECONDS}s"
CC=clang-14 CXX=clang++-14 cmake -S . -B build-fuzz "${common[@]}" -DKVCOMP_FUZZ=ON \
  -DKVCOMP_WERROR=OFF >/dev/null
cmake --build build-fuzz -j "$JOBS" --target format_parse_fuzz format_seed_corpus
corpus=build-fuzz/format_corpus
mkdir -p "$corpus"
build-fuzz/tests/fuzz/format_seed_corpus "$corpus"
build-fuzz/tests/fuzz/format_parse_fuzz -max_total_time="$FUZZ_SECONDS" -max_len=65536 \
  -print_final_stats=1 "$corpus" 2>&1 | tail -n 12
echo "fuzz: format parser ran ${FUZZ_SECONDS}s clean"

# The token file and configuration parsers: a few seconds each from their seed corpora.
PARSER_FUZZ_SECONDS=${KVCOMP_PARSER_FUZZ_SECONDS:-10}
cmake --build build-fuzz -j "$JOBS" --target token_file_fuzz config_yaml_fuzz
for target in token_file config_yaml; do
  echo "-- libFuzzer: ${target} parser for ${PARSER_FUZZ_SECONDS}s"
  work=build-fuzz/${target}_corpus
  mkdir -p "$work"
  build-fuzz/tests/fuzz/${target}_fuzz -max_total_time="$PARSER_FUZZ_SECONDS" -max_len=4096 \
    -print_final_stats=1 "$work" tests/fuzz/corpus/${target} 2>&1 | tail -n 4
  echo "fuzz: ${target} parser ran ${PARSER_FUZZ_SECONDS}s clean"
done

# The network decoders: the data-plane wire protocol and the control plane's Thrift requests,
# a few seconds each from seeds their own encoders write.
cmake --build build-fuzz -j "$JOBS" --target wire_protocol_fuzz wire_seed_corpus \
  thrift_request_fuzz thrift_seed_corpus
for target in wire_protocol thrift_request; do
  echo "-- libFuzzer: ${target} decoder for ${PARSER_FUZZ_SECONDS}s"
  work=build-fuzz/${target}_corpus
  mkdir -p "$work"
  build-fuzz/tests/fuzz/${target%%_*}_seed_corpus "$work" >/dev/null
  build-fuzz/tests/fuzz/${target}_fuzz -max_total_time="$PARSER_FUZZ_SECONDS" -max_len=16384 \
    -print_final_stats=1 "$work" 2>&1 | tail -n 4
  echo "fuzz: ${target} decoder ran ${PARSER_FUZZ_SECONDS}s clean"
done

echo "-- ASan+UBSan build of the data-plane tests (wire protocol parser, UCX server and client)"
done_with build-fuzz
cmake -S . -B build-asan-transport -G Ninja -DKVCOMP_CUDA=OFF -DKVCOMP_PYTHON=OFF \
  "${g1[@]}" -DKVCOMP_SANITIZE=address,undefined >/dev/null
# Every transport test that tests/transport/CMakeLists.txt declares, and the peer one of them runs.
mapfile -t transport_tests < <(sed -n \
  's/.*kvcomp_cc_test(NAME \(transport_[A-Za-z0-9_]*\).*/\1/p' tests/transport/CMakeLists.txt)
cmake --build build-asan-transport -j "$JOBS" --target "${transport_tests[@]}" \
  transport_vanishing_client
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan-transport -R '^transport_' --output-on-failure
done_with build-asan-transport
