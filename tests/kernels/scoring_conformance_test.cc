// The conformance suite run CPU against CPU with a different thread count: the
// harness itself is exercised on every case the CUDA suite runs.
#include <algorithm>
#include <memory>
#include <string>

#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"
#include "kvcomp/core/status.h"
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

TEST(ScoringConformanceTest, RecentFractionPoliciesCpuOneThreadAgainstMany) {
  CpuBackendOptions one, many;
  one.num_threads = 1;
  many.num_threads = 3;
  auto ref = MakeCpuBackend(one);
  auto cand = MakeCpuBackend(many);
  ASSERT_TRUE(ref.ok() && cand.ok());
  const auto cases = testing::RecentFractionConformanceCases();
  ASSERT_EQ(cases.size(), 36u);
  for (const auto& c : cases) {
    testing::CheckConformance(**cand, **ref, c);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace kvcomp

namespace kvcomp {
namespace {

// A backend that runs the CPU ops and then corrupts one thing, to show the harness notices.
class BrokenBackend final : public Backend, public ScoringOps {
 public:
  enum Fault { kSwapKeptToken, kScoreOff, kRowBytes };
  explicit BrokenBackend(Fault f) : fault_(f), cpu_(std::move(*MakeCpuBackend())) {}
  BackendKind kind() const override { return BackendKind::kCpu; }
  MemorySpace space() const override { return MemorySpace::kHost; }
  std::string Describe() const override { return "broken"; }
  ScoringOps& scoring() override { return *this; }
  MomentOps& moments() override { return cpu_->moments(); }
  CodecOps& codec() override { return cpu_->codec(); }
  Allocator& allocator() override { return cpu_->allocator(); }
  absl::Status CopyToHost(void* d, const void* s, size_t n) override {
    return cpu_->CopyToHost(d, s, n);
  }
  absl::Status CopyFromHost(void* d, const void* s, size_t n) override {
    return cpu_->CopyFromHost(d, s, n);
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::Status Score(const HeadsView& k, const ScoreParams& p, const TokenPositions& t,
                     float* s) override {
    return cpu_->scoring().Score(k, p, t, s);
  }
  absl::Status Select(const float* s, uint32_t h, uint64_t n, const SelectParams& p,
                      const TokenPositions& t, KeptIndices o) override {
    return cpu_->scoring().Select(s, h, n, p, t, o);
  }
  absl::Status Compact(const HeadsView& k, const HeadsView& v, const uint32_t* c, const uint32_t* i,
                       void* ko, void* vo) override {
    return cpu_->scoring().Compact(k, v, c, i, ko, vo);
  }
  uint64_t WorkspaceBytes(const ScoreSelectCompactArgs& a) const override { return 0; }
  absl::Status CheckFinite(const HeadsView& v, const char* what) override {
    return cpu_->scoring().CheckFinite(v, what);
  }
  absl::Status ScoreSelectCompact(const ScoreSelectCompactArgs& a) override {
    KVCOMP_RETURN_IF_ERROR(cpu_->scoring().ScoreSelectCompact(a));
    const size_t row = a.keys.head_dim * (a.keys.dtype == DType::kF32 ? 4 : 2);
    switch (fault_) {
      case kSwapKeptToken: {  // keep the lowest-scored token instead of the first kept one
        const float* s = a.scores;
        uint32_t worst = 0;
        for (uint32_t t = 1; t < a.keys.num_tokens; ++t) worst = s[t] < s[worst] ? t : worst;
        a.kept.indices[0] = worst;
        std::sort(a.kept.indices, a.kept.indices + a.kept.counts[0]);
        return cpu_->scoring().Compact(a.keys, a.values, a.kept.counts, a.kept.indices, a.keys_out,
                                       a.values_out);
      }
      case kScoreOff:
        a.scores[3] *= 1.01f;
        return absl::OkStatus();
      case kRowBytes:
        static_cast<char*>(a.values_out)[row + 1] ^= 1;
        return absl::OkStatus();
    }
    return absl::OkStatus();
  }

 private:
  Fault fault_;
  std::unique_ptr<Backend> cpu_;
};

TEST(ScoringConformanceTest, HarnessCatchesWrongKeptSetsScoresAndRows) {
  auto ref = std::move(*MakeCpuBackend());
  testing::ConformanceCase c;
  c.dtype = DType::kF32;
  c.head_dim = 64;
  c.heads = 2;
  c.tokens = 101;
  c.score.scorer = Scorer::kManifold;
  c.select.kept_per_head = 50;
  c.select.protect = false;
  for (auto f :
       {BrokenBackend::kSwapKeptToken, BrokenBackend::kScoreOff, BrokenBackend::kRowBytes}) {
    BrokenBackend broken(f);
    ::testing::TestPartResultArray failures;
    {
      ::testing::ScopedFakeTestPartResultReporter reporter(
          ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
      testing::CheckConformance(broken, *ref, c);
    }
    EXPECT_GT(failures.size(), 0) << "fault " << f << " went unnoticed";
  }
  // And the honest CPU passes the same case.
  auto cpu = std::move(*MakeCpuBackend());
  testing::CheckConformance(*cpu, *ref, c);
}

}  // namespace
}  // namespace kvcomp
