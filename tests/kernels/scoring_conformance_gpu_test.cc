// The conformance suite on the GPU: the CUDA ScoringOps against the CPU reference on fresh random
// inputs (every dtype and head_dim, odd lengths, n below the budget, n = 1, exact ties, every
// scorer, uniform and AdaKV), outputs poisoned before each run. Skipped (77) without a device.
#include <memory>

#include "common/gpu.h"
#include "gtest/gtest.h"
#include "kvcomp/kernels/backend.h"
#include "scoring_test_util.h"

KVCOMP_GPU_TEST_BINARY();

namespace kvcomp {
namespace {

TEST(ScoringConformanceGpuTest, CudaAgainstCpu) {
  auto cpu = MakeCpuBackend();
  auto cuda = MakeCudaBackend();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  for (const auto& c : testing::StandardConformanceCases()) {
    testing::CheckConformance(**cuda, **cpu, c);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(ScoringConformanceGpuTest, RecentFractionPoliciesAgainstCpu) {
  auto cpu = MakeCpuBackend();
  auto cuda = MakeCudaBackend();
  ASSERT_TRUE(cpu.ok() && cuda.ok());
  for (const auto& c : testing::RecentFractionConformanceCases()) {
    testing::CheckConformance(**cuda, **cpu, c);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Uniform budgets of short heads take the one-block-per-head selection and the row gather (by
// default up to 8192 tokens: 300, 2048 and 8191 here), longer ones the tiled path (32768, 32769).
// Ties, protection on and off, a kept count above and below half, many heads (the batched
// layout), every row-reading scorer.
TEST(ScoringConformanceGpuTest, ShortSelectionAgainstCpu) {
  auto cpu = MakeCpuBackend();
  auto cuda = MakeCudaBackend();
  ASSERT_TRUE(cpu.ok() && cuda.ok());
  uint64_t seed = 9500;
  struct Shape {
    uint64_t tokens;
    uint32_t heads;
    uint64_t kept;
  };
  const Shape shapes[] = {{2048, 64, 1024}, {8191, 8, 2731}, {32768, 3, 16384},
                          {32769, 2, 20000}, {300, 5, 299}};
  for (Scorer s : {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold,
                   Scorer::kStreaming, Scorer::kRandom}) {
    for (const Shape& sh : shapes) {
      testing::ConformanceCase c;
      c.dtype = (seed % 3 == 0) ? DType::kF16 : DType::kBF16;
      c.head_dim = (seed % 5 == 0) ? 64 : 128;
      c.heads = sh.heads;
      c.tokens = sh.tokens;
      c.score.scorer = s;
      c.score.window = 1000;
      c.score.seed = seed;
      c.score.stream = 3;
      c.select.kept_per_head = sh.kept;
      c.select.head_budget = HeadBudget::kUniform;
      c.select.protect = (seed % 2) == 0;
      c.select.n_recent = 17;
      c.data.tie_every = (seed % 4 == 1) ? 5 : 0;
      c.seed = seed++;
      testing::CheckConformance(**cuda, **cpu, c);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(ScoringConformanceGpuTest, LongSequencesAgainstCpu) {
  auto cpu = MakeCpuBackend();
  auto cuda = MakeCudaBackend();
  ASSERT_TRUE(cpu.ok() && cuda.ok());
  uint64_t seed = 9000;
  for (Scorer s :
       {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold}) {
    for (HeadBudget hb : {HeadBudget::kUniform, HeadBudget::kAdaKV}) {
      testing::ConformanceCase c;
      c.dtype = DType::kBF16;
      c.head_dim = 128;
      c.heads = 8;
      c.tokens = 70001;
      c.score.scorer = s;
      c.score.window = 4096;
      c.select.kept_per_head = 35000;
      c.select.head_budget = hb;
      c.seed = seed++;
      testing::CheckConformance(**cuda, **cpu, c);
    }
  }
}

}  // namespace
}  // namespace kvcomp
