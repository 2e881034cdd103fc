// MomentKV on the CPU backend: moments (alone and in the compaction pass), exact merges, and the
// corrected decode attention against a float64 reference of the same formula.
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/moments_test_util.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/moment_ops.h"

namespace kvcomp {
namespace {

using testing::HeadData;
using testing::HostMoments;
using testing::RefAttention;
using testing::RefMoments;
using testing::RefMomentsOf;
using testing::RelErr;

class MomentsCpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto b = MakeCpuBackend(CpuBackendOptions{2});
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
  }
  MomentOps& ops() { return backend_->moments(); }
  std::unique_ptr<Backend> backend_;
};

// [heads, tokens, d] fp32 with N(0,1) entries (keys shifted by `key_offset`).
std::vector<float> Gaussian(size_t n, std::mt19937_64& rng, float offset = 0.0f) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = g(rng) + offset;
  return x;
}

HeadData HeadOf(const std::vector<float>& k, const std::vector<float>& v, uint32_t h,
                uint64_t tokens, uint32_t d) {
  HeadData hd;
  hd.k.assign(k.begin() + h * tokens * d, k.begin() + (h + 1) * tokens * d);
  hd.v.assign(v.begin() + h * tokens * d, v.begin() + (h + 1) * tokens * d);
  return hd;
}

TEST_F(MomentsCpuTest, AccumulateMatchesFloat64Moments) {
  const uint32_t heads = 3, d = 64;
  const uint64_t tokens = 5000;  // several parts per head
  std::mt19937_64 rng(1);
  const auto k = Gaussian(heads * tokens * d, rng, 0.5f), v = Gaussian(heads * tokens * d, rng);
  std::vector<uint32_t> idx;
  std::vector<uint64_t> off{0};
  std::vector<std::vector<uint32_t>> per_head(heads);
  for (uint32_t h = 0; h < heads; ++h) {
    std::vector<uint32_t> kept;
    testing::RandomSplit(tokens, 0.3 * h, rng, &kept, &per_head[h]);
    idx.insert(idx.end(), per_head[h].begin(), per_head[h].end());
    off.push_back(idx.size());
  }
  HostMoments m(heads, d);
  ASSERT_TRUE(ops()
                  .Accumulate(HeadsView::Dense(k.data(), DType::kF32, heads, tokens, d),
                              HeadsView::Dense(v.data(), DType::kF32, heads, tokens, d),
                              TokenLists{idx.data(), off.data(), heads}, m.view())
                  .ok());
  for (uint32_t h = 0; h < heads; ++h) {
    const RefMoments r = RefMomentsOf(HeadOf(k, v, h, tokens, d), per_head[h], d);
    EXPECT_EQ(m.count[h], r.n);
    for (uint32_t i = 0; i < d; ++i) {
      EXPECT_NEAR(m.ks[h * d + i], r.ks[i], 1e-5 * r.n + 1e-3);
      EXPECT_NEAR(m.vs[h * d + i], r.vs[i], 1e-5 * r.n + 1e-3);
    }
    for (uint32_t i = 0; i < d * d; ++i) EXPECT_NEAR(m.s[h * d * d + i], r.s[i], 1e-5 * r.n + 1e-3);
  }
}

// Integer-valued inputs make every fp32 sum exact, so merging must be bit-exact.
TEST_F(MomentsCpuTest, MomentsMergeExactly) {
  const uint32_t heads = 2, d = 64;
  const uint64_t tokens = 3000;
  std::mt19937_64 rng(2);
  std::uniform_int_distribution<int> small(-4, 4);
  std::vector<float> k(heads * tokens * d), v(heads * tokens * d);
  for (float& x : k) x = static_cast<float>(small(rng));
  for (float& x : v) x = static_cast<float>(small(rng));
  // Set A: even tokens, set B: odd tokens, whole: all tokens.
  std::vector<uint32_t> a, b, all;
  std::vector<uint64_t> oa{0}, ob{0}, oall{0};
  for (uint32_t h = 0; h < heads; ++h) {
    for (uint32_t t = 0; t < tokens; ++t) {
      (t % 2 ? b : a).push_back(t);
      all.push_back(t);
    }
    oa.push_back(a.size());
    ob.push_back(b.size());
    oall.push_back(all.size());
  }
  const HeadsView kv = HeadsView::Dense(k.data(), DType::kF32, heads, tokens, d);
  const HeadsView vv = HeadsView::Dense(v.data(), DType::kF32, heads, tokens, d);
  HostMoments ma(heads, d), mb(heads, d), mall(heads, d);
  ASSERT_TRUE(ops().Accumulate(kv, vv, TokenLists{a.data(), oa.data(), heads}, ma.view()).ok());
  ASSERT_TRUE(ops().Accumulate(kv, vv, TokenLists{b.data(), ob.data(), heads}, mb.view()).ok());
  ASSERT_TRUE(
      ops().Accumulate(kv, vv, TokenLists{all.data(), oall.data(), heads}, mall.view()).ok());
  ASSERT_TRUE(ops().Merge(ma.view(), mb.view()).ok());
  EXPECT_EQ(ma.count, mall.count);
  EXPECT_EQ(ma.ks, mall.ks);
  EXPECT_EQ(ma.vs, mall.vs);
  EXPECT_EQ(ma.s, mall.s);
}

TEST_F(MomentsCpuTest, CompactAndAccumulateGathersKeptAndSummarizesTheRest) {
  const uint32_t heads = 4, d = 128;
  const uint64_t tokens = 2500;
  std::mt19937_64 rng(3);
  const auto kf = Gaussian(heads * tokens * d, rng), vf = Gaussian(heads * tokens * d, rng);
  std::vector<uint16_t> k(kf.size()), v(vf.size());  // bf16 input
  for (size_t i = 0; i < kf.size(); ++i) {
    k[i] = FloatToBf16(kf[i]);
    v[i] = FloatToBf16(vf[i]);
  }
  std::vector<uint32_t> kept, ev;
  std::vector<uint64_t> ko{0}, eo{0};
  for (uint32_t h = 0; h < heads; ++h) {
    testing::RandomSplit(tokens, 0.25 * (h + 1) - 0.01, rng, &kept, &ev);
    ko.push_back(kept.size());
    eo.push_back(ev.size());
  }
  const HeadsView kv = HeadsView::Dense(k.data(), DType::kBF16, heads, tokens, d);
  const HeadsView vv = HeadsView::Dense(v.data(), DType::kBF16, heads, tokens, d);
  std::vector<uint16_t> kk(kept.size() * d), vk(kept.size() * d);
  HostMoments fused(heads, d), separate(heads, d);
  ASSERT_TRUE(ops()
                  .CompactAndAccumulate(kv, vv, TokenLists{kept.data(), ko.data(), heads},
                                        kk.data(), vk.data(), fused.view())
                  .ok());
  ASSERT_TRUE(
      ops().Accumulate(kv, vv, TokenLists{ev.data(), eo.data(), heads}, separate.view()).ok());
  for (uint32_t h = 0; h < heads; ++h) {
    for (uint64_t i = ko[h]; i < ko[h + 1]; ++i) {
      ASSERT_EQ(0, std::memcmp(&kk[i * d], &k[(h * tokens + kept[i]) * d], 2 * d));
      ASSERT_EQ(0, std::memcmp(&vk[i * d], &v[(h * tokens + kept[i]) * d], 2 * d));
    }
  }
  EXPECT_EQ(fused.count, separate.count);
  for (size_t i = 0; i < fused.s.size(); ++i) ASSERT_NEAR(fused.s[i], separate.s[i], 1e-2);
  for (size_t i = 0; i < fused.ks.size(); ++i) ASSERT_NEAR(fused.ks[i], separate.ks[i], 1e-3);
}

// The deferred form: the same copies and moments as CompactAndAccumulate, the values' data
// check on every row (the lowest bad head * tokens + token, never raising a lower one already
// there), and malformed lists reported in the error word with nothing copied, added or checked.
TEST_F(MomentsCpuTest, CompactAndAccumulateDeferredChecksValuesAndLists) {
  const uint32_t heads = 3, d = 64;
  const uint64_t tokens = 700;
  std::mt19937_64 rng(11);
  std::vector<float> k = Gaussian(heads * tokens * d, rng, 0.2f);
  std::vector<float> v = Gaussian(heads * tokens * d, rng);
  std::vector<uint32_t> kept, ev;
  std::vector<uint64_t> ko{0};
  for (uint32_t h = 0; h < heads; ++h) {
    testing::RandomSplit(tokens, 0.4, rng, &kept, &ev);
    ko.push_back(kept.size());
  }
  auto run = [&](const std::vector<uint32_t>& list, uint32_t* error, uint64_t* bad,
                 HostMoments* m, std::vector<float>* kk, std::vector<float>* vk) {
    const HeadsView kv = HeadsView::Dense(k.data(), DType::kF32, heads, tokens, d);
    const HeadsView vv = HeadsView::Dense(v.data(), DType::kF32, heads, tokens, d);
    kk->assign(list.size() * d, -1.0f);
    vk->assign(list.size() * d, -1.0f);
    return ops().CompactAndAccumulateDeferred(kv, vv, TokenLists{list.data(), ko.data(), heads},
                                              kk->data(), vk->data(), error, bad, m->view());
  };
  HostMoments want(heads, d), got(heads, d);
  std::vector<float> wk(kept.size() * d), wv(kept.size() * d), gk, gv;
  ASSERT_TRUE(ops()
                  .CompactAndAccumulate(
                      HeadsView::Dense(k.data(), DType::kF32, heads, tokens, d),
                      HeadsView::Dense(v.data(), DType::kF32, heads, tokens, d),
                      TokenLists{kept.data(), ko.data(), heads}, wk.data(), wv.data(),
                      want.view())
                  .ok());
  uint32_t error = 0;
  uint64_t bad = ~uint64_t{0};
  ASSERT_TRUE(run(kept, &error, &bad, &got, &gk, &gv).ok());
  EXPECT_EQ(error, 0u);
  EXPECT_EQ(bad, ~uint64_t{0});
  EXPECT_EQ(gk, wk);
  EXPECT_EQ(gv, wv);
  EXPECT_EQ(got.count, want.count);
  EXPECT_EQ(got.s, want.s);
  // NaN in head 2 and Inf in head 1 (one kept row, one evicted): head 1's row is reported; a
  // lower finding already in the word stays.
  v[(2 * tokens + 5) * d + 3] = NAN;
  v[(1 * tokens + 600) * d] = INFINITY;
  v[(1 * tokens + 650) * d + 1] = NAN;
  HostMoments again(heads, d);
  bad = ~uint64_t{0};
  ASSERT_TRUE(run(kept, &error, &bad, &again, &gk, &gv).ok());
  EXPECT_EQ(bad, 1 * tokens + 600);
  bad = 7;
  ASSERT_TRUE(run(kept, &error, &bad, &again, &gk, &gv).ok());
  EXPECT_EQ(bad, 7u);
  // A list out of order: the error word, nothing written or checked.
  std::vector<uint32_t> swapped = kept;
  std::swap(swapped[ko[1] + 2], swapped[ko[1] + 3]);
  HostMoments none(heads, d);
  bad = ~uint64_t{0};
  ASSERT_TRUE(run(swapped, &error, &bad, &none, &gk, &gv).ok());
  EXPECT_EQ(error, 1u);
  EXPECT_EQ(bad, ~uint64_t{0});
  EXPECT_EQ(none.count, std::vector<uint64_t>(heads, 0));
  EXPECT_EQ(gk, std::vector<float>(kept.size() * d, -1.0f));
  // Null words or outputs are argument errors.
  EXPECT_EQ(run(kept, nullptr, &bad, &none, &gk, &gv).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(kept, &error, nullptr, &none, &gk, &gv).code(),
            absl::StatusCode::kInvalidArgument);
}

// Runs the backend's attention for one layer given full K/V and a per-head kept/evicted split.
struct AttentionCase {
  uint32_t hq, hk, d;
  uint64_t tokens, nq;
  std::vector<float> k, v, q;
  std::vector<std::vector<uint32_t>> kept, evicted;
  std::vector<float> kept_k, kept_v;
  std::vector<uint64_t> offsets{0};
};

AttentionCase MakeCase(uint32_t hq, uint32_t hk, uint32_t d, uint64_t tokens, uint64_t nq,
                       double keep, std::mt19937_64& rng) {
  AttentionCase c{hq,
                  hk,
                  d,
                  tokens,
                  nq,
                  Gaussian(hk * tokens * d, rng, 0.3f),
                  Gaussian(hk * tokens * d, rng),
                  Gaussian(hq * nq * d, rng)};
  c.kept.resize(hk);
  c.evicted.resize(hk);
  for (uint32_t h = 0; h < hk; ++h) {
    testing::RandomSplit(tokens, keep, rng, &c.kept[h], &c.evicted[h]);
    for (uint32_t t : c.kept[h]) {
      c.kept_k.insert(c.kept_k.end(), c.k.begin() + (h * tokens + t) * d,
                      c.k.begin() + (h * tokens + t + 1) * d);
      c.kept_v.insert(c.kept_v.end(), c.v.begin() + (h * tokens + t) * d,
                      c.v.begin() + (h * tokens + t + 1) * d);
    }
    c.offsets.push_back(c.offsets.back() + c.kept[h].size());
  }
  return c;
}

// Moments of c.evicted through the backend.
HostMoments MomentsOf(MomentOps& ops, const AttentionCase& c) {
  std::vector<uint32_t> idx;
  std::vector<uint64_t> off{0};
  for (const auto& e : c.evicted) {
    idx.insert(idx.end(), e.begin(), e.end());
    off.push_back(idx.size());
  }
  HostMoments m(c.hk, c.d);
  absl::Status s = ops.Accumulate(HeadsView::Dense(c.k.data(), DType::kF32, c.hk, c.tokens, c.d),
                                  HeadsView::Dense(c.v.data(), DType::kF32, c.hk, c.tokens, c.d),
                                  TokenLists{idx.data(), off.data(), c.hk}, m.view());
  EXPECT_TRUE(s.ok()) << s;
  return m;
}

std::vector<float> RunAttention(MomentOps& ops, const AttentionCase& c, HostMoments* m,
                                bool correct) {
  std::vector<float> out(size_t{c.hq} * c.nq * c.d, -1.0f);
  AttentionParams p;
  p.queries = HeadsView::Dense(c.q.data(), DType::kF32, c.hq, c.nq, c.d);
  p.kv = RaggedKv{c.kept_k.data(), c.kept_v.data(), DType::kF32, c.offsets.data(), c.hk, c.d};
  if (m != nullptr) p.moments = m->view();
  p.correct = correct;
  p.out = out.data();
  absl::Status s = ops.Attention(p);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// Worst relative error of the backend's attention against the float64 reference.
double WorstError(const AttentionCase& c, const std::vector<float>& out, HostMoments* m,
                  bool correct, bool ref_correct) {
  double worst = 0.0;
  const uint32_t group = c.hq / c.hk;
  for (uint32_t g = 0; g < c.hq; ++g) {
    const uint32_t h = g / group;
    const HeadData hd = HeadOf(c.k, c.v, h, c.tokens, c.d);
    const RefMoments r = RefMomentsOf(hd, c.evicted[h], c.d);
    for (uint64_t i = 0; i < c.nq; ++i) {
      const float* q = &c.q[(g * c.nq + i) * c.d];
      const auto want = RefAttention(q, hd, c.kept[h], &r, ref_correct, c.d);
      worst = std::max(worst, RelErr(&out[(g * c.nq + i) * c.d], want));
    }
  }
  return worst;
}

TEST_F(MomentsCpuTest, AttentionMatchesFloat64ReferenceGqa) {
  std::mt19937_64 rng(4);
  for (double keep : {0.1, 0.5, 0.9}) {
    AttentionCase c = MakeCase(8, 2, 64, 700, 3, keep, rng);
    HostMoments m = MomentsOf(ops(), c);
    EXPECT_LT(WorstError(c, RunAttention(ops(), c, &m, true), &m, true, true), 1e-4) << keep;
    EXPECT_LT(WorstError(c, RunAttention(ops(), c, &m, false), &m, false, false), 1e-4) << keep;
  }
}

TEST_F(MomentsCpuTest, AttentionLongContextSplitsAndMerges) {
  std::mt19937_64 rng(5);
  AttentionCase c = MakeCase(4, 1, 128, 20000, 2, 0.6, rng);  // several key ranges per head
  HostMoments m = MomentsOf(ops(), c);
  EXPECT_LT(WorstError(c, RunAttention(ops(), c, &m, true), &m, true, true), 1e-4);
}

TEST_F(MomentsCpuTest, AllTokensKeptEqualsExactAttention) {
  std::mt19937_64 rng(6);
  AttentionCase c = MakeCase(4, 4, 64, 300, 2, 1.0, rng);
  HostMoments m = MomentsOf(ops(), c);
  ASSERT_EQ(m.count[0], 0u);
  EXPECT_LT(WorstError(c, RunAttention(ops(), c, &m, true), &m, true, false), 1e-5);
}

TEST_F(MomentsCpuTest, LargeLogitsStayFinite) {
  std::mt19937_64 rng(7);
  AttentionCase c = MakeCase(2, 1, 64, 400, 1, 0.3, rng);
  for (float& x : c.q) x *= 300.0f;
  HostMoments m = MomentsOf(ops(), c);
  const auto out = RunAttention(ops(), c, &m, true);
  for (float x : out) ASSERT_TRUE(std::isfinite(x));
  EXPECT_LT(WorstError(c, out, &m, true, true), 1e-3);
}

TEST_F(MomentsCpuTest, EverythingEvictedLeavesTheVirtualTokenAlone) {
  std::mt19937_64 rng(8);
  AttentionCase c = MakeCase(2, 1, 64, 100, 1, 0.0, rng);
  ASSERT_TRUE(c.kept[0].empty());
  HostMoments m = MomentsOf(ops(), c);
  EXPECT_LT(WorstError(c, RunAttention(ops(), c, &m, true), &m, true, true), 1e-4);
  const auto plain = RunAttention(ops(), c, &m, false);  // nothing to attend to: zeros
  for (float x : plain) EXPECT_EQ(x, 0.0f);
}

// Evicted keys at mu + r u_j (|u_j| = 1): the first-order correction's error against full
// attention falls like r^2 (exact at r = 0); the uncorrected error does not fall.
TEST_F(MomentsCpuTest, CorrectionErrorShrinksLikeRadiusSquared) {
  const uint32_t d = 64;
  const uint64_t tokens = 1200;
  std::mt19937_64 rng(9);
  AttentionCase base = MakeCase(2, 1, d, tokens, 4, 0.5, rng);
  std::vector<float> mu = Gaussian(d, rng), dirs = Gaussian(tokens * d, rng);
  std::vector<double> corrected, plain;
  for (double r : {0.0, 0.4, 0.2, 0.1, 0.05}) {
    AttentionCase c = base;
    for (uint32_t t : c.evicted[0]) {
      double norm = 0.0;
      for (uint32_t x = 0; x < d; ++x) norm += dirs[t * d + x] * dirs[t * d + x];
      norm = std::sqrt(norm);
      for (uint32_t x = 0; x < d; ++x) {
        c.k[t * d + x] = mu[x] + static_cast<float>(r * dirs[t * d + x] / norm);
      }
    }
    HostMoments m = MomentsOf(ops(), c);
    // Error against FULL attention (every token kept).
    AttentionCase full = c;
    full.kept[0].clear();
    for (uint32_t t = 0; t < tokens; ++t) full.kept[0].push_back(t);
    full.evicted[0].clear();
    corrected.push_back(WorstError(full, RunAttention(ops(), c, &m, true), &m, false, false));
    plain.push_back(WorstError(full, RunAttention(ops(), c, &m, false), &m, false, false));
  }
  EXPECT_LT(corrected[0], 1e-5);  // exact at r = 0 (up to fp32)
  for (size_t i = 2; i < corrected.size(); ++i) {
    const double ratio = corrected[i - 1] / corrected[i];  // r halves: expect about 4
    EXPECT_GT(ratio, 3.0) << i;
    EXPECT_LT(ratio, 5.0) << i;
    EXPECT_GT(plain[i], 0.5 * plain[i - 1]);  // does not shrink with r
    EXPECT_GT(plain[i], 10.0 * corrected[i]);
  }
}

TEST_F(MomentsCpuTest, RejectsBadInput) {
  const uint32_t d = 64;
  std::vector<float> k(2 * 10 * d), v(2 * 10 * d);
  std::vector<uint32_t> idx{1, 12};  // 12 is out of range
  std::vector<uint64_t> off{0, 1, 2};
  HostMoments m(2, d);
  const HeadsView kv = HeadsView::Dense(k.data(), DType::kF32, 2, 10, d);
  const HeadsView vv = HeadsView::Dense(v.data(), DType::kF32, 2, 10, d);
  EXPECT_EQ(ops().Accumulate(kv, vv, TokenLists{idx.data(), off.data(), 2}, m.view()).code(),
            absl::StatusCode::kInvalidArgument);
  // The deferred form on the host reports at once and leaves the error word alone.
  uint32_t error = 0;
  EXPECT_EQ(ops()
                .AccumulateDeferred(kv, vv, TokenLists{idx.data(), off.data(), 2}, 10, &error,
                                    m.view())
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(error, 0u);
  EXPECT_TRUE(AccumulateErrorStatus(0).ok());
  EXPECT_EQ(AccumulateErrorStatus(1).code(), absl::StatusCode::kInvalidArgument);
  idx[1] = 3;
  HeadsView wrong = vv;
  wrong.num_tokens = 9;
  EXPECT_EQ(ops().Accumulate(kv, wrong, TokenLists{idx.data(), off.data(), 2}, m.view()).code(),
            absl::StatusCode::kInvalidArgument);
  HeadsView dev = kv;
  dev.space = MemorySpace::kDevice;
  EXPECT_EQ(ops().Accumulate(dev, vv, TokenLists{idx.data(), off.data(), 2}, m.view()).code(),
            absl::StatusCode::kInvalidArgument);
  HostMoments small(1, d);
  EXPECT_EQ(ops().Accumulate(kv, vv, TokenLists{idx.data(), off.data(), 2}, small.view()).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<uint32_t> unsorted{3, 1};
  std::vector<uint64_t> off2{0, 2, 2};
  std::vector<float> out_k(2 * d), out_v(2 * d);
  EXPECT_EQ(ops()
                .CompactAndAccumulate(kv, vv, TokenLists{unsorted.data(), off2.data(), 2},
                                      out_k.data(), out_v.data(), m.view())
                .code(),
            absl::StatusCode::kInvalidArgument);
  // Attention: 3 q heads over 2 kv heads is not GQA.
  std::vector<float> q(3 * d), out(3 * d);
  std::vector<uint64_t> koff{0, 0, 0};
  AttentionParams p;
  p.queries = HeadsView::Dense(q.data(), DType::kF32, 3, 1, d);
  p.kv = RaggedKv{k.data(), v.data(), DType::kF32, koff.data(), 2, d};
  p.out = out.data();
  EXPECT_EQ(ops().Attention(p).code(), absl::StatusCode::kInvalidArgument);
  p.queries.num_heads = 2;
  p.moments = small.view();  // 1 head of moments for 2 kv heads
  EXPECT_EQ(ops().Attention(p).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcomp
