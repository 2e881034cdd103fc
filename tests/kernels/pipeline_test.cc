// The compression pipeline: Compress over layers (ragged, really smaller, format round trip,
// moments of the evicted tokens, the eviction hook) and block-wise compression.
#include "kvcomp/kernels/pipeline.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "kvcomp/core/format.h"
#include "kvcomp/kernels/backend.h"
#include "scoring_test_util.h"

namespace kvcomp {
namespace {

using testing::HostHeads;
using testing::RandomHeads;

struct Sequence {
  KvLayout layout;
  uint64_t tokens;
  std::vector<HostHeads> k, v;
  KvCacheView view() const {
    KvCacheView c;
    c.layout = layout;
    c.num_tokens = tokens;
    for (uint32_t l = 0; l < layout.num_layers; ++l) {
      c.keys.push_back(k[l].view());
      c.values.push_back(v[l].view());
    }
    return c;
  }
};

Sequence MakeSequence(const KvLayout& layout, uint64_t tokens, uint64_t seed) {
  Sequence s{layout, tokens, {}, {}};
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    s.k.push_back(
        RandomHeads(layout.dtype, layout.num_kv_heads, tokens, layout.head_dim, seed + 2 * l));
    s.v.push_back(
        RandomHeads(layout.dtype, layout.num_kv_heads, tokens, layout.head_dim, seed + 2 * l + 1));
  }
  return s;
}

std::unique_ptr<Backend> Cpu() { return std::move(*MakeCpuBackend()); }

TEST(PipelineTest, CompressKeepsKvpressCountsAndIsReallySmaller) {
  auto cpu = Cpu();
  const Sequence s = MakeSequence({3, 2, 8, 128, DType::kBF16}, 1000, 1);
  CompressionPolicy p;
  p.ratio = 0.07;
  p.moments = false;
  auto c = Compress(*cpu, s.view(), p);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->Validate().ok());
  for (uint32_t x : c->kept) EXPECT_EQ(x, 929u);
  const uint64_t row = 128 * 2;
  EXPECT_EQ(c->keys.size(), 6 * 929 * row);
  EXPECT_EQ(c->values.size(), 6 * 929 * row);
  p.ratio = 0.75;
  c = Compress(*cpu, s.view(), p);
  ASSERT_TRUE(c.ok());
  auto bytes = format::EncodeCache(*c);
  ASSERT_TRUE(bytes.ok());
  EXPECT_LT(bytes->size(), c->original_bytes() * 0.27);  // 25% kept plus positions and header
  auto back = format::ParseCache(*bytes);
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(*back == *c);
}

TEST(PipelineTest, AdaKVIsRaggedAndMatchesTheOpPerLayer) {
  auto cpu = Cpu();
  const Sequence s = MakeSequence({2, 4, 8, 64, DType::kF16}, 513, 3);
  CompressionPolicy p;
  p.scorer = Scorer::kKeyDiff;
  p.head_budget = HeadBudget::kAdaKV;
  p.ratio = 0.5;
  p.n_recent = 8;
  p.moments = false;
  auto c = Compress(*cpu, s.view(), p);
  ASSERT_TRUE(c.ok()) << c.status();
  std::set<uint32_t> distinct(c->kept.begin(), c->kept.end());
  EXPECT_GT(distinct.size(), 1u);
  uint64_t off = 0;
  for (uint32_t l = 0; l < 2; ++l) {
    uint64_t layer_total = 0;
    for (uint32_t h = 0; h < 4; ++h) layer_total += c->kept[c->head_index(l, h)];
    EXPECT_EQ(layer_total, 4u * 256);
    auto scores = ScoreLayer(*cpu, s.k[l].view(), p, l);
    ASSERT_TRUE(scores.ok());
    auto sel = SelectParamsFromPolicy(p, 513);
    const auto ref = testing::RefSelect(*scores, 4, 513, *sel);
    for (uint32_t h = 0; h < 4; ++h) {
      std::vector<uint32_t> got(c->positions.begin() + off,
                                c->positions.begin() + off + c->kept[c->head_index(l, h)]);
      EXPECT_EQ(got, ref[h]);
      EXPECT_GE(got.size(), 8u + p.n_sink);  // protected tokens survive the competition
      EXPECT_EQ(got.back(), 512u);
      off += got.size();
    }
  }
}

// Head h of `c` (layer-major) keeps every position in [from, to).
bool KeepsRange(const CompressedCache& c, uint64_t off, uint32_t kept, uint64_t from,
                uint64_t to) {
  const std::set<uint32_t> got(c.positions.begin() + off, c.positions.begin() + off + kept);
  for (uint64_t t = from; t < to; ++t) {
    if (!got.count(static_cast<uint32_t>(t))) return false;
  }
  return true;
}

TEST(PipelineTest, RecentFractionWindowScalesWithTheBudget) {
  auto cpu = Cpu();
  const uint64_t n = 1000;
  const Sequence s = MakeSequence({2, 2, 4, 64, DType::kBF16}, n, 11);
  for (double ratio : {0.5, 0.75, 0.9}) {
    SCOPED_TRACE(ratio);
    CompressionPolicy p;
    p.ratio = ratio;
    p.n_recent = 4;
    p.recent_fraction = 0.5;
    p.moments = false;
    const uint64_t kept = p.KeptPerHead(n);
    const uint32_t window = p.EffectiveRecent(kept);
    EXPECT_EQ(window, kept / 2);
    auto c = Compress(*cpu, s.view(), p);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE(c->Validate().ok());
    EXPECT_EQ(c->policy.recent_fraction, 0.5);
    // The same selection as an absolute n_recent of that size.
    CompressionPolicy abs = p;
    abs.recent_fraction = 0;
    abs.n_recent = window;
    auto a = Compress(*cpu, s.view(), abs);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(c->positions, a->positions);
    // Without the fraction, manifold keeps far from all of those recent tokens.
    CompressionPolicy plain = p;
    plain.recent_fraction = 0;
    auto q = Compress(*cpu, s.view(), plain);
    ASSERT_TRUE(q.ok());
    uint64_t off = 0;
    bool plain_keeps_all = true;
    for (uint32_t h = 0; h < c->num_heads(); ++h) {
      ASSERT_EQ(c->kept[h], kept);
      EXPECT_TRUE(KeepsRange(*c, off, c->kept[h], n - window, n)) << "head " << h;
      EXPECT_TRUE(KeepsRange(*c, off, c->kept[h], 0, p.n_sink)) << "head " << h;
      plain_keeps_all = plain_keeps_all && KeepsRange(*q, off, q->kept[h], n - window, n);
      off += c->kept[h];
    }
    EXPECT_FALSE(plain_keeps_all);
  }
  // A small budget: n_recent is the floor of the window.
  CompressionPolicy p;
  p.token_budget = 10;
  p.n_recent = 6;
  p.recent_fraction = 0.25;  // floor(2.5) = 2 < 6
  p.moments = false;
  auto c = Compress(*cpu, s.view(), p);
  ASSERT_TRUE(c.ok());
  uint64_t off = 0;
  for (uint32_t h = 0; h < c->num_heads(); ++h) {
    EXPECT_TRUE(KeepsRange(*c, off, c->kept[h], n - 6, n));
    off += c->kept[h];
  }
}

TEST(PipelineTest, RecentFractionUnderAdaKVIsTheUniformBudgetsShare) {
  auto cpu = Cpu();
  const uint64_t n = 513;
  const Sequence s = MakeSequence({2, 4, 8, 64, DType::kF16}, n, 13);
  CompressionPolicy p;
  p.head_budget = HeadBudget::kAdaKV;
  p.ratio = 0.75;
  p.recent_fraction = 0.5;
  p.moments = false;
  const uint32_t window = p.EffectiveRecent(p.KeptPerHead(n));  // 64 of the uniform 128
  EXPECT_EQ(window, 64u);
  auto c = Compress(*cpu, s.view(), p);
  ASSERT_TRUE(c.ok()) << c.status();
  uint64_t off = 0;
  for (uint32_t h = 0; h < c->num_heads(); ++h) {
    EXPECT_GE(c->kept[h], window + p.n_sink);
    EXPECT_TRUE(KeepsRange(*c, off, c->kept[h], n - window, n)) << "head " << h;
    off += c->kept[h];
  }
}

TEST(PipelineTest, BlockWiseRecentFractionIsTheBudgetsShare) {
  auto cpu = Cpu();
  const KvLayout layout{1, 2, 2, 64, DType::kBF16};
  const uint64_t n = 700;
  const Sequence s = MakeSequence(layout, n, 17);
  CompressionPolicy p;
  p.block_size = 64;
  p.token_budget = 200;
  p.recent_fraction = 0.5;
  p.moments = false;
  auto bc = BlockCompressor::Create(*cpu, layout, p);
  ASSERT_TRUE(bc.ok()) << bc.status();
  for (uint64_t t0 = 0; t0 < n; t0 += 64) {
    const uint64_t b = std::min<uint64_t>(64, n - t0);
    HeadsView kv = s.k[0].view(), vv = s.v[0].view();
    kv.data = s.k[0].bytes.data() + t0 * 64 * 2;
    vv.data = s.v[0].bytes.data() + t0 * 64 * 2;
    kv.num_tokens = vv.num_tokens = b;
    ASSERT_TRUE((*bc)->Append(0, kv, vv).ok());
  }
  auto c = (*bc)->Finish();
  ASSERT_TRUE(c.ok()) << c.status();
  for (uint32_t h = 0; h < 2; ++h) {
    ASSERT_EQ(c->kept[h], 200u);
    EXPECT_TRUE(KeepsRange(*c, uint64_t{h} * 200, 200, n - 100, n)) << "head " << h;
  }
}

TEST(PipelineTest, NothingEvictedStoresNoMomentsEvenWhenAsked) {
  // A 16-token chunk at ratio 0 with moments asked for: the summaries would be all
  // zero and several times the chunk; the cache stores none and stays near the input's size.
  auto cpu = Cpu();
  const Sequence s = MakeSequence({2, 2, 8, 128, DType::kBF16}, 16, 23);
  CompressionPolicy p;
  p.moments = true;
  p.ratio = 0.0;
  auto c = Compress(*cpu, s.view(), p);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->has_moments);
  auto size = format::EncodedSize(*c);
  ASSERT_TRUE(size.ok()) << size.status();
  const uint64_t original = uint64_t{2} * 2 * 16 * 128 * 2 * 2;  // K and V in bf16
  EXPECT_LT(*size, original + original / 10) << *size << " bytes for " << original;
  // A budget of at least the sequence evicts nothing either.
  p.token_budget = 16;
  c = Compress(*cpu, s.view(), p);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->has_moments);
  // With eviction the summaries are kept (they stand in for the evicted tokens).
  p.token_budget = 8;
  c = Compress(*cpu, s.view(), p);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->has_moments);
  // Block-wise at ratio 0: none either.
  CompressionPolicy b;
  b.moments = true;
  b.ratio = 0.0;
  b.block_size = 16;
  BlockCompressorOptions bo;
  bo.expected_tokens = 16;
  auto bc = BlockCompressor::Create(*cpu, s.layout, b, bo);
  ASSERT_TRUE(bc.ok()) << bc.status();
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE((*bc)->Append(l, s.k[l].view(), s.v[l].view()).ok());
  auto bcache = (*bc)->Finish();
  ASSERT_TRUE(bcache.ok()) << bcache.status();
  EXPECT_FALSE(bcache->has_moments);
}

TEST(PipelineTest, RecentFractionOutOfRangeIsInvalidArgument) {
  auto cpu = Cpu();
  const Sequence s = MakeSequence({1, 1, 1, 64, DType::kF32}, 50, 19);
  CompressionPolicy p;
  p.recent_fraction = 1.0;
  auto c = Compress(*cpu, s.view(), p);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("recent_fraction"), std::string::npos) << c.status();
}

TEST(PipelineTest, MomentsAndHookSeeExactlyTheEvictedTokens) {
  auto cpu = Cpu();
  const Sequence s = MakeSequence({2, 2, 4, 64, DType::kF32}, 301, 5);
  CompressionPolicy p;
  p.moments = true;
  p.ratio = 0.6;
  std::map<std::pair<uint32_t, uint32_t>, std::vector<uint32_t>> seen;
  CompressOptions o;
  o.on_evict = [&](const EvictedTokens& e) {
    seen[{e.layer, e.kv_head}].assign(e.rows.begin(), e.rows.end());
    return absl::OkStatus();
  };
  auto c = Compress(*cpu, s.view(), p, o);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->has_moments);
  ASSERT_TRUE(c->Validate().ok());
  uint64_t off = 0;
  for (uint32_t l = 0; l < 2; ++l) {
    for (uint32_t h = 0; h < 2; ++h) {
      const uint32_t hi = c->head_index(l, h);
      std::vector<uint32_t> kept(c->positions.begin() + off,
                                 c->positions.begin() + off + c->kept[hi]);
      off += c->kept[hi];
      const auto& ev = seen[{l, h}];
      EXPECT_EQ(kept.size() + ev.size(), 301u);
      std::vector<uint32_t> all;
      std::merge(kept.begin(), kept.end(), ev.begin(), ev.end(), std::back_inserter(all));
      for (uint32_t t = 0; t < 301; ++t) ASSERT_EQ(all[t], t);
      EXPECT_EQ(c->moment_count[hi], ev.size());
      for (uint32_t j = 0; j < 64; ++j) {
        double ks = 0;
        for (uint32_t t : ev) ks += s.k[l].at(h, t, j);
        EXPECT_NEAR(c->moment_key_sum[uint64_t{hi} * 64 + j], ks, 1e-3 * std::max(1.0, ks));
      }
    }
  }
}

TEST(PipelineTest, BlockWiseStaysWithinBudgetPlusBlockAndAccountsForEveryToken) {
  auto cpu = Cpu();
  const KvLayout layout{2, 2, 4, 64, DType::kBF16};
  const uint64_t n = 1000;
  const Sequence s = MakeSequence(layout, n, 7);
  for (Scorer scorer : {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold,
                        Scorer::kWindowedManifold, Scorer::kStreaming, Scorer::kRandom}) {
    SCOPED_TRACE(ScorerName(scorer));
    CompressionPolicy p;
    p.scorer = scorer;
    p.moments = true;
    p.block_size = 64;
    p.token_budget = 200;
    p.window = 128;
    p.n_recent = 16;
    std::map<std::pair<uint32_t, uint32_t>, uint64_t> evicted;
    BlockCompressorOptions o;
    o.on_evict = [&](const EvictedTokens& e) {
      evicted[{e.layer, e.kv_head}] += e.rows.size();
      for (uint32_t pos : e.positions) EXPECT_LT(pos, n);
      return absl::OkStatus();
    };
    auto bc = BlockCompressor::Create(*cpu, layout, p, o);
    ASSERT_TRUE(bc.ok()) << bc.status();
    for (uint64_t t0 = 0; t0 < n; t0 += 64) {
      const uint64_t b = std::min<uint64_t>(64, n - t0);
      for (uint32_t l = 0; l < 2; ++l) {
        HeadsView kv = s.k[l].view(), vv = s.v[l].view();
        kv.data = s.k[l].bytes.data() + t0 * 64 * 2;
        vv.data = s.v[l].bytes.data() + t0 * 64 * 2;
        kv.num_tokens = vv.num_tokens = b;  // strided view into the full sequence
        ASSERT_TRUE((*bc)->Append(l, kv, vv).ok());
      }
    }
    EXPECT_LE((*bc)->peak_tokens_per_head(), 200u + 64u);
    auto c = (*bc)->Finish();
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE(c->Validate().ok());
    for (uint32_t x : c->kept) EXPECT_EQ(x, 200u);
    for (const auto& [key, count] : evicted) EXPECT_EQ(count, n - 200);
    ASSERT_TRUE(c->has_moments);
    for (uint64_t x : c->moment_count) EXPECT_EQ(x, n - 200);
    // Kept rows are the input rows at their positions; the last n_recent positions survive.
    uint64_t off = 0;
    for (uint32_t l = 0; l < 2; ++l) {
      for (uint32_t h = 0; h < 2; ++h) {
        for (uint32_t r = 0; r < 200; ++r) {
          const uint32_t pos = c->positions[off + r];
          ASSERT_EQ(0, std::memcmp(c->keys.data() + (off + r) * 128,
                                   s.k[l].bytes.data() + (uint64_t{h} * n + pos) * 128, 128));
        }
        EXPECT_EQ(c->positions[off + 199], n - 1);
        EXPECT_EQ(c->positions[off + 184], n - 16);
        off += 200;
      }
    }
  }
}

TEST(PipelineTest, OneBlockEqualsWholeSequence) {
  auto cpu = Cpu();
  const KvLayout layout{1, 3, 3, 128, DType::kF32};
  const Sequence s = MakeSequence(layout, 300, 9);
  CompressionPolicy p;
  p.scorer = Scorer::kManifold;
  p.token_budget = 120;
  p.block_size = 300;
  p.moments = false;
  auto bc = BlockCompressor::Create(*cpu, layout, p);
  ASSERT_TRUE(bc.ok());
  ASSERT_TRUE((*bc)->Append(0, s.k[0].view(), s.v[0].view()).ok());
  auto a = (*bc)->Finish();
  auto b = Compress(*cpu, s.view(), p);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->positions, b->positions);
  EXPECT_EQ(a->keys, b->keys);
  EXPECT_EQ(a->values, b->values);
}

TEST(PipelineTest, BlockWiseErrors) {
  auto cpu = Cpu();
  const KvLayout layout{1, 2, 2, 64, DType::kBF16};
  CompressionPolicy p;
  p.token_budget = 10;
  EXPECT_EQ(BlockCompressor::Create(*cpu, layout, p).status().code(),
            absl::StatusCode::kInvalidArgument);  // block_size 0
  p.block_size = 8;
  p.token_budget = 0;
  EXPECT_EQ(BlockCompressor::Create(*cpu, layout, p).status().code(),
            absl::StatusCode::kInvalidArgument);  // no budget
  p.token_budget = 10;
  auto bc = BlockCompressor::Create(*cpu, layout, p);
  ASSERT_TRUE(bc.ok());
  HostHeads k = RandomHeads(DType::kBF16, 2, 9, 64, 1);
  EXPECT_EQ((*bc)->Append(0, k.view(), k.view()).code(), absl::StatusCode::kInvalidArgument);
  HostHeads k8 = RandomHeads(DType::kBF16, 2, 8, 64, 1);
  k8.Set(5, NAN);
  EXPECT_EQ((*bc)->Append(0, k8.view(), k8.view()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*bc)->tokens_seen(0), 0u);  // the bad block was dropped
  EXPECT_EQ((*bc)->Finish().status().code(), absl::StatusCode::kInvalidArgument);  // empty
}

}  // namespace
}  // namespace kvcomp
