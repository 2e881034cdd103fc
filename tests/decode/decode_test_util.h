// Compressed caches for the decode tests, made by the real engine on the CPU backend: low-rank
// values and random keys, compressed (manifold, moments), a projection calibrated on the same
// values with different tuned ranks per layer, and the KVSplice encoding of the cache (int8
// keys, int8 latents, outliers kept raw). Plus a float64 reference of corrected attention over a
// cache with raw kept keys and values.
#ifndef KVCOMP_TESTS_DECODE_DECODE_TEST_UTIL_H_
#define KVCOMP_TESTS_DECODE_DECODE_TEST_UTIL_H_

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/codec_test_util.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/calibration.h"
#include "kvcomp/kernels/kvsplice.h"
#include "kvcomp/kernels/pipeline.h"

namespace kvcomp {
namespace testing {

struct DecodeCaches {
  CompressedCache raw;      // raw kept keys and values, moments
  CompressedCache encoded;  // the same, KVSplice-encoded
  std::shared_ptr<const Projection> projection;
};

inline DecodeCaches MakeDecodeCaches(Backend& cpu, uint32_t d, uint32_t tokens,
                                     uint32_t q_per_kv = 4) {
  LowRankData data;
  data.layers = 2;
  data.heads = 2;
  data.tokens = tokens;
  data.d = d;
  data.true_rank = 24;
  const std::vector<float> values = data.Make(11), keys = data.Make(12);
  const KvLayout layout{data.layers, data.heads, data.heads * q_per_kv, d, DType::kBF16};
  const uint64_t per_layer = uint64_t{data.heads} * tokens * d;
  std::vector<uint16_t> k16(values.size()), v16(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    StoreFromFloat(k16.data(), DType::kBF16, i, keys[i]);
    StoreFromFloat(v16.data(), DType::kBF16, i, values[i]);
  }
  // Every fifth value row of head 0 of each layer gets a large component off the low-rank basis,
  // so the encoder keeps some rows raw.
  std::mt19937_64 rng(5);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (uint32_t l = 0; l < data.layers; ++l) {
    for (uint32_t t = 0; t < tokens; t += 5) {
      for (uint32_t x = 0; x < d; ++x) {
        const uint64_t i = l * per_layer + uint64_t{t} * d + x;
        StoreFromFloat(v16.data(), DType::kBF16, i,
                       LoadAsFloat(v16.data(), DType::kBF16, i) + 2.0f * n(rng));
      }
    }
  }
  KvCacheView view;
  view.layout = layout;
  view.num_tokens = tokens;
  for (uint32_t l = 0; l < data.layers; ++l) {
    view.keys.push_back(
        HeadsView::Dense(k16.data() + l * per_layer, DType::kBF16, data.heads, tokens, d));
    view.values.push_back(
        HeadsView::Dense(v16.data() + l * per_layer, DType::kBF16, data.heads, tokens, d));
  }
  CompressionPolicy policy;
  policy.scorer = Scorer::kManifold;
  policy.ratio = 0.5;
  policy.moments = true;
  DecodeCaches out;
  auto raw = Compress(cpu, view, policy);
  EXPECT_TRUE(raw.ok()) << raw.status();
  out.raw = std::move(*raw);

  auto cal = Calibrator::Create({"m", data.layers, data.heads, d, 0, 0, 0}, &cpu);
  EXPECT_TRUE(cal.ok()) << cal.status();
  for (uint32_t l = 0; l < data.layers; ++l) {
    EXPECT_TRUE(cal->AddLayer(l, data.LayerView(values, l)).ok());
  }
  auto proj = cal->Finish(d / 2);
  EXPECT_TRUE(proj.ok()) << proj.status();
  proj->tuned_rank = {16, 24};  // per-layer ranks: the latents are ragged by layer
  proj->tuned_error = {0.1, 0.1};
  EXPECT_TRUE(proj->Seal().ok());
  out.projection = std::make_shared<const Projection>(std::move(*proj));

  CompressionPolicy enc = policy;
  enc.key_codec = KeyCodec::kInt8;
  enc.value_codec = ValueCodec::kOrthogonalInt8;
  enc.value_raw_fraction = 0.1;
  out.encoded = out.raw;
  out.encoded.policy = enc;
  const absl::Status st = EncodeKept(cpu, enc, out.projection.get(), &out.encoded);
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

// Queries [q_heads, nq, d] of f32 with a fixed seed.
inline std::vector<float> RandomQueries(uint32_t q_heads, uint32_t nq, uint32_t d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> q(uint64_t{q_heads} * nq * d);
  for (auto& x : q) x = n(rng);
  return q;
}

// Float64 corrected attention over `layer` of a cache with raw kept keys and values, out
// [q_heads][nq][d].
inline std::vector<double> ReferenceAttention(const CompressedCache& c, uint32_t layer,
                                              const std::vector<float>& q, uint32_t q_heads,
                                              uint32_t nq, bool correct) {
  const uint32_t hk = c.layout.num_kv_heads, d = c.layout.head_dim, group = q_heads / hk;
  const std::vector<uint64_t> off = c.TokenOffsets();
  const double t = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> out(uint64_t{q_heads} * nq * d, 0.0);
  for (uint32_t g = 0; g < q_heads; ++g) {
    const uint64_t h = c.head_index(layer, g / group);
    for (uint32_t i = 0; i < nq; ++i) {
      const float* qq = &q[(uint64_t{g} * nq + i) * d];
      std::vector<double> logits;
      std::vector<std::vector<double>> vals;
      for (uint64_t r = off[h]; r < off[h + 1]; ++r) {
        double s = 0;
        std::vector<double> v(d);
        for (uint32_t x = 0; x < d; ++x) {
          s += double{qq[x]} * LoadAsFloat(c.keys.data(), c.layout.dtype, r * d + x);
          v[x] = LoadAsFloat(c.values.data(), c.layout.dtype, r * d + x);
        }
        logits.push_back(t * s);
        vals.push_back(std::move(v));
      }
      const uint64_t n = c.has_moments ? c.moment_count[h] : 0;
      if (correct && n > 0) {
        const double nn = static_cast<double>(n);
        std::vector<double> mk(d), mv(d), v(d);
        double s = 0;
        for (uint32_t x = 0; x < d; ++x) {
          mk[x] = c.moment_key_sum[h * d + x] / nn;
          mv[x] = c.moment_value_sum[h * d + x] / nn;
          s += qq[x] * mk[x];
        }
        for (uint32_t a = 0; a < d; ++a) {
          double cq = 0;
          for (uint32_t b = 0; b < d; ++b) {
            const double cab = c.moment_vk_sum[(h * d + a) * d + b] / nn - mv[a] * mk[b];
            cq += cab * qq[b];
          }
          v[a] = mv[a] + t * cq;
        }
        logits.push_back(t * s + std::log(nn));
        vals.push_back(std::move(v));
      }
      if (logits.empty()) continue;
      double mx = logits[0], z = 0;
      for (double l : logits) mx = std::max(mx, l);
      double* o = &out[(uint64_t{g} * nq + i) * d];
      for (size_t j = 0; j < logits.size(); ++j) {
        const double w = std::exp(logits[j] - mx);
        z += w;
        for (uint32_t x = 0; x < d; ++x) o[x] += w * vals[j][x];
      }
      for (uint32_t x = 0; x < d; ++x) o[x] /= z;
    }
  }
  return out;
}

// A cache like `c` with its keys and values decoded to raw layout.dtype rows.
inline CompressedCache DecodedCopy(Backend& cpu, const CompressedCache& c,
                                   const Projection* projection) {
  auto dec = DecodeKept(cpu, c, projection, c.layout.dtype);
  EXPECT_TRUE(dec.ok()) << dec.status();
  CompressedCache out = c;
  out.key_codec = KeyCodec::kRaw;
  out.value_codec = ValueCodec::kRaw;
  out.rank = 0;
  out.layer_rank.clear();
  out.projection_version = 0;
  out.value_gamma = false;
  out.key_scales.clear();
  out.value_scales.clear();
  out.raw_value_rows.clear();
  out.raw_values.clear();
  out.keys = dec->keys;
  out.values = dec->values;
  EXPECT_TRUE(out.Validate().ok()) << out.Validate();
  return out;
}

}  // namespace testing
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_DECODE_DECODE_TEST_UTIL_H_
