// Moment-aware eviction (docs/moment_aware.md): the rescoring rule on its own, and the pipeline
// with policy.moment_aware (whole sequence and block-wise), whose moments must still be exactly
// those of the evicted tokens.
#include "cpu/moments_aware.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/moments_test_util.h"
#include "kernels/scoring_test_util.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/pipeline.h"

namespace kvcomp {
namespace {

std::vector<float> Gaussian(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = g(rng);
  return x;
}

// Two tokens with equal base scores: the one far from the evicted set's mean must rank higher
// after rescoring; protected tokens and heads with nothing to evict are left to Select.
TEST(MomentAwareTest, FarFromTheSummaryRanksHigher) {
  const uint32_t d = 64;
  const uint64_t n = 200;
  std::mt19937_64 rng(1);
  std::vector<float> k = Gaussian(n * d, rng);
  for (float& x : k) x *= 0.1f;                            // a tight cluster around 0 ...
  for (uint32_t x = 0; x < d; ++x) k[150 * d + x] = 3.0f;  // ... and one far-away token
  std::vector<float> scores(n);
  for (uint64_t i = 0; i < n; ++i) scores[i] = static_cast<float>(i % 10);
  scores[150] = scores[151] = 0.5f;  // low base score: provisionally evicted
  SelectParams sel;
  sel.kept_per_head = 100;
  const HeadsView kv = HeadsView::Dense(k.data(), DType::kF32, 1, n, d);
  ASSERT_TRUE(moments_internal::MomentAwareRescore(kv, sel, TokenPositions{}, nullptr, nullptr,
                                                   scores.data())
                  .ok());
  EXPECT_GT(scores[150], scores[151]);
  for (float s : scores) {
    EXPECT_GE(s, 0.0f);
    EXPECT_LE(s, 1.0f);
  }
  // Everything kept: scores untouched.
  std::vector<float> same(n, 2.0f);
  sel.kept_per_head = n;
  ASSERT_TRUE(
      moments_internal::MomentAwareRescore(kv, sel, TokenPositions{}, nullptr, nullptr, same.data())
          .ok());
  for (float s : same) EXPECT_EQ(s, 2.0f);
}

// Distances are ranked by their rounding to f32, ties by lower index (the device sorts 32-bit
// keys): a token a hair farther in f64 but at the same f32 distance ranks below a later one.
TEST(MomentAwareTest, DistancesTiedInF32RankByIndex) {
  const uint32_t d = 2;
  const uint64_t n = 8;
  // Tokens 0-3 at the origin with low scores: provisionally evicted, so mu = 0 exactly.
  std::vector<float> k(n * d, 0.0f);
  k[4 * d] = 1.0f;
  k[4 * d + 1] = 0x1p-13f;  // ||k_4|| = sqrt(1 + 2^-26): above 1 in f64, 1.0f in f32
  k[5 * d] = 1.0f;          // ||k_5|| = 1
  k[6 * d] = 2.0f;
  k[7 * d] = 3.0f;
  std::vector<float> scores = {0.1f, 0.1f, 0.1f, 0.1f, 1.0f, 1.0f, 1.0f, 1.0f};
  SelectParams sel;
  sel.kept_per_head = 4;
  sel.protect = false;
  const HeadsView kv = HeadsView::Dense(k.data(), DType::kF32, 1, n, d);
  ASSERT_TRUE(moments_internal::MomentAwareRescore(kv, sel, TokenPositions{}, nullptr, nullptr,
                                                   scores.data())
                  .ok());
  // Score ranks 4 and 5 (tied, by index); distance ranks 4 and 5 (tied in f32, by index).
  EXPECT_LT(scores[4], scores[5]);
  EXPECT_EQ(scores[4], static_cast<float>(0.5 * (4.0 / 7.0) + 0.5 * (4.0 / 7.0)));
  EXPECT_EQ(scores[5], static_cast<float>(0.5 * (5.0 / 7.0) + 0.5 * (5.0 / 7.0)));
  EXPECT_LT(scores[5], scores[6]);
}

// The prior summary moves the mean: with a prior far away, the token near it is the one the
// summary represents, so it ranks lower.
TEST(MomentAwareTest, PriorSummaryShiftsTheMean) {
  const uint32_t d = 64;
  const uint64_t n = 100;
  std::mt19937_64 rng(2);
  std::vector<float> k = Gaussian(n * d, rng);
  for (uint32_t x = 0; x < d; ++x) {
    k[10 * d + x] = 5.0f;   // near the prior mean
    k[11 * d + x] = -5.0f;  // far from it
  }
  std::vector<float> scores(n, 1.0f);
  SelectParams sel;
  sel.kept_per_head = 50;
  sel.protect = false;
  const uint64_t prior_n = 1000;
  std::vector<float> prior_sum(d, 5.0f * prior_n);
  const HeadsView kv = HeadsView::Dense(k.data(), DType::kF32, 1, n, d);
  ASSERT_TRUE(moments_internal::MomentAwareRescore(kv, sel, TokenPositions{}, &prior_n,
                                                   prior_sum.data(), scores.data())
                  .ok());
  EXPECT_LT(scores[10], scores[11]);
}

TEST(MomentAwareTest, PipelineMomentsAreThoseOfTheEvictedTokens) {
  auto b = MakeCpuBackend(CpuBackendOptions{2});
  ASSERT_TRUE(b.ok());
  const KvLayout layout{2, 2, 4, 64, DType::kF32};
  const uint64_t tokens = 1000;
  std::mt19937_64 rng(3);
  std::vector<std::vector<float>> k, v;
  KvCacheView view;
  view.layout = layout;
  view.num_tokens = tokens;
  for (uint32_t l = 0; l < 2; ++l) {
    k.push_back(Gaussian(2 * tokens * 64, rng));
    v.push_back(Gaussian(2 * tokens * 64, rng));
    view.keys.push_back(HeadsView::Dense(k[l].data(), DType::kF32, 2, tokens, 64));
    view.values.push_back(HeadsView::Dense(v[l].data(), DType::kF32, 2, tokens, 64));
  }
  for (Scorer scorer : {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kStreaming}) {
    CompressionPolicy p;
    p.scorer = scorer;
    p.ratio = 0.6;
    p.moment_aware = true;
    p.moments = true;
    auto c = Compress(**b, view, p);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE(c->has_moments);
    const auto off = c->TokenOffsets();
    for (uint32_t l = 0; l < 2; ++l) {
      for (uint32_t h = 0; h < 2; ++h) {
        const uint64_t hi = c->head_index(l, h);
        ASSERT_EQ(c->kept[hi], p.KeptPerHead(tokens));
        std::vector<bool> kept(tokens, false);
        for (uint64_t i = off[hi]; i < off[hi + 1]; ++i) kept[c->positions[i]] = true;
        EXPECT_TRUE(kept[0] && kept[3]);  // the sink stays protected
        testing::HeadData hd;
        hd.k.assign(k[l].begin() + h * tokens * 64, k[l].begin() + (h + 1) * tokens * 64);
        hd.v.assign(v[l].begin() + h * tokens * 64, v[l].begin() + (h + 1) * tokens * 64);
        std::vector<uint32_t> ev;
        for (uint32_t t = 0; t < tokens; ++t)
          if (!kept[t]) ev.push_back(t);
        const testing::RefMoments r = testing::RefMomentsOf(hd, ev, 64);
        EXPECT_EQ(c->moment_count[hi], r.n);
        for (uint32_t x = 0; x < 64; ++x) {
          EXPECT_NEAR(c->moment_key_sum[hi * 64 + x], r.ks[x], 1e-3);
        }
      }
    }
  }
}

TEST(MomentAwareTest, BlockWiseUsesTheRunningSummary) {
  auto b = MakeCpuBackend(CpuBackendOptions{2});
  ASSERT_TRUE(b.ok());
  const KvLayout layout{1, 2, 2, 64, DType::kF32};
  CompressionPolicy p;
  p.scorer = Scorer::kKnorm;
  p.block_size = 256;
  p.token_budget = 300;
  p.moment_aware = true;
  p.moments = true;
  auto bc = BlockCompressor::Create(**b, layout, p);
  ASSERT_TRUE(bc.ok()) << bc.status();
  std::mt19937_64 rng(4);
  uint64_t total = 0;
  for (int blk = 0; blk < 6; ++blk) {
    std::vector<float> k = Gaussian(2 * 256 * 64, rng), v = Gaussian(2 * 256 * 64, rng);
    ASSERT_TRUE((*bc)
                    ->Append(0, HeadsView::Dense(k.data(), DType::kF32, 2, 256, 64),
                             HeadsView::Dense(v.data(), DType::kF32, 2, 256, 64))
                    .ok());
    total += 256;
  }
  auto c = (*bc)->Finish();
  ASSERT_TRUE(c.ok()) << c.status();
  for (uint32_t h = 0; h < 2; ++h) {
    EXPECT_EQ(c->kept[h], 300u);
    EXPECT_EQ(c->moment_count[h], total - 300);
  }
}

// The scoring op's rescore hook (what a device compression uses for policy.moment_aware): the
// op with MomentAwareRescore between its scores and its selection keeps, compacts and scores
// exactly as the moment-aware op of separate steps does, for the streaming scorer too (whose
// shortcut without scores the hook turns off); the hook's error is the op's.
TEST(MomentAwareTest, RescoreHookOfTheScoringOpIsTheMomentAwareOp) {
  auto cpu = MakeCpuBackend(CpuBackendOptions{2});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const uint32_t heads = 3, d = 64;
  const uint64_t n = 700;
  const testing::HostHeads k = testing::RandomHeads(DType::kBF16, heads, n, d, 21);
  const testing::HostHeads v = testing::RandomHeads(DType::kBF16, heads, n, d, 22);
  for (Scorer scorer : {Scorer::kManifold, Scorer::kKnorm, Scorer::kStreaming}) {
    SCOPED_TRACE(ScorerName(scorer));
    struct Out {
      std::vector<float> scores;
      std::vector<uint32_t> counts, idx;
      std::vector<uint8_t> ko, vo;
    };
    const uint64_t cap = KeptCapacity(heads, n, 250);
    const size_t row = d * 2;
    auto args = [&](Out* o) {
      o->scores.assign(heads * n, 0.0f);
      o->counts.assign(heads, 0);
      o->idx.assign(cap, 0);
      o->ko.assign(cap * row, 0);
      o->vo.assign(cap * row, 0);
      ScoreSelectCompactArgs a;
      a.keys = k.view();
      a.values = v.view();
      a.score.scorer = scorer;
      a.select.kept_per_head = 250;
      a.scores = o->scores.data();
      a.kept = {o->counts.data(), o->idx.data()};
      a.keys_out = o->ko.data();
      a.values_out = o->vo.data();
      return a;
    };
    Out want, got;
    ASSERT_TRUE(moments_internal::MomentAwareScoreSelectCompact(**cpu, args(&want)).ok());
    ScoreSelectCompactArgs a = args(&got);
    int calls = 0;
    a.rescore = [&](float* scores) {
      ++calls;
      return moments_internal::MomentAwareRescore(a.keys, a.select, a.positions, nullptr,
                                                  nullptr, scores);
    };
    ASSERT_TRUE((*cpu)->scoring().ScoreSelectCompact(a).ok());
    EXPECT_EQ(calls, 1);
    EXPECT_EQ(want.scores, got.scores);
    EXPECT_EQ(want.counts, got.counts);
    EXPECT_EQ(want.idx, got.idx);
    EXPECT_TRUE(want.ko == got.ko);
    EXPECT_TRUE(want.vo == got.vo);
    a.rescore = [](float*) { return absl::InternalError("rescore failed"); };
    const absl::Status s = (*cpu)->scoring().ScoreSelectCompact(a);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
    EXPECT_EQ(s.message(), "rescore failed");
  }
}

}  // namespace
}  // namespace kvcomp
