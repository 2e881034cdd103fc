// Bad input gets a clear InvalidArgument, never a crash or a silent answer.
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/pipeline.h"
#include "kvcomp/kernels/scoring_ops.h"
#include "scoring_test_util.h"

namespace kvcomp {
namespace {

using testing::HostHeads;
using testing::RandomHeads;

class ScoringErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override { backend_ = std::move(*MakeCpuBackend()); }

  absl::Status Run(const HostHeads& k, const HostHeads& v, ScoreSelectCompactArgs a) {
    a.keys = k.view();
    a.values = v.view();
    return Run(a);
  }
  absl::Status Run(ScoreSelectCompactArgs a) {
    if (a.select.kept_per_head == 0 && !zero_budget_) a.select.kept_per_head = 4;
    const uint64_t cap = 1 << 16;
    counts_.assign(256, 0);
    idx_.assign(cap, 0);
    out_k_.assign(cap * 1024, 0);
    out_v_.assign(cap * 1024, 0);
    a.kept = {counts_.data(), idx_.data()};
    a.keys_out = out_k_.data();
    a.values_out = out_v_.data();
    return backend_->scoring().ScoreSelectCompact(a);
  }
  static void ExpectInvalid(const absl::Status& s, const std::string& needle) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(std::string(s.message()).find(needle), std::string::npos) << s;
  }

  std::unique_ptr<Backend> backend_;
  bool zero_budget_ = false;
  std::vector<uint32_t> counts_, idx_;
  std::vector<uint8_t> out_k_, out_v_;
};

TEST_F(ScoringErrorsTest, NanOrInfInKeysForEveryScorer) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity()}) {
      for (Scorer s :
           {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold,
            Scorer::kStreaming, Scorer::kRandom, Scorer::kSnapKV}) {
        HostHeads k = RandomHeads(dt, 2, 50, 64, 1);
        const HostHeads v = RandomHeads(dt, 2, 50, 64, 2);
        const HostHeads q = RandomHeads(dt, 2, 4, 64, 3);
        k.Set((uint64_t{1} * 50 + 33) * 64 + 7, bad);
        ScoreSelectCompactArgs a;
        a.score.scorer = s;
        a.score.queries = q.view();
        const absl::Status st = Run(k, v, a);
        ExpectInvalid(st, "NaN or Inf");
        EXPECT_NE(std::string(st.message()).find("head 1, token 33"), std::string::npos) << st;
      }
    }
  }
}

TEST_F(ScoringErrorsTest, NanOrInfInValuesForEveryScorerAsForKeys) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity()}) {
      for (Scorer s :
           {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold,
            Scorer::kStreaming, Scorer::kRandom, Scorer::kSnapKV}) {
        const HostHeads k = RandomHeads(dt, 2, 50, 64, 1);
        HostHeads v = RandomHeads(dt, 2, 50, 64, 2);
        const HostHeads q = RandomHeads(dt, 2, 4, 64, 3);
        v.Set((uint64_t{1} * 50 + 33) * 64 + 7, bad);
        ScoreSelectCompactArgs a;
        a.score.scorer = s;
        a.score.queries = q.view();
        const absl::Status st = Run(k, v, a);
        ExpectInvalid(st, "values: NaN or Inf (or a squared norm beyond float32) at head 1, "
                          "token 33");
      }
    }
  }
}

// A deferred check record turns into the messages the op gives; a host backend checks at once
// and leaves the record as it is.
TEST_F(ScoringErrorsTest, DeferredCheckRecordsGiveTheOpsMessages) {
  DeferredCheck c;
  EXPECT_TRUE(DeferredCheckStatus(c, 50, 0).ok());
  c.bad_score = 2 * 50 + 9;
  ExpectInvalid(DeferredCheckStatus(c, 50, 0), "select: non-finite score at head 2, token 9");
  c.bad_query = 4 + 3;
  ExpectInvalid(DeferredCheckStatus(c, 50, 4),
                "snapkv queries: NaN or Inf (or a squared norm beyond float32) at head 1, token 3");
  c.bad_value = 50 + 33;
  ExpectInvalid(DeferredCheckStatus(c, 50, 4),
                "values: NaN or Inf (or a squared norm beyond float32) at head 1, token 33");
  c.bad_key = 49;  // keys first, as the op reports them
  ExpectInvalid(DeferredCheckStatus(c, 50, 4),
                "keys: NaN or Inf (or a squared norm beyond float32) at head 0, token 49");

  HostHeads k = RandomHeads(DType::kF32, 2, 50, 64, 1);
  const HostHeads v = RandomHeads(DType::kF32, 2, 50, 64, 2);
  k.Set((uint64_t{1} * 50 + 12) * 64, std::numeric_limits<float>::quiet_NaN());
  DeferredCheck record;
  ScoreSelectCompactArgs a;
  a.score.scorer = Scorer::kManifold;
  a.deferred_check = &record;
  ExpectInvalid(Run(k, v, a), "keys: NaN or Inf (or a squared norm beyond float32) at head 1, "
                              "token 12");
  EXPECT_EQ(record.bad_key, DeferredCheck::kNone);
}

TEST_F(ScoringErrorsTest, ExtremeFiniteValuesFollowTheKeysBound) {
  // The stated rule, keys and values alike: a row's squared norm must fit float32.
  for (bool in_values : {false, true}) {
    for (float x : {3e38f, -2e19f}) {  // squared norm overflows float32
      HostHeads k = RandomHeads(DType::kF32, 2, 20, 64, 1);
      HostHeads v = RandomHeads(DType::kF32, 2, 20, 64, 2);
      (in_values ? v : k).Set((uint64_t{0} * 20 + 11) * 64 + 3, x);
      ExpectInvalid(Run(k, v, {}), std::string(in_values ? "values" : "keys") +
                                       ": NaN or Inf (or a squared norm beyond float32) at head "
                                       "0, token 11");
    }
    for (float x : {1e18f, -65504.0f}) {  // within it
      HostHeads k = RandomHeads(DType::kF32, 2, 20, 64, 1);
      HostHeads v = RandomHeads(DType::kF32, 2, 20, 64, 2);
      (in_values ? v : k).Set(11 * 64 + 3, x);
      EXPECT_TRUE(Run(k, v, {}).ok()) << x;
    }
  }
}

TEST_F(ScoringErrorsTest, CheckFiniteNamesWhatAndWhere) {
  HostHeads v = RandomHeads(DType::kBF16, 3, 40, 128, 5);
  EXPECT_TRUE(backend_->scoring().CheckFinite(v.view(), "values").ok());
  v.Set((uint64_t{2} * 40 + 39) * 128 + 127, std::numeric_limits<float>::infinity());
  v.Set((uint64_t{2} * 40 + 38) * 128 + 0, std::numeric_limits<float>::quiet_NaN());
  ExpectInvalid(backend_->scoring().CheckFinite(v.view(), "values"),
                "values: NaN or Inf (or a squared norm beyond float32) at head 2, token 38");
  HeadsView bad = v.view();
  bad.data = nullptr;
  ExpectInvalid(backend_->scoring().CheckFinite(bad, "values"), "null");
}

TEST_F(ScoringErrorsTest, NanValuesRefusedByCompressAndTheBlockCompressor) {
  const KvLayout layout{2, 2, 2, 64, DType::kF16};
  std::vector<HostHeads> k, v;
  for (uint32_t l = 0; l < 2; ++l) {
    k.push_back(RandomHeads(DType::kF16, 2, 32, 64, 10 + l));
    v.push_back(RandomHeads(DType::kF16, 2, 32, 64, 20 + l));
  }
  v[1].Set((uint64_t{1} * 32 + 17) * 64, std::numeric_limits<float>::quiet_NaN());
  KvCacheView c;
  c.layout = layout;
  c.num_tokens = 32;
  for (uint32_t l = 0; l < 2; ++l) {
    c.keys.push_back(k[l].view());
    c.values.push_back(v[l].view());
  }
  for (bool moment_aware : {false, true}) {
    CompressionPolicy p;
    p.ratio = 0.5;
    p.moment_aware = moment_aware;
    auto out = Compress(*backend_, c, p);
    ASSERT_FALSE(out.ok());
    ExpectInvalid(out.status(), "layer 1: values: NaN or Inf");
    ExpectInvalid(out.status(), "head 1, token 17");
  }
  CompressionPolicy p;
  p.block_size = 16;
  p.token_budget = 8;
  auto bc = BlockCompressor::Create(*backend_, layout, p);
  ASSERT_TRUE(bc.ok()) << bc.status();
  HostHeads good = RandomHeads(DType::kF16, 2, 16, 64, 3);
  HostHeads block = RandomHeads(DType::kF16, 2, 16, 64, 4);
  block.Set((uint64_t{0} * 16 + 9) * 64 + 1, -std::numeric_limits<float>::infinity());
  ExpectInvalid((*bc)->Append(0, good.view(), block.view()),
                "values: NaN or Inf (or a squared norm beyond float32) at head 0, token 9");
  EXPECT_EQ((*bc)->tokens_seen(0), 0u);  // the bad block was dropped
  EXPECT_TRUE((*bc)->Append(0, good.view(), good.view()).ok());
}

TEST_F(ScoringErrorsTest, UnsupportedHeadDimAndDtype) {
  HostHeads k = RandomHeads(DType::kF32, 1, 10, 64, 1);
  ScoreSelectCompactArgs a;
  a.keys = k.view();
  a.values = k.view();
  a.keys.head_dim = a.values.head_dim = 96;
  ExpectInvalid(Run(a), "head_dim 96");
  a.keys = a.values = k.view();
  a.keys.dtype = a.values.dtype = DType::kInt8;
  ExpectInvalid(Run(a), "dtype int8");
  a.keys.dtype = a.values.dtype = static_cast<DType>(77);
  ExpectInvalid(Run(a), "dtype #77");
}

TEST_F(ScoringErrorsTest, MismatchedKeysAndValues) {
  const HostHeads k = RandomHeads(DType::kBF16, 2, 10, 64, 1);
  const HostHeads v1 = RandomHeads(DType::kBF16, 2, 11, 64, 2);
  const HostHeads v2 = RandomHeads(DType::kF16, 2, 10, 64, 2);
  const HostHeads v3 = RandomHeads(DType::kBF16, 3, 10, 64, 2);
  const HostHeads v4 = RandomHeads(DType::kBF16, 2, 10, 128, 2);
  for (const HostHeads* v : {&v1, &v2, &v3, &v4}) ExpectInvalid(Run(k, *v, {}), "differ");
}

TEST_F(ScoringErrorsTest, EmptySequenceZeroBudgetAndNulls) {
  HostHeads k = RandomHeads(DType::kBF16, 2, 10, 64, 1);
  ScoreSelectCompactArgs a;
  a.keys = a.values = k.view();
  a.keys.num_tokens = a.values.num_tokens = 0;
  ExpectInvalid(Run(a), "empty sequence");
  a.keys = a.values = k.view();
  zero_budget_ = true;
  a.select.kept_per_head = 0;
  ExpectInvalid(Run(a), "budget of zero");
  zero_budget_ = false;
  a.keys.data = nullptr;
  ExpectInvalid(Run(a), "null data");
  std::vector<float> s(20);
  ExpectInvalid(backend_->scoring().Score(k.view(), {}, {}, nullptr), "null");
  ExpectInvalid(backend_->scoring().Select(s.data(), 2, 10, SelectParams{}, {}, {}),
                "budget of zero");
}

TEST_F(ScoringErrorsTest, WrongMemorySpace) {
  HostHeads k = RandomHeads(DType::kBF16, 2, 10, 64, 1);
  ScoreSelectCompactArgs a;
  a.keys = a.values = k.view();
  a.keys.space = a.values.space = MemorySpace::kDevice;
  ExpectInvalid(Run(a), "device memory given to a host backend");
}

TEST_F(ScoringErrorsTest, SnapKVQueryProblems) {
  const HostHeads k = RandomHeads(DType::kBF16, 2, 10, 64, 1);
  ScoreSelectCompactArgs a;
  a.score.scorer = Scorer::kSnapKV;
  ExpectInvalid(Run(k, k, a), "queries");
  const HostHeads q3 = RandomHeads(DType::kBF16, 3, 4, 64, 2);
  a.score.queries = q3.view();
  ExpectInvalid(Run(k, k, a), "not a multiple");
  const HostHeads qlong = RandomHeads(DType::kBF16, 2, 11, 64, 2);
  a.score.queries = qlong.view();
  ExpectInvalid(Run(k, k, a), "longer than");
  const HostHeads qf = RandomHeads(DType::kF32, 2, 4, 64, 2);
  a.score.queries = qf.view();
  ExpectInvalid(Run(k, k, a), "snapkv queries are");
}

TEST_F(ScoringErrorsTest, CompressRejectsBadPoliciesAndCaches) {
  const HostHeads k = RandomHeads(DType::kBF16, 2, 10, 64, 1);
  KvCacheView c;
  c.layout = {1, 2, 4, 64, DType::kBF16};
  c.num_tokens = 10;
  c.keys = {k.view()};
  c.values = {k.view()};
  CompressionPolicy p;
  for (double r : {1.0, -0.1, 1.5, std::nan("")}) {
    p.ratio = r;
    ExpectInvalid(Compress(*backend_, c, p).status(), "ratio");
  }
  p.ratio = 0.95;  // 10 tokens keep int(0.5) = 0
  ExpectInvalid(Compress(*backend_, c, p).status(), "budget of zero");
  p.ratio = 0.5;
  KvCacheView bad = c;
  bad.values = {};
  ExpectInvalid(Compress(*backend_, bad, p).status(), "layers");
  bad = c;
  bad.num_tokens = 0;
  ExpectInvalid(Compress(*backend_, bad, p).status(), "empty sequence");
  const HostHeads v = RandomHeads(DType::kBF16, 2, 9, 64, 2);
  bad = c;
  bad.values = {v.view()};
  ExpectInvalid(Compress(*backend_, bad, p).status(), "expected");
  p.scorer = Scorer::kSnapKV;
  ExpectInvalid(Compress(*backend_, c, p).status(), "queries");
}

}  // namespace
}  // namespace kvcomp
