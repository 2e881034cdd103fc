// CompressToDevice on the CUDA backend against Compress on the CPU reference, on fresh random
// inputs: every key codec with every value codec (one rank and per-layer ranks, KVSplice
// outliers on and off), moments, the moment-aware rescoring, device and host inputs, and the
// bytes that cross between host and device (only the kept counts before Download; Download
// copies each array once). The streaming scorer selects by position, so both backends keep the
// same tokens and the codecs' outputs can be compared row by row. gpu label; 77 (skipped)
// without a device.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "common/gpu.h"
#include "gtest/gtest.h"
#include "kernels/codec_test_util.h"
#include "kernels/scoring_test_util.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/calibration.h"
#include "kvcomp/kernels/kvsplice.h"
#include "kvcomp/kernels/pipeline.h"

KVCOMP_GPU_TEST_BINARY();

namespace kvcomp {
namespace {

struct Backends {
  std::unique_ptr<Backend> cpu, cuda;
  Backends() {
    auto c = MakeCpuBackend(CpuBackendOptions{4});
    auto g = MakeCudaBackend();
    EXPECT_TRUE(c.ok() && g.ok()) << g.status();
    if (c.ok()) cpu = std::move(*c);
    if (g.ok()) cuda = std::move(*g);
  }
};

// One sequence in host memory: random keys, low-rank values with planted outlier rows (every
// 37th token of a head replaced by a full-rank vector three times as long as a typical value).
struct Sequence {
  KvLayout layout;
  uint64_t tokens = 0;
  std::vector<std::vector<uint8_t>> k, v;  // per layer, [heads][tokens][d] of layout.dtype
  KvCacheView view() const {
    KvCacheView c;
    c.layout = layout;
    c.num_tokens = tokens;
    for (uint32_t l = 0; l < layout.num_layers; ++l) {
      c.keys.push_back(HeadsView::Dense(k[l].data(), layout.dtype, layout.num_kv_heads, tokens,
                                        layout.head_dim));
      c.values.push_back(HeadsView::Dense(v[l].data(), layout.dtype, layout.num_kv_heads, tokens,
                                          layout.head_dim));
    }
    return c;
  }
};

testing::LowRankData ValueModel(const KvLayout& layout, uint64_t tokens) {
  testing::LowRankData m;
  m.layers = layout.num_layers;
  m.heads = layout.num_kv_heads;
  m.tokens = static_cast<uint32_t>(tokens);
  m.d = layout.head_dim;
  m.true_rank = layout.head_dim / 4;
  m.decay = 0.93;
  m.noise = 0.01;
  return m;
}

Sequence MakeSequence(const KvLayout& layout, uint64_t tokens, uint64_t seed) {
  Sequence s;
  s.layout = layout;
  s.tokens = tokens;
  const uint32_t heads = layout.num_kv_heads, d = layout.head_dim;
  const std::vector<float> values = ValueModel(layout, tokens).Make(seed);
  std::mt19937_64 rng(seed * 7 + 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    s.k.push_back(
        testing::RandomHeads(layout.dtype, heads, tokens, d, seed * 100 + l).bytes);
    std::vector<uint8_t> v(DTypeBytes(layout.dtype, uint64_t{heads} * tokens * d));
    for (uint64_t i = 0; i < uint64_t{heads} * tokens; ++i) {
      const float* src = values.data() + (uint64_t{l} * heads * tokens + i) * d;
      const bool outlier = (i % tokens) % 37 == 5;
      for (uint32_t c = 0; c < d; ++c) {
        const float x = outlier ? 3.0f * normal(rng) / std::sqrt(static_cast<float>(d)) *
                                      (1.0f + 0.01f * static_cast<float>(i % 11))
                                : src[c];
        StoreFromFloat(v.data(), layout.dtype, i * d + c, x);
      }
    }
    s.v.push_back(std::move(v));
  }
  return s;
}

Projection Calibrate(Backend& cpu, const KvLayout& layout, uint64_t tokens) {
  const testing::LowRankData m = ValueModel(layout, tokens);
  CalibrationOptions o;
  o.model_id = "m";
  o.num_layers = layout.num_layers;
  o.num_kv_heads = layout.num_kv_heads;
  o.head_dim = layout.head_dim;
  auto cal = Calibrator::Create(o, &cpu);
  EXPECT_TRUE(cal.ok()) << cal.status();
  const std::vector<float> v = m.Make(999);
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    EXPECT_TRUE(cal->AddLayer(l, m.LayerView(v, l)).ok());
  }
  auto p = cal->Finish(layout.head_dim);
  EXPECT_TRUE(p.ok()) << p.status();
  return *p;
}

CompressionPolicy Streaming(double ratio) {
  CompressionPolicy p;
  p.scorer = Scorer::kStreaming;
  p.ratio = ratio;
  p.moments = false;
  return p;
}

// Every field of two caches equal, the KVSplice latents and scales included (both backends
// encode with the same chain of f32 fused multiply-adds, codec_ops.h), byte for byte.
void ExpectSameCache(Backend& cpu, const CompressedCache& want, const CompressedCache& got,
                     const Projection* projection, const pq::Calibration* pq = nullptr) {
  ASSERT_TRUE(got.Validate().ok()) << got.Validate();
  EXPECT_EQ(want.original_tokens, got.original_tokens);
  EXPECT_EQ(want.kept, got.kept);
  EXPECT_EQ(want.positions, got.positions);
  EXPECT_EQ(want.key_codec, got.key_codec);
  EXPECT_EQ(want.value_codec, got.value_codec);
  EXPECT_EQ(want.rank, got.rank);
  EXPECT_EQ(want.layer_rank, got.layer_rank);
  EXPECT_EQ(want.group_size, got.group_size);
  EXPECT_EQ(want.value_gamma, got.value_gamma);
  EXPECT_EQ(want.projection_version, got.projection_version);
  EXPECT_TRUE(want.keys == got.keys) << "keys differ";
  EXPECT_EQ(want.key_scales, got.key_scales);
  EXPECT_EQ(want.raw_value_rows, got.raw_value_rows);
  EXPECT_TRUE(want.raw_values == got.raw_values) << "raw values differ";
  EXPECT_EQ(want.values.size(), got.values.size());
  EXPECT_EQ(want.value_scales.size(), got.value_scales.size());
  EXPECT_TRUE(want.values == got.values) << "values differ";
  EXPECT_TRUE(want.value_scales == got.value_scales) << "value scales differ";
  if (want.value_codec != ValueCodec::kRaw) {
    auto dw = DecodeKept(cpu, want, projection, DType::kF32, pq);
    auto dg = DecodeKept(cpu, got, projection, DType::kF32, pq);
    ASSERT_TRUE(dw.ok() && dg.ok()) << dg.status();
    const auto* a = reinterpret_cast<const float*>(dw->values.data());
    const auto* b = reinterpret_cast<const float*>(dg->values.data());
    double e = 0, nn = 0;
    for (uint64_t i = 0; i < dw->values.size() / 4; ++i) {
      e += (a[i] - b[i]) * (a[i] - b[i]);
      nn += a[i] * a[i];
    }
    EXPECT_LT(std::sqrt(e / std::max(nn, 1e-30)), 2e-2) << ValueCodecName(want.value_codec);
  }
  EXPECT_EQ(want.has_moments, got.has_moments);
  EXPECT_EQ(want.moment_count, got.moment_count);
  ASSERT_EQ(want.moment_vk_sum.size(), got.moment_vk_sum.size());
  auto near = [](const std::vector<float>& x, const std::vector<float>& y) {
    double e = 0, nn = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      e += (double{x[i]} - y[i]) * (double{x[i]} - y[i]);
      nn += double{x[i]} * x[i];
    }
    return std::sqrt(e / std::max(nn, 1e-30));
  };
  EXPECT_LT(near(want.moment_key_sum, got.moment_key_sum), 1e-5);
  EXPECT_LT(near(want.moment_value_sum, got.moment_value_sum), 1e-5);
  EXPECT_LT(near(want.moment_vk_sum, got.moment_vk_sum), 1e-5);
}

// The bytes a downloaded cache's arrays hold.
uint64_t ArrayBytes(const CompressedCache& c) {
  return c.positions.size() * 4 + c.keys.size() + c.key_scales.size() * 4 + c.values.size() +
         c.value_scales.size() * 2 + c.raw_value_rows.size() * 8 + c.raw_values.size() +
         c.moment_count.size() * 8 +
         (c.moment_key_sum.size() + c.moment_value_sum.size() + c.moment_vk_sum.size()) * 4;
}

// Every device buffer of a CompressToDevice result holds exactly its array (the format encoder
// on the device takes the buffers' sizes as the sections').
void ExpectExactBuffers(const DeviceCompressedCache& dc) {
  const CompressedCache& h = dc.host;
  const uint64_t total = h.total_kept(), heads = h.num_heads(), d = h.layout.head_dim;
  EXPECT_TRUE(h.positions.empty() && h.keys.empty() && h.key_scales.empty() &&
              h.values.empty() && h.value_scales.empty() && h.raw_value_rows.empty() &&
              h.raw_values.empty() && h.moment_count.empty() && h.moment_key_sum.empty() &&
              h.moment_value_sum.empty() && h.moment_vk_sum.empty());
  EXPECT_EQ(dc.positions.size(), total * 4);
  EXPECT_EQ(dc.keys.size(), total * h.KeyTokenBytes());
  EXPECT_EQ(dc.key_scales.size(), h.KeyScaleCount() * 4);
  EXPECT_EQ(dc.values.size(), h.ValueBytes());
  EXPECT_EQ(dc.value_scales.size(), h.ValueScaleCount() * 2);
  EXPECT_EQ(dc.raw_value_rows.size(), dc.raw_value_row_count * 8);
  EXPECT_EQ(dc.raw_values.size(), dc.raw_value_row_count * DTypeBytes(h.layout.dtype, d));
  const uint64_t m = h.has_moments ? 1 : 0;
  EXPECT_EQ(dc.moment_count.size(), m * heads * 8);
  EXPECT_EQ(dc.moment_key_sum.size(), m * heads * d * 4);
  EXPECT_EQ(dc.moment_value_sum.size(), m * heads * d * 4);
  EXPECT_EQ(dc.moment_vk_sum.size(), m * heads * d * d * 4);
}

TEST(PipelineDeviceTest, RawCodecsAndMomentsMatchTheCpu) {
  Backends b;
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (uint32_t d : {64u, 128u}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " d=" << d);
      const KvLayout layout{3, 2, 4, d, dt};
      const Sequence s = MakeSequence(layout, 777, 11 + d);
      for (bool moments : {false, true}) {
        CompressionPolicy p = Streaming(0.4);
        p.moments = moments;
        auto want = Compress(*b.cpu, s.view(), p);
        ASSERT_TRUE(want.ok()) << want.status();
        TransferBytes t;
        CompressOptions o;
        o.transfers = &t;
        auto dc = CompressToDevice(*b.cuda, s.view(), p, o);
        ASSERT_TRUE(dc.ok()) << dc.status();
        // Nothing of the cache but its kept counts came back; the inputs went up once.
        EXPECT_EQ(t.to_host, layout.num_heads_total() * 4);
        EXPECT_EQ(t.to_device, layout.CacheBytes(777));
        ExpectExactBuffers(*dc);
        auto got = dc->Download(*b.cuda, &t);
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_EQ(t.to_host, layout.num_heads_total() * 4 + ArrayBytes(*got));
        ExpectSameCache(*b.cpu, *want, *got, nullptr);
        // Compress on the device backend is the same cache.
        auto again = Compress(*b.cuda, s.view(), p);
        ASSERT_TRUE(again.ok()) << again.status();
        ExpectSameCache(*b.cpu, *want, *again, nullptr);
      }
    }
  }
}

TEST(PipelineDeviceTest, EveryCodecCombinationMatchesTheCpu) {
  Backends b;
  const KvLayout layout{2, 2, 4, 128, DType::kBF16};
  const uint64_t n = 900;
  const Sequence s = MakeSequence(layout, n, 21);
  auto one = std::make_shared<Projection>(Calibrate(*b.cpu, layout, n));
  auto tuned = std::make_shared<Projection>(*one);
  tuned->tuned_rank = {24, 64};
  tuned->tuned_error = {0.01, 0.01};
  ASSERT_TRUE(tuned->Seal().ok());
  for (const auto& proj : {one, tuned}) {
    for (ValueCodec vc : {ValueCodec::kRaw, ValueCodec::kOrthogonal, ValueCodec::kOrthogonalInt8,
                          ValueCodec::kOrthogonalInt4}) {
      for (KeyCodec kc : {KeyCodec::kRaw, KeyCodec::kFp16, KeyCodec::kInt8, KeyCodec::kInt4}) {
        for (double raw_fraction : {0.0, 0.02}) {
          SCOPED_TRACE(::testing::Message()
                       << (proj == tuned ? "per-layer ranks " : "one rank ") << KeyCodecName(kc)
                       << " / " << ValueCodecName(vc) << " outliers " << raw_fraction);
          CompressionPolicy p = Streaming(0.5);
          p.moments = true;
          p.key_codec = kc;
          p.value_codec = vc;
          p.value_raw_fraction = raw_fraction;
          if (proj == one && vc != ValueCodec::kRaw) p.rank = 32;
          CompressOptions o;
          o.projection = proj;
          auto want = Compress(*b.cpu, s.view(), p, o);
          ASSERT_TRUE(want.ok()) << want.status();
          if (vc != ValueCodec::kRaw && raw_fraction > 0) {
            EXPECT_FALSE(want->raw_value_rows.empty()) << "no outliers planted in the kept rows";
          }
          TransferBytes t;
          o.transfers = &t;
          auto dc = CompressToDevice(*b.cuda, s.view(), p, o);
          ASSERT_TRUE(dc.ok()) << dc.status();
          EXPECT_EQ(t.to_host, layout.num_heads_total() * 4);
          EXPECT_EQ(t.to_device, layout.CacheBytes(n));
          ExpectExactBuffers(*dc);
          auto got = dc->Download(*b.cuda, &t);
          ASSERT_TRUE(got.ok()) << got.status();
          EXPECT_EQ(t.to_host, layout.num_heads_total() * 4 + ArrayBytes(*got));
          ExpectSameCache(*b.cpu, *want, *got, proj.get());
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
  }
}

// KVSplice's outlier rows where many rows tie: every 16th token of a head carries the same
// outlier vector (so their losses are equal bit for bit), more of them than the cap at a small
// raw fraction (the cap goes to the lowest rows among the equal ones) and fewer at a large one
// (every row above the limit goes). The device picks the CPU's rows, a fresh seed each run.
TEST(PipelineDeviceTest, OutlierRowsThatTieGoByLowerRow) {
  Backends b;
  const KvLayout layout{2, 3, 6, 128, DType::kBF16};
  const uint64_t n = 1200;
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Sequence s = MakeSequence(layout, n, seed % 100000);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const uint32_t d = layout.head_dim;
  std::vector<float> outlier(d);
  for (float& x : outlier) x = 4.0f * normal(rng) / std::sqrt(static_cast<float>(d));
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    for (uint64_t i = 0; i < uint64_t{layout.num_kv_heads} * n; ++i) {
      if ((i % n) % 16 != 3) continue;
      for (uint32_t c = 0; c < d; ++c) {
        StoreFromFloat(s.v[l].data(), layout.dtype, i * d + c, outlier[c]);
      }
    }
  }
  auto proj = std::make_shared<Projection>(Calibrate(*b.cpu, layout, n));
  for (double raw_fraction : {0.01, 0.02, 0.25}) {
    SCOPED_TRACE(::testing::Message() << "raw fraction " << raw_fraction);
    CompressionPolicy p = Streaming(0.5);
    p.moments = true;
    p.key_codec = KeyCodec::kInt8;
    p.value_codec = ValueCodec::kOrthogonalInt8;
    p.rank = 32;
    p.value_raw_fraction = raw_fraction;
    CompressOptions o;
    o.projection = proj;
    auto want = Compress(*b.cpu, s.view(), p, o);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_FALSE(want->raw_value_rows.empty());
    auto got = Compress(*b.cuda, s.view(), p, o);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSameCache(*b.cpu, *want, *got, proj.get());
  }
}

TEST(PipelineDeviceTest, DeviceInputsCrossOnlyOnce) {
  Backends b;
  const KvLayout layout{2, 2, 4, 128, DType::kF16};
  const uint64_t n = 600;
  const Sequence s = MakeSequence(layout, n, 31);
  auto uploader = DeviceUploader::Create(0);
  ASSERT_TRUE(uploader.ok()) << uploader.status();
  auto kv = DeviceKv::Create(**uploader, layout, n);
  ASSERT_TRUE(kv.ok()) << kv.status();
  const KvCacheView host = s.view();
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    ASSERT_TRUE((*kv)->AddHost(l, false, 0, host.keys[l]).ok());
    ASSERT_TRUE((*kv)->AddHost(l, true, 0, host.values[l]).ok());
  }
  auto view = (*kv)->View(*b.cuda);
  ASSERT_TRUE(view.ok()) << view.status();
  auto proj = std::make_shared<Projection>(Calibrate(*b.cpu, layout, n));
  CompressionPolicy p = Streaming(0.5);
  p.moments = true;
  p.key_codec = KeyCodec::kInt8;
  p.value_codec = ValueCodec::kOrthogonalInt4;
  p.rank = 32;
  CompressOptions o;
  o.projection = proj;
  auto want = Compress(*b.cpu, host, p, o);
  ASSERT_TRUE(want.ok()) << want.status();
  TransferBytes t;
  o.transfers = &t;
  auto dc = CompressToDevice(*b.cuda, *view, p, o);
  ASSERT_TRUE(dc.ok()) << dc.status();
  EXPECT_EQ(t.to_device, 0u);
  EXPECT_EQ(t.to_host, layout.num_heads_total() * 4);
  EXPECT_EQ((*kv)->uploaded_bytes(), layout.CacheBytes(n));
  auto got = dc->Download(*b.cuda, &t);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(t.to_host, layout.num_heads_total() * 4 + ArrayBytes(*got));
  ExpectSameCache(*b.cpu, *want, *got, proj.get());
}

TEST(PipelineDeviceTest, MomentAwareRescoringMatchesTheCpu) {
  Backends b;
  for (DType dt : {DType::kBF16, DType::kF32}) {
    for (uint64_t n : {uint64_t{64}, uint64_t{700}, uint64_t{5000}}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " n=" << n);
      const KvLayout layout{2, 3, 6, 128, dt};
      const Sequence s = MakeSequence(layout, n, 41 + n);
      for (Scorer scorer : {Scorer::kStreaming, Scorer::kKnorm}) {
        CompressionPolicy p = Streaming(0.3);
        p.scorer = scorer;
        p.moment_aware = true;
        p.moments = true;
        auto want = Compress(*b.cpu, s.view(), p);
        ASSERT_TRUE(want.ok()) << want.status();
        TransferBytes t;
        CompressOptions o;
        o.transfers = &t;
        auto dc = CompressToDevice(*b.cuda, s.view(), p, o);
        ASSERT_TRUE(dc.ok()) << dc.status();
        EXPECT_EQ(t.to_host, layout.num_heads_total() * 4);
        EXPECT_EQ(t.to_device, layout.CacheBytes(n));
        auto got = dc->Download(*b.cuda);
        ASSERT_TRUE(got.ok()) << got.status();
        if (scorer == Scorer::kStreaming) {
          ExpectSameCache(*b.cpu, *want, *got, nullptr);
        } else {
          // knorm scores differ in the last bits between the backends; the rescoring ranks
          // them, so the kept sets agree but for a few tokens.
          ASSERT_EQ(want->positions.size(), got->positions.size());
          std::vector<uint32_t> a = want->positions, c = got->positions;
          uint64_t same = 0;
          const std::vector<uint64_t> off = want->TokenOffsets();
          for (uint64_t h = 0; h < want->num_heads(); ++h) {
            std::vector<uint32_t> x(a.begin() + off[h], a.begin() + off[h + 1]);
            std::vector<uint32_t> y(c.begin() + off[h], c.begin() + off[h + 1]);
            std::vector<uint32_t> both;
            std::set_intersection(x.begin(), x.end(), y.begin(), y.end(),
                                  std::back_inserter(both));
            same += both.size();
          }
          EXPECT_GE(same, a.size() - a.size() / 50 - 2);
        }
      }
    }
  }
}

// A put's K and V in a DeviceKv (every layer's keys, then every layer's values, with the keys'
// sums of each layer) are compressed as one view of layers x heads heads: the same cache, bit for
// bit, as the same backend compressing the host copy layer by layer, for every scorer a group
// takes (and AdaKV, which goes layer by layer), and the same error naming the same layer, head
// and token when several layers hold NaN.
TEST(PipelineDeviceTest, LayersOfADeviceKvAreCompressedTogether) {
  Backends b;
  const KvLayout layout{5, 4, 4, 128, DType::kBF16};
  for (uint64_t n : {uint64_t{300}, uint64_t{3000}}) {
    Sequence s = MakeSequence(layout, n, 51 + n);
    auto uploader = DeviceUploader::Create(0);
    ASSERT_TRUE(uploader.ok()) << uploader.status();
    auto fill = [&](const Sequence& seq) {
      auto kv = DeviceKv::Create(**uploader, layout, n);
      EXPECT_TRUE(kv.ok()) << kv.status();
      const KvCacheView host = seq.view();
      // Blocks of 700 tokens: the 256-token chunks of the keys' sums straddle them.
      for (uint64_t t0 = 0; t0 < n; t0 += 700) {
        const uint64_t t = std::min<uint64_t>(700, n - t0);
        for (uint32_t l = 0; l < layout.num_layers; ++l) {
          for (bool values : {false, true}) {
            HeadsView part = values ? host.values[l] : host.keys[l];
            part.data = static_cast<const uint8_t*>(part.data) +
                        part.offset(0, t0) * DTypeBytes(layout.dtype, 1);
            part.num_tokens = t;
            EXPECT_TRUE((*kv)->AddHost(l, values, t0, part).ok());
          }
        }
      }
      return std::move(*kv);
    };
    std::unique_ptr<DeviceKv> kv = fill(s);
    auto view = kv->View(*b.cuda);
    ASSERT_TRUE(view.ok()) << view.status();
    ASSERT_EQ(view->key_sums.size(), layout.num_layers);
    for (Scorer scorer : {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold,
                          Scorer::kWindowedManifold, Scorer::kStreaming}) {
      for (HeadBudget budget : {HeadBudget::kUniform, HeadBudget::kAdaKV}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " " << ScorerName(scorer)
                                          << (budget == HeadBudget::kAdaKV ? " adakv" : ""));
        CompressionPolicy p = Streaming(0.5);
        p.scorer = scorer;
        p.window = 512;
        p.head_budget = budget;
        p.moments = true;
        auto want = Compress(*b.cuda, s.view(), p);  // staged layer by layer
        ASSERT_TRUE(want.ok()) << want.status();
        auto got = Compress(*b.cuda, *view, p);
        ASSERT_TRUE(got.ok()) << got.status();
        ExpectSameCache(*b.cpu, *want, *got, nullptr);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
    // The moment-aware rescoring over a group of layers: every head ranked on its own, so the
    // same cache as layer by layer.
    for (Scorer scorer : {Scorer::kManifold, Scorer::kStreaming}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " moment-aware " << ScorerName(scorer));
      CompressionPolicy p = Streaming(0.5);
      p.scorer = scorer;
      p.moments = true;
      p.moment_aware = true;
      auto want = Compress(*b.cuda, s.view(), p);
      ASSERT_TRUE(want.ok()) << want.status();
      auto got = Compress(*b.cuda, *view, p);
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectSameCache(*b.cpu, *want, *got, nullptr);
      if (::testing::Test::HasFatalFailure()) return;
    }
    // NaN in a key of layer 3 and in a value of layer 1: layer 1's value is reported.
    StoreFromFloat(s.k[3].data(), layout.dtype, (2 * n + n / 2) * layout.head_dim + 7, NAN);
    StoreFromFloat(s.v[1].data(), layout.dtype, (1 * n + n / 3) * layout.head_dim + 3, NAN);
    std::unique_ptr<DeviceKv> bad = fill(s);
    auto bad_view = bad->View(*b.cuda);
    ASSERT_TRUE(bad_view.ok()) << bad_view.status();
    CompressionPolicy p = Streaming(0.5);
    p.scorer = Scorer::kManifold;
    p.moments = true;
    auto per_layer = Compress(*b.cuda, s.view(), p);
    auto grouped = Compress(*b.cuda, *bad_view, p);
    EXPECT_EQ(per_layer.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(grouped.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(per_layer.status().message(), grouped.status().message());
    EXPECT_NE(grouped.status().message().find("layer 1"), absl::string_view::npos)
        << grouped.status();
    p.moment_aware = true;
    auto aware_per_layer = Compress(*b.cuda, s.view(), p);
    auto aware_grouped = Compress(*b.cuda, *bad_view, p);
    EXPECT_EQ(aware_grouped.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(aware_per_layer.status().message(), aware_grouped.status().message());
    EXPECT_NE(aware_grouped.status().message().find("layer 1"), absl::string_view::npos)
        << aware_grouped.status();
  }
}

TEST(PipelineDeviceTest, HostBackendIsRefused) {
  Backends b;
  const Sequence s = MakeSequence({1, 1, 1, 64, DType::kF32}, 50, 3);
  auto dc = CompressToDevice(*b.cpu, s.view(), Streaming(0.5));
  EXPECT_EQ(dc.status().code(), absl::StatusCode::kFailedPrecondition);
}

// The model's pq calibration fitted on the first layer's rows of `s`, repeated for every layer
// (the shape is what matters here), at key_bits / value_bits.
std::shared_ptr<const pq::Calibration> PqCalibration(const Sequence& s, uint32_t key_bits,
                                                     uint32_t value_bits) {
  const KvLayout& layout = s.layout;
  const uint64_t per_layer = uint64_t{layout.num_kv_heads} * s.tokens * layout.head_dim;
  std::vector<float> k32, v32;  // [heads][tokens][d] f32
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    for (uint64_t i = 0; i < per_layer; ++i) {
      k32.push_back(LoadAsFloat(s.k[l].data(), layout.dtype, i));
      v32.push_back(LoadAsFloat(s.v[l].data(), layout.dtype, i));
    }
  }
  auto cal = pq::FitCalibration(k32, v32, s.tokens, layout.num_layers, layout.num_kv_heads,
                                layout.head_dim, key_bits, value_bits);
  EXPECT_TRUE(cal.ok()) << cal.status();
  return cal.ok() ? std::make_shared<const pq::Calibration>(*std::move(cal)) : nullptr;
}

// The calibrated basis codec on the device: CompressToDevice (and Compress) on the CUDA backend
// writes the CPU's records byte for byte, with eviction and without, beside the other codecs,
// from f32, f16 and bf16 rows; the caches decode on the device (DecodeKept, DecodeKeptInto device
// memory) to the CPU's values bit for bit. (Block-wise compression runs on the CPU backend only,
// whatever the codec.)
TEST(PipelineDeviceTest, ThePqCodecMatchesTheCpu) {
  Backends b;
  struct Codecs {
    KeyCodec key;
    ValueCodec value;
  };
  const Codecs codecs[] = {{KeyCodec::kPq, ValueCodec::kPq},
                           {KeyCodec::kHq4, ValueCodec::kPq},
                           {KeyCodec::kPq, ValueCodec::kRaw},
                           {KeyCodec::kFp16, ValueCodec::kPq}};
  uint64_t seed = 40;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (uint32_t d : {64u, 128u}) {
      const KvLayout layout{2, 3, 6, d, dt};
      const Sequence s = MakeSequence(layout, 300 + 37 * d / 64, ++seed);
      for (uint32_t kb : {3u, 2u}) {
        const auto cal = PqCalibration(s, kb, kb == 3 ? 2 : 4);
        ASSERT_NE(cal, nullptr);
        for (const Codecs& c : codecs) {
          for (double ratio : {0.0, 0.6}) {
            SCOPED_TRACE(::testing::Message()
                         << DTypeName(dt) << " d=" << d << " key_bits=" << kb << " "
                         << KeyCodecName(c.key) << "/" << ValueCodecName(c.value)
                         << " ratio=" << ratio);
            CompressionPolicy p = Streaming(ratio);
            p.key_codec = c.key;
            p.value_codec = c.value;
            p.key_bits = cal->key_bits();
            p.value_bits = cal->value_bits();
            CompressOptions o;
            o.pq = cal;
            auto want = Compress(*b.cpu, s.view(), p, o);
            ASSERT_TRUE(want.ok()) << want.status();
            auto dc = CompressToDevice(*b.cuda, s.view(), p, o);
            ASSERT_TRUE(dc.ok()) << dc.status();
            ExpectExactBuffers(*dc);
            auto got = dc->Download(*b.cuda);
            ASSERT_TRUE(got.ok()) << got.status();
            ExpectSameCache(*b.cpu, *want, *got, nullptr, cal.get());
            EXPECT_EQ(want->pq_key_basis, got->pq_key_basis);
            EXPECT_EQ(want->pq_value_basis, got->pq_value_basis);
            EXPECT_EQ(want->pq_key_bits, got->pq_key_bits);
            EXPECT_EQ(want->pq_value_bits, got->pq_value_bits);
            auto host = Compress(*b.cuda, s.view(), p, o);  // device encode, then download
            ASSERT_TRUE(host.ok()) << host.status();
            EXPECT_TRUE(host->keys == want->keys && host->values == want->values);

            for (DType out : {DType::kF32, DType::kBF16, DType::kF16}) {
              auto dw = DecodeKept(*b.cpu, *want, nullptr, out, cal.get());
              auto dg = DecodeKept(*b.cuda, *want, nullptr, out, cal.get());
              ASSERT_TRUE(dw.ok()) << dw.status();
              ASSERT_TRUE(dg.ok()) << dg.status();
              EXPECT_TRUE(dw->keys == dg->keys) << "decoded keys differ " << DTypeName(out);
              EXPECT_TRUE(dw->values == dg->values) << "decoded values differ " << DTypeName(out);
              // Into device memory.
              const uint64_t bytes = dw->keys.size();
              if (bytes == 0) continue;
              auto kbuf = Buffer::Allocate(b.cuda->allocator(), bytes);
              auto vbuf = Buffer::Allocate(b.cuda->allocator(), bytes);
              ASSERT_TRUE(kbuf.ok() && vbuf.ok());
              ASSERT_TRUE(DecodeKeptInto(*b.cuda, *want, nullptr, out, kbuf->data(),
                                         vbuf->data(), cal.get())
                              .ok());
              std::vector<uint8_t> kh(bytes), vh(bytes);
              ASSERT_TRUE(b.cuda->CopyToHost(kh.data(), kbuf->data(), bytes).ok());
              ASSERT_TRUE(b.cuda->CopyToHost(vh.data(), vbuf->data(), bytes).ok());
              EXPECT_TRUE(kh == dw->keys && vh == dw->values) << "DecodeKeptInto differs";
            }
          }
        }
      }
    }
  }
}

// Without a calibration, or with one at other bits, a device backend refuses the pq codecs as
// the CPU does (FailedPrecondition naming the call), before any kernel runs.
TEST(PipelineDeviceTest, ThePqCodecNeedsItsCalibrationOnTheDevice) {
  Backends b;
  const KvLayout layout{1, 2, 2, 64, DType::kF32};
  const Sequence s = MakeSequence(layout, 96, 11);
  const auto cal = PqCalibration(s, 3, 2);
  CompressionPolicy p = Streaming(0.0);
  p.key_codec = KeyCodec::kPq;
  p.value_codec = ValueCodec::kPq;
  CompressOptions none;
  for (Backend* be : {b.cpu.get(), b.cuda.get()}) {
    auto st = CompressToDevice(*b.cuda, s.view(), p, none).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_EQ(Compress(*be, s.view(), p, none).status().code(),
              absl::StatusCode::kFailedPrecondition);
    CompressOptions o;
    o.pq = cal;
    CompressionPolicy other = p;
    other.key_bits = 4;
    EXPECT_EQ(Compress(*be, s.view(), other, o).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace kvcomp
