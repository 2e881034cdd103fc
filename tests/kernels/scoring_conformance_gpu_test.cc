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
