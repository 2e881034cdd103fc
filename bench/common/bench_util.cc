#include "common/bench_util.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace kvcomp {
namespace bench {

void ExitIfError(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Best(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

double MedianSeconds(int reps, const std::function<void()>& fn) {
  using Clock = std::chrono::steady_clock;
  fn();
  std::vector<double> s;
  for (int i = 0; i < reps; ++i) {
    const Clock::time_point t0 = Clock::now();
    fn();
    s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return Median(std::move(s));
}

KvLayout Llama8bLayout() { return KvLayout{32, 8, 32, 128, DType::kBF16}; }

bool ParseTokensAndReps(int argc, char** argv, const char* name, TokensAndReps* args) {
  std::string usage =
      absl::StrCat("usage: ", name, " [--tokens ", absl::StrJoin(args->tokens, ","), "] [--reps ",
                   args->reps, "]");
  for (const auto& [flag, on] : args->switches) absl::StrAppend(&usage, " [", flag, "]");
  usage += "\n";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    bool ok = i + 1 < argc;
    if (auto s = args->switches.find(a); s != args->switches.end()) {
      s->second = true;
      ok = true;
    } else if (ok && a == "--tokens") {
      args->tokens.clear();
      for (absl::string_view t : absl::StrSplit(argv[++i], ',')) {
        uint64_t n = 0;
        ok = ok && absl::SimpleAtoi(t, &n);
        args->tokens.push_back(n);
      }
    } else if (ok && a == "--reps") {
      args->reps = std::max(1, std::atoi(argv[++i]));
    } else {
      ok = false;
    }
    if (!ok) {
      std::fputs(usage.c_str(), stderr);
      return false;
    }
  }
  return true;
}

void PrintRate(const char* bench, int name_width, const char* name, double bytes,
               const std::vector<double>& secs) {
  if (secs.empty()) return;
  std::printf("RESULT %s %-*s best %7.2f GB/s  median %7.2f GB/s  (%zu runs, %.3f s best)\n", bench,
              name_width, name, bytes / Best(secs) / 1e9, bytes / Median(secs) / 1e9, secs.size(),
              Best(secs));
}

}  // namespace bench
}  // namespace kvcomp
