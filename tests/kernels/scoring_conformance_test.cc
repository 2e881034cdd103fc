// The conformance suite (issue 3 item 5) run CPU against CPU with a different thread count: the
// harness itself is exercised on every case the CUDA suite runs.
#include <memory>

#include "gtest/gtest.h"
#include "kvcomp/kernels/backend.h"
#include "scoring_test_util.h"

namespace kvcomp {
namespace {

TEST(ScoringConformanceTest, CpuOneThreadAgainstCpuManyThreads) {
  CpuBackendOptions one, many;
  one.num_threads = 1;
  many.num_threads = 3;
  auto ref = MakeCpuBackend(one);
  auto cand = MakeCpuBackend(many);
  ASSERT_TRUE(ref.ok() && cand.ok());
  for (const auto& c : testing::StandardConformanceCases()) {
    testing::CheckConformance(**cand, **ref, c);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace kvcomp
