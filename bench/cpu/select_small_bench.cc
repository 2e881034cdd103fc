// The CPU token selection (ScoringOps::Select) of short heads, as small puts make it: 4 kv heads
// per layer, ratio 0.5, uniform and AdaKV budgets, scores from normal(0, 1), one worker thread
// (kvcompd's engine.cpu_threads default), from 16 to 32,768 tokens per head. Prints the median
// time per call over --reps runs of --calls calls each, and the tokens per microsecond.
//   build/bench/cpu/bench_cpu_select_small [--reps=N] [--calls=N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/scoring_ops.h"

int main(int argc, char** argv) {
  int reps = 5, calls = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--reps=", 7) == 0) reps = std::atoi(argv[i] + 7);
    else if (std::strncmp(argv[i], "--calls=", 8) == 0) calls = std::atoi(argv[i] + 8);
    else {
      std::fprintf(stderr, "usage: %s [--reps=N] [--calls=N]\n", argv[0]);
      return 2;
    }
  }
  kvcomp::CpuBackendOptions o;
  o.num_threads = 1;
  auto backend = kvcomp::MakeCpuBackend(o);
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return 1;
  }
  constexpr uint32_t kHeads = 4;
  std::printf("| tokens per head | budget | us per call (median of %d) | tokens per us |\n", reps);
  std::printf("| --- | --- | --- | --- |\n");
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint64_t n : {16, 64, 128, 512, 2048, 4096, 8192, 32768}) {
    std::vector<float> scores(kHeads * n);
    for (auto& s : scores) s = normal(rng);
    for (auto budget : {kvcomp::HeadBudget::kUniform, kvcomp::HeadBudget::kAdaKV}) {
      kvcomp::SelectParams p;
      p.kept_per_head = static_cast<uint32_t>(std::max<uint64_t>(1, n / 2));
      p.head_budget = budget;
      p.protect = true;
      p.n_sink = 4;
      p.n_recent = 8;
      std::vector<uint32_t> counts(kHeads), idx(kvcomp::KeptCapacity(kHeads, n, p.kept_per_head));
      const int per_rep = calls > 0 ? calls : static_cast<int>(std::max<uint64_t>(10, 16384 / n));
      std::vector<double> us;
      for (int r = 0; r < reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int c = 0; c < per_rep; ++c) {
          auto st = (*backend)->scoring().Select(scores.data(), kHeads, n, p,
                                                 kvcomp::TokenPositions{},
                                                 kvcomp::KeptIndices{counts.data(), idx.data()});
          if (!st.ok()) {
            std::fprintf(stderr, "%s\n", st.ToString().c_str());
            return 1;
          }
        }
        us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() -
                                                               t0).count() / per_rep);
      }
      std::sort(us.begin(), us.end());
      const double med = us[us.size() / 2];
      std::printf("| %llu | %s | %.2f | %.1f |\n", static_cast<unsigned long long>(n),
                  budget == kvcomp::HeadBudget::kUniform ? "uniform" : "adakv", med,
                  static_cast<double>(kHeads * n) / med);
      std::fflush(stdout);
    }
  }
  return 0;
}
