// The CPU ScoringOps against float64 formulas and the documented selection rule (
// 1-3 and 5).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/scoring_ops.h"
#include "scoring_test_util.h"

namespace kvcomp {
namespace {

using testing::HostHeads;
using testing::RandomHeads;
using testing::RefScores;
using testing::RefSelect;

std::unique_ptr<Backend> Cpu(int threads = 0) {
  CpuBackendOptions o;
  o.num_threads = threads;
  auto b = MakeCpuBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(*b);
}

std::vector<float> ScoreOn(Backend& b, const HostHeads& k, const ScoreParams& p,
                           const TokenPositions& pos = {}) {
  std::vector<float> s(uint64_t{k.heads} * k.tokens, NAN);
  absl::Status st = b.scoring().Score(k.view(), p, pos, s.data());
  EXPECT_TRUE(st.ok()) << st;
  return s;
}

void ExpectScoresNear(const std::vector<float>& got, const std::vector<double>& ref, double rel) {
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], ref[i], rel * std::max(1.0, std::fabs(ref[i]))) << "token " << i;
  }
}

TEST(ScoringCpuTest, EveryScorerMatchesFloat64ForEveryDtypeAndHeadDim) {
  auto cpu = Cpu();
  uint64_t seed = 1;
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (uint32_t d : {64u, 128u, 256u}) {
      for (uint64_t n : {uint64_t{1}, uint64_t{5}, uint64_t{2049}, uint64_t{4500}}) {
        const HostHeads k = RandomHeads(dt, 2, n, d, seed++);
        for (Scorer s : {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold,
                         Scorer::kWindowedManifold, Scorer::kStreaming, Scorer::kRandom}) {
          SCOPED_TRACE(absl::StrFormat("%s d=%u n=%u %s", DTypeName(dt), d, n, ScorerName(s)));
          ScoreParams p;
          p.scorer = s;
          p.window = 1000;
          p.seed = seed;
          p.stream = 3;
          ExpectScoresNear(ScoreOn(*cpu, k, p), RefScores(k, p), 1e-5);
        }
      }
    }
  }
}

TEST(ScoringCpuTest, SnapKVMatchesFloat64) {
  auto cpu = Cpu();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (uint64_t n : {uint64_t{8}, uint64_t{9}, uint64_t{300}}) {
      const HostHeads k = RandomHeads(dt, 2, n, 64, 7 + n);
      const HostHeads q = RandomHeads(dt, 4, 8, 64, 9 + n);  // GQA group of 2, window 8
      ScoreParams p;
      p.scorer = Scorer::kSnapKV;
      p.queries = q.view();
      p.snapkv_pool = 5;
      ExpectScoresNear(ScoreOn(*cpu, k, p), RefScores(k, p, &q), 1e-5);
    }
  }
}

TEST(ScoringCpuTest, WindowedManifoldWithOneWindowIsManifold) {
  auto cpu = Cpu();
  const HostHeads k = RandomHeads(DType::kF32, 2, 777, 128, 3);
  ScoreParams m, w;
  m.scorer = Scorer::kManifold;
  w.scorer = Scorer::kWindowedManifold;
  w.window = 4096;
  const auto a = ScoreOn(*cpu, k, m), b = ScoreOn(*cpu, k, w);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5 * std::max(1.f, a[i]));
}

TEST(ScoringCpuTest, RandomIsSeededAndStreamingKeepsSinksAndRecent) {
  auto cpu = Cpu();
  const HostHeads k = RandomHeads(DType::kBF16, 1, 100, 64, 4);
  ScoreParams p;
  p.scorer = Scorer::kRandom;
  p.seed = 42;
  EXPECT_EQ(ScoreOn(*cpu, k, p), ScoreOn(*cpu, k, p));
  ScoreParams p2 = p;
  p2.seed = 43;
  EXPECT_NE(ScoreOn(*cpu, k, p), ScoreOn(*cpu, k, p2));

  ScoreParams s;
  s.scorer = Scorer::kStreaming;
  s.n_sink = 4;
  const auto sc = ScoreOn(*cpu, k, s);
  SelectParams sel;
  sel.kept_per_head = 10;
  sel.protect = false;
  const auto kept = RefSelect(sc, 1, 100, sel);
  EXPECT_EQ(kept[0], (std::vector<uint32_t>{0, 1, 2, 3, 94, 95, 96, 97, 98, 99}));
}

TEST(ScoringCpuTest, SelectFollowsTheRuleWithTiesProtectionAndAdaKV) {
  auto cpu = Cpu();
  std::mt19937 rng(5);
  for (int trial = 0; trial < 60; ++trial) {
    const uint32_t heads = 1 + rng() % 5;
    const uint64_t n = 1 + rng() % 300;
    std::vector<float> scores(uint64_t{heads} * n);
    // Few distinct values: many exact ties, negative and positive zero included.
    for (auto& s : scores) s = static_cast<float>(static_cast<int>(rng() % 7) - 3) * 0.5f;
    scores[0] = -0.0f;
    SelectParams p;
    p.kept_per_head = 1 + rng() % (n + 10);
    p.head_budget = trial % 2 ? HeadBudget::kAdaKV : HeadBudget::kUniform;
    p.alpha_safeguard = (rng() % 5) * 0.25;
    p.protect = trial % 3 != 0;
    p.n_sink = rng() % 6;
    p.n_recent = rng() % 6;
    SCOPED_TRACE(absl::StrFormat("trial %d H=%u n=%u k=%u %s", trial, heads, n, p.kept_per_head,
                                 HeadBudgetName(p.head_budget)));
    const uint64_t cap = KeptCapacity(heads, n, p.kept_per_head);
    std::vector<uint32_t> counts(heads, 0xFFFFFFFF), idx(cap, 0xFFFFFFFF);
    ASSERT_TRUE(cpu->scoring()
                    .Select(scores.data(), heads, n, p, TokenPositions{},
                            KeptIndices{counts.data(), idx.data()})
                    .ok());
    const auto ref = RefSelect(scores, heads, n, p);
    uint64_t off = 0;
    for (uint32_t h = 0; h < heads; ++h) {
      std::vector<uint32_t> got(idx.begin() + off, idx.begin() + off + counts[h]);
      EXPECT_EQ(got, ref[h]) << "head " << h;
      off += counts[h];
    }
    EXPECT_EQ(off, cap);  // uniform and AdaKV both keep exactly H * min(k, n)
  }
}

// Short heads find their threshold by a selection over a copy of their keys, longer ones by
// radix histograms (the cutoff is 4,096 tokens): both sides of it follow the rule, with many
// exact ties and with distinct scores, uniform and AdaKV.
TEST(ScoringCpuTest, SelectFollowsTheRuleOnBothSidesOfTheShortHeadCutoff) {
  auto cpu = Cpu(1);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int trial = 0;
  for (uint64_t n : {1, 2, 3, 64, 4095, 4096, 4097, 9000}) {
    for (int ties = 0; ties < 2; ++ties) {
      for (auto budget : {HeadBudget::kUniform, HeadBudget::kAdaKV}) {
        ++trial;
        const uint32_t heads = 1 + rng() % 3;
        std::vector<float> scores(uint64_t{heads} * n);
        for (auto& s : scores) {
          s = ties ? static_cast<float>(static_cast<int>(rng() % 5) - 2) * 0.5f : normal(rng);
        }
        SelectParams p;
        p.kept_per_head = static_cast<uint32_t>(1 + rng() % n);
        p.head_budget = budget;
        p.alpha_safeguard = 0.5;
        p.protect = trial % 2 == 0;
        p.n_sink = 2;
        p.n_recent = 3;
        SCOPED_TRACE(absl::StrFormat("H=%u n=%u k=%u ties=%d %s", heads, n, p.kept_per_head, ties,
                                     HeadBudgetName(budget)));
        const uint64_t cap = KeptCapacity(heads, n, p.kept_per_head);
        std::vector<uint32_t> counts(heads, 0xFFFFFFFF), idx(cap, 0xFFFFFFFF);
        ASSERT_TRUE(cpu->scoring()
                        .Select(scores.data(), heads, n, p, TokenPositions{},
                                KeptIndices{counts.data(), idx.data()})
                        .ok());
        const auto ref = RefSelect(scores, heads, n, p);
        uint64_t off = 0;
        for (uint32_t h = 0; h < heads; ++h) {
          std::vector<uint32_t> got(idx.begin() + off, idx.begin() + off + counts[h]);
          ASSERT_EQ(got, ref[h]) << "head " << h;
          off += counts[h];
        }
        EXPECT_EQ(off, cap);
      }
    }
  }
}

TEST(ScoringCpuTest, AdaKVGivesHeadsDifferentCountsAboveTheSafeguard) {
  auto cpu = Cpu();
  // Head 0 has high scores everywhere, head 1 low: AdaKV moves budget to head 0.
  const uint32_t heads = 2;
  const uint64_t n = 100;
  std::vector<float> scores(heads * n);
  for (uint64_t t = 0; t < n; ++t) {
    scores[t] = 10.0f + t;
    scores[n + t] = -10.0f - t;
  }
  SelectParams p;
  p.kept_per_head = 50;
  p.head_budget = HeadBudget::kAdaKV;
  p.alpha_safeguard = 0.2;
  p.protect = false;
  std::vector<uint32_t> counts(heads), idx(100);
  ASSERT_TRUE(cpu->scoring()
                  .Select(scores.data(), heads, n, p, {}, KeptIndices{counts.data(), idx.data()})
                  .ok());
  EXPECT_EQ(counts[0], 90u);  // its 50 + everything the other head gives up
  EXPECT_EQ(counts[1], 10u);  // int(50 * 0.2) safeguard
}

TEST(ScoringCpuTest, CompactGathersExactRowsAndFusedEqualsSteps) {
  auto cpu = Cpu(3);
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    const HostHeads k = RandomHeads(dt, 3, 5000, 128, 11);
    const HostHeads v = RandomHeads(dt, 3, 5000, 128, 12);
    ScoreSelectCompactArgs a;
    a.keys = k.view();
    a.values = v.view();
    a.score.scorer = Scorer::kKeyDiff;
    a.select.kept_per_head = 1234;
    a.select.head_budget = HeadBudget::kAdaKV;
    const uint64_t cap = KeptCapacity(3, 5000, 1234);
    const size_t row = 128 * testing::ElemSize(dt);
    std::vector<float> scores(3 * 5000);
    std::vector<uint32_t> counts(3), idx(cap);
    std::vector<uint8_t> ko(cap * row), vo(cap * row);
    a.scores = scores.data();
    a.kept = {counts.data(), idx.data()};
    a.keys_out = ko.data();
    a.values_out = vo.data();
    ASSERT_TRUE(cpu->scoring().ScoreSelectCompact(a).ok());
    EXPECT_EQ(ScoreOn(*cpu, k, a.score), scores);
    uint64_t off = 0;
    for (uint32_t h = 0; h < 3; ++h) {
      for (uint32_t r = 0; r < counts[h]; ++r) {
        const uint64_t src = (uint64_t{h} * 5000 + idx[off + r]) * row;
        ASSERT_EQ(0, std::memcmp(ko.data() + (off + r) * row, k.bytes.data() + src, row));
        ASSERT_EQ(0, std::memcmp(vo.data() + (off + r) * row, v.bytes.data() + src, row));
      }
      off += counts[h];
    }
    EXPECT_EQ(off, cap);
  }
}

TEST(ScoringCpuTest, PositionsDriveStreamingRandomAndProtection) {
  auto cpu = Cpu();
  const HostHeads k = RandomHeads(DType::kF32, 1, 6, 64, 13);
  const std::vector<uint32_t> pos = {0, 1, 7, 20, 21, 30};
  TokenPositions tp{pos.data(), 0, 31};
  ScoreParams s;
  s.scorer = Scorer::kStreaming;
  s.n_sink = 2;
  const auto sc = ScoreOn(*cpu, k, s, tp);
  EXPECT_EQ(sc[2], 7.0f);
  EXPECT_EQ(sc[5], 30.0f);
  EXPECT_EQ(sc[0], kStreamingSinkScore);
  ScoreParams r;
  r.scorer = Scorer::kRandom;
  const auto rs = ScoreOn(*cpu, k, r, tp);
  EXPECT_EQ(rs[3], RandomScore(0, 0, 0, 20));
  // Protection by absolute position: n_recent=2 of a 31-token sequence protects position 30.
  std::vector<float> low = {9, 9, 9, 9, 9, -100};
  SelectParams p;
  p.kept_per_head = 1;
  p.n_sink = 0;
  p.n_recent = 2;
  std::vector<uint32_t> counts(1), idx(1);
  ASSERT_TRUE(cpu->scoring().Select(low.data(), 1, 6, p, tp, {counts.data(), idx.data()}).ok());
  EXPECT_EQ(idx[0], 5u);
}

// Identity positions with an offset protect the same tokens as the positions written out, across
// chunk boundaries of the order-key pass (sinks and recent tokens in different chunks).
TEST(ScoringCpuTest, OffsetPositionsProtectLikeExplicitOnes) {
  auto cpu = Cpu(2);
  const uint64_t n = 40000;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> scores(2 * n);
  for (auto& x : scores) x = normal(rng);
  for (uint64_t offset : {0, 3, 100, 20000}) {
    for (uint64_t seq : {uint64_t{0}, offset + n, offset + n + 5, offset + n + 30000}) {
      std::vector<uint32_t> pos(2 * n);
      for (uint64_t i = 0; i < 2 * n; ++i) pos[i] = static_cast<uint32_t>(offset + i % n);
      SelectParams p;
      p.kept_per_head = n / 3;
      p.n_sink = 8;
      p.n_recent = 25000;
      std::vector<uint32_t> c1(2), i1(2 * p.kept_per_head), c2(2), i2(2 * p.kept_per_head);
      const TokenPositions identity{nullptr, offset, seq};
      const TokenPositions written{pos.data(), 0, seq};
      ScoringOps& ops = cpu->scoring();
      ASSERT_TRUE(ops.Select(scores.data(), 2, n, p, identity, {c1.data(), i1.data()}).ok());
      ASSERT_TRUE(ops.Select(scores.data(), 2, n, p, written, {c2.data(), i2.data()}).ok());
      EXPECT_EQ(c1, c2);
      EXPECT_EQ(i1, i2) << "offset " << offset << " sequence " << seq;
    }
  }
}

// Fewer heads than threads: each head's selection is split over the pool (slices of 8192
// tokens); the kept lists equal the one-thread ones, ties (few distinct scores) included.
TEST(ScoringCpuTest, SplitSelectionMatchesOneThread) {
  auto one = Cpu(1), many = Cpu(4);
  std::mt19937 rng(11);
  for (uint32_t heads : {1u, 3u}) {
    for (uint64_t n : {16384u, 40001u}) {
      for (int distinct : {7, 1000, 0}) {
        std::vector<float> scores(heads * n);
        std::normal_distribution<float> normal;
        for (auto& x : scores) {
          x = distinct == 0 ? normal(rng) : static_cast<float>(rng() % distinct) - 3.0f;
        }
        for (uint64_t kept : {uint64_t{1}, n / 10, n / 2, n - 1}) {
          SelectParams p;
          p.kept_per_head = kept;
          p.n_recent = 9;
          std::vector<uint32_t> c1(heads), i1(heads * kept), c2(heads), i2(heads * kept, ~0u);
          ASSERT_TRUE(
              one->scoring().Select(scores.data(), heads, n, p, {}, {c1.data(), i1.data()}).ok());
          ASSERT_TRUE(
              many->scoring().Select(scores.data(), heads, n, p, {}, {c2.data(), i2.data()}).ok());
          EXPECT_EQ(c1, c2);
          ASSERT_EQ(i1, i2) << heads << " heads, " << n << " tokens, kept " << kept << ", "
                            << distinct << " distinct";
        }
      }
    }
  }
}

TEST(ScoringCpuTest, ParamsFromPolicyUseKvpressRounding) {
  CompressionPolicy policy;
  policy.ratio = 0.07;
  auto p = SelectParamsFromPolicy(policy, 1000);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->kept_per_head, 929u);
  policy.token_budget = 64;
  EXPECT_EQ(SelectParamsFromPolicy(policy, 1000)->kept_per_head, 64u);
  EXPECT_EQ(SelectParamsFromPolicy(policy, 10)->kept_per_head, 10u);
}

TEST(ScoringCpuTest, ThreadCountDoesNotChangeResults) {
  auto one = Cpu(1), many = Cpu(4);
  for (const auto& c : testing::StandardConformanceCases()) {
    if (c.seed % 5 != 0) continue;  // a sample here; the full list runs in the conformance test
    testing::CheckConformance(*many, *one, c);
  }
}

}  // namespace
}  // namespace kvcomp

namespace kvcomp {
namespace {

// Long heads take the per-head path of the fused op (keys of a head >= 4 MiB): same results as
// the three ops called one after the other, and errors name the caller's head.
// Requests of one length given as one view of requests x heads heads, under a uniform budget,
// keep exactly what one call per request keeps (scoring_ops.h: batching short requests).
TEST(ScoringCpuTest, RequestsBatchedAsHeadsEqualOneCallEach) {
  auto b = MakeCpuBackend();
  ASSERT_TRUE(b.ok());
  const uint32_t requests = 3, heads = 4, d = 64;
  const uint64_t n = 2500;  // two chunks per head
  for (Scorer s : {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold,
                   Scorer::kStreaming}) {
    testing::ConformanceCase c;
    c.dtype = DType::kBF16;
    c.head_dim = d;
    c.heads = requests * heads;
    c.tokens = n;
    c.score.scorer = s;
    c.score.window = 1000;
    c.select.kept_per_head = 900;
    c.select.n_recent = 10;
    c.data.tie_every = 7;
    const HostHeads k = RandomHeads(c.dtype, c.heads, n, d, 300 + static_cast<int>(s), c.data);
    const HostHeads v = RandomHeads(c.dtype, c.heads, n, d, 400 + static_cast<int>(s));
    const testing::RunOutput batched = testing::RunFused(**b, c, k, v, nullptr);
    ASSERT_TRUE(batched.status.ok()) << batched.status;
    const size_t head_bytes = n * d * 2, row = d * 2;
    uint64_t rows_before = 0;
    for (uint32_t r = 0; r < requests; ++r) {
      SCOPED_TRACE(::testing::Message() << ScorerName(s) << " request " << r);
      testing::ConformanceCase one = c;
      one.heads = heads;
      HostHeads kr = k, vr = v;
      for (HostHeads* x : {&kr, &vr}) {
        const HostHeads& from = x == &kr ? k : v;
        x->heads = heads;
        x->bytes.assign(from.bytes.begin() + r * heads * head_bytes,
                        from.bytes.begin() + (r + 1) * heads * head_bytes);
      }
      const testing::RunOutput alone = testing::RunFused(**b, one, kr, vr, nullptr);
      ASSERT_TRUE(alone.status.ok()) << alone.status;
      uint64_t rows = 0;
      for (uint32_t h = 0; h < heads; ++h) {
        ASSERT_EQ(alone.counts[h], batched.counts[r * heads + h]) << "head " << h;
        rows += alone.counts[h];
      }
      for (uint64_t i = 0; i < uint64_t{heads} * n; ++i) {
        ASSERT_EQ(alone.scores[i], batched.scores[uint64_t{r} * heads * n + i]) << "score " << i;
      }
      ASSERT_TRUE(std::equal(alone.indices.begin(), alone.indices.end(),
                             batched.indices.begin() + rows_before));
      ASSERT_TRUE(std::equal(alone.keys.begin(), alone.keys.end(),
                             batched.keys.begin() + rows_before * row));
      ASSERT_TRUE(std::equal(alone.values.begin(), alone.values.end(),
                             batched.values.begin() + rows_before * row));
      rows_before += rows;
    }
  }
}

TEST(ScoringCpuTest, FusedPerHeadPathEqualsSeparateOps) {
  auto cpu = std::move(*MakeCpuBackend());
  const uint32_t heads = 3;
  const uint64_t n = 16500;  // 16500 * 128 * 2 bytes > 4 MiB per head
  const testing::HostHeads k = testing::RandomHeads(DType::kBF16, heads, n, 128, 21);
  const testing::HostHeads v = testing::RandomHeads(DType::kBF16, heads, n, 128, 22);
  const size_t row = 256;
  for (Scorer s : {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold,
                   Scorer::kStreaming, Scorer::kRandom}) {
    SCOPED_TRACE(ScorerName(s));
    ScoreSelectCompactArgs a;
    a.keys = k.view();
    a.values = v.view();
    a.score.scorer = s;
    a.score.seed = 5;
    a.select.kept_per_head = 7001;
    a.select.n_recent = 10;
    const uint64_t cap = KeptCapacity(heads, n, 7001);
    std::vector<float> s1(heads * n), s2(heads * n);
    std::vector<uint32_t> c1(heads), c2(heads), i1(cap), i2(cap);
    std::vector<uint8_t> k1(cap * row), k2(cap * row), v1(cap * row), v2(cap * row);
    a.scores = s1.data();
    a.kept = {c1.data(), i1.data()};
    a.keys_out = k1.data();
    a.values_out = v1.data();
    ASSERT_TRUE(cpu->scoring().ScoreSelectCompact(a).ok());
    ASSERT_TRUE(cpu->scoring().Score(a.keys, a.score, {}, s2.data()).ok());
    ASSERT_TRUE(
        cpu->scoring().Select(s2.data(), heads, n, a.select, {}, {c2.data(), i2.data()}).ok());
    ASSERT_TRUE(
        cpu->scoring().Compact(a.keys, a.values, c2.data(), i2.data(), k2.data(), v2.data()).ok());
    EXPECT_EQ(s1, s2);
    EXPECT_EQ(c1, c2);
    EXPECT_EQ(i1, i2);
    EXPECT_EQ(k1, k2);
    EXPECT_EQ(v1, v2);
    // Select only (compact = false): the same scores and selection, no rows written, for the
    // per-head heads and for short ones (the phased path).
    for (uint64_t len : {n, uint64_t{3000}}) {
      ScoreSelectCompactArgs o = a;
      o.keys.num_tokens = o.values.num_tokens = len;
      o.select.kept_per_head = len / 3;
      std::vector<uint32_t> c3(heads), i3(cap), c4(heads), i4(cap);
      std::vector<float> s3(heads * len), s4(heads * len);
      o.scores = s3.data();
      o.kept = {c3.data(), i3.data()};
      ASSERT_TRUE(cpu->scoring().ScoreSelectCompact(o).ok());
      o.compact = false;
      o.keys_out = o.values_out = nullptr;
      o.scores = s4.data();
      o.kept = {c4.data(), i4.data()};
      ASSERT_TRUE(cpu->scoring().ScoreSelectCompact(o).ok());
      EXPECT_EQ(s3, s4);
      EXPECT_EQ(c3, c4);
      EXPECT_EQ(i3, i4);
    }
  }
  testing::HostHeads bad = k;
  bad.Set((uint64_t{2} * n + 16000) * 128 + 3, NAN);
  ScoreSelectCompactArgs a;
  a.keys = bad.view();
  a.values = v.view();
  a.select.kept_per_head = 10;
  std::vector<uint32_t> c(heads), i(30);
  std::vector<uint8_t> ko(30 * row), vo(30 * row);
  a.kept = {c.data(), i.data()};
  a.keys_out = ko.data();
  a.values_out = vo.data();
  const absl::Status st = cpu->scoring().ScoreSelectCompact(a);
  EXPECT_NE(std::string(st.message()).find("head 2, token 16000"), std::string::npos) << st;
}

// A varlen batch (cu_seqlens) on a host backend: each request keeps exactly what its own call
// keeps (scores, counts, indices, rows), placed request after request; bad batches are refused
// with a message naming what is wrong.
TEST(ScoringCpuTest, VarlenBatchEqualsOneCallPerRequest) {
  auto b = MakeCpuBackend();
  ASSERT_TRUE(b.ok());
  const uint32_t heads = 3, d = 64;
  const std::vector<uint64_t> lengths = {700, 1, 2500, 64, 1300};
  const std::vector<uint64_t> kept = {300, 1, 2600, 10, 650};
  std::vector<uint64_t> cu{0};
  for (uint64_t n : lengths) cu.push_back(cu.back() + n);
  const uint64_t total = cu.back();
  const size_t row = d * 2;
  for (Scorer s : {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold,
                   Scorer::kStreaming, Scorer::kRandom}) {
    SCOPED_TRACE(ScorerName(s));
    std::vector<HostHeads> ks, vs;
    std::vector<uint8_t> k(heads * total * row), v(heads * total * row);
    for (size_t r = 0; r < lengths.size(); ++r) {
      ks.push_back(RandomHeads(DType::kBF16, heads, lengths[r], d, 500 + r));
      vs.push_back(RandomHeads(DType::kBF16, heads, lengths[r], d, 600 + r));
      for (uint32_t h = 0; h < heads; ++h) {
        std::memcpy(k.data() + (h * total + cu[r]) * row, ks[r].bytes.data() + h * lengths[r] * row,
                    lengths[r] * row);
        std::memcpy(v.data() + (h * total + cu[r]) * row, vs[r].bytes.data() + h * lengths[r] * row,
                    lengths[r] * row);
      }
    }
    uint64_t rows = 0;
    for (size_t r = 0; r < lengths.size(); ++r) rows += heads * std::min(kept[r], lengths[r]);
    std::vector<float> scores(heads * total, NAN);
    std::vector<uint32_t> counts(lengths.size() * heads, ~0u), idx(rows, ~0u);
    std::vector<uint8_t> ko(rows * row, 0xFF), vo(rows * row, 0xFF);
    ScoreSelectCompactVarlenArgs a;
    a.keys = HeadsView::Dense(k.data(), DType::kBF16, heads, total, d);
    a.values = HeadsView::Dense(v.data(), DType::kBF16, heads, total, d);
    a.cu_seqlens = cu.data();
    a.requests = static_cast<uint32_t>(lengths.size());
    a.kept_per_head = kept.data();
    a.score.scorer = s;
    a.score.window = 500;
    a.score.seed = 9;
    a.select.n_recent = 5;
    a.scores = scores.data();
    a.kept = {counts.data(), idx.data()};
    a.keys_out = ko.data();
    a.values_out = vo.data();
    ASSERT_TRUE((*b)->scoring().ScoreSelectCompactVarlen(a).ok());
    uint64_t at = 0;
    for (size_t r = 0; r < lengths.size(); ++r) {
      SCOPED_TRACE(::testing::Message() << "request " << r);
      testing::ConformanceCase c;
      c.dtype = DType::kBF16;
      c.head_dim = d;
      c.heads = heads;
      c.tokens = lengths[r];
      c.score = a.score;
      c.select = a.select;
      c.select.kept_per_head = kept[r];
      const testing::RunOutput one = testing::RunFused(**b, c, ks[r], vs[r], nullptr);
      ASSERT_TRUE(one.status.ok()) << one.status;
      ASSERT_TRUE(std::equal(one.scores.begin(), one.scores.end(), scores.begin() + heads * cu[r]));
      ASSERT_TRUE(std::equal(one.counts.begin(), one.counts.end(), counts.begin() + r * heads));
      ASSERT_TRUE(std::equal(one.indices.begin(), one.indices.end(), idx.begin() + at));
      ASSERT_TRUE(std::equal(one.keys.begin(), one.keys.end(), ko.begin() + at * row));
      ASSERT_TRUE(std::equal(one.values.begin(), one.values.end(), vo.begin() + at * row));
      at += one.indices.size();
    }
    ASSERT_EQ(at, rows);
  }

  // Bad batches.
  std::vector<uint8_t> k(heads * total * row, 0x3C);
  std::vector<uint32_t> counts(lengths.size() * heads), idx(heads * total);
  std::vector<uint8_t> out(heads * total * row);
  ScoreSelectCompactVarlenArgs a;
  a.keys = HeadsView::Dense(k.data(), DType::kBF16, heads, total, d);
  a.values = a.keys;
  a.cu_seqlens = cu.data();
  a.requests = static_cast<uint32_t>(lengths.size());
  a.kept_per_head = kept.data();
  a.kept = {counts.data(), idx.data()};
  a.keys_out = out.data();
  a.values_out = out.data();
  auto refused = [&](const ScoreSelectCompactVarlenArgs& x, const std::string& what) {
    const absl::Status st = (*b)->scoring().ScoreSelectCompactVarlen(x);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(st.message().find(what), std::string::npos) << st;
  };
  ScoreSelectCompactVarlenArgs x = a;
  x.requests = 4;  // cu_seqlens then ends before the view's last token
  refused(x, "cu_seqlens ends at");
  std::vector<uint64_t> zero = kept;
  zero[2] = 0;
  x = a;
  x.kept_per_head = zero.data();
  refused(x, "request 2 has a budget of zero");
  std::vector<uint64_t> flat = cu;
  flat[3] = flat[2];
  x = a;
  x.cu_seqlens = flat.data();
  refused(x, "request 2 is empty");
  x = a;
  x.select.head_budget = HeadBudget::kAdaKV;
  refused(x, "uniform budgets only");
  x = a;
  x.score.scorer = Scorer::kSnapKV;
  refused(x, "snapkv is not supported");
  x = a;
  x.cu_seqlens = nullptr;
  refused(x, "null cu_seqlens");
}

}  // namespace
}  // namespace kvcomp
