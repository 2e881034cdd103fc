// What kvcomp's benchmark binaries share: exiting with a message on a failed status, medians of
// timed runs, the Llama-3.1-8B cache shape they measure, the --tokens/--reps arguments of the
// in-process GPU benchmarks and the RESULT line of a transfer rate. Host code only (no CUDA
// headers), so binaries built without the CUDA toolkit use it too.
#ifndef KVCOMP_BENCH_COMMON_BENCH_UTIL_H_
#define KVCOMP_BENCH_COMMON_BENCH_UTIL_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvcomp/core/layout.h"

// Exits with status 1 when `expr` (an absl::Status) is not OK, printing where and what failed.
#define KVCOMP_BENCH_CHECK_OK(expr)                                     \
  do {                                                                  \
    const absl::Status bench_status_ = (expr);                          \
    if (!bench_status_.ok()) {                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, \
                   bench_status_.ToString().c_str());                   \
      std::exit(1);                                                     \
    }                                                                   \
  } while (0)

namespace kvcomp {
namespace bench {

// Prints "what: status" to stderr and exits with status 1 when `s` is not OK.
void ExitIfError(const absl::Status& s, const char* what);

// The value of `v`, or ExitIfError's message and exit.
template <typename T>
T ValueOrExit(absl::StatusOr<T> v, const char* what) {
  ExitIfError(v.status(), what);
  return *std::move(v);
}

// The median (the upper one of an even count) and the smallest of `v`; `v` not empty.
double Median(std::vector<double> v);
double Best(const std::vector<double>& v);

// Median wall-clock seconds of `reps` calls of `fn`, after one untimed call.
double MedianSeconds(int reps, const std::function<void()>& fn);

// The cache shape the GPU benchmarks measure: Llama-3.1-8B (32 layers, 8 kv heads, 32 q heads,
// head_dim 128, bf16).
KvLayout Llama8bLayout();

// Arguments of the in-process GPU benchmarks: --tokens 8192,32768 (comma-separated token
// counts), --reps N (at least 1) and the on/off switches a benchmark names in `switches` (e.g.
// "--device-only"; a switch given on the command line is set to true). The fields hold the
// defaults until parsed.
struct TokensAndReps {
  std::vector<uint64_t> tokens = {8192, 32768};
  int reps = 1;
  std::map<std::string, bool> switches;
};

// Parses argv into `args`. Anything else, or a token count that is not a number, prints
// "usage: <name> [--tokens 8192,32768] [--reps R] [switch]..." (the defaults) to stderr and
// returns false.
bool ParseTokensAndReps(int argc, char** argv, const char* name, TokensAndReps* args);

// One RESULT line of a transfer rate over the runs `secs` of `bytes` each, `name` left-aligned
// in `name_width` columns:
//   RESULT <bench> <name> best X GB/s  median Y GB/s  (N runs, S s best)
// Nothing when `secs` is empty.
void PrintRate(const char* bench, int name_width, const char* name, double bytes,
               const std::vector<double>& secs);

}  // namespace bench
}  // namespace kvcomp

#endif  // KVCOMP_BENCH_COMMON_BENCH_UTIL_H_
