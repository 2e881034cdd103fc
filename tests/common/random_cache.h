// Builds random, valid CompressedCache values for tests: ragged kept counts, every codec, with
// or without moments. Never zeros: every byte comes from the seeded generator.
#ifndef KVCOMP_TESTS_COMMON_RANDOM_CACHE_H_
#define KVCOMP_TESTS_COMMON_RANDOM_CACHE_H_

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/core/dtype.h"

namespace kvcomp {
namespace testing {

struct RandomCacheOptions {
  KvLayout layout{2, 2, 4, 64, DType::kBF16};
  uint64_t original_tokens = 37;
  KeyCodec key_codec = KeyCodec::kRaw;
  ValueCodec value_codec = ValueCodec::kRaw;
  uint32_t rank = 0;
  // Per-layer ranks (one per layer, the largest replaces `rank`); empty: every layer at `rank`.
  std::vector<uint32_t> layer_rank;
  uint32_t group_size = 32;
  bool moments = true;
  // KVSplice outlier rows kept raw (encoded values only): how many (at most the kept tokens).
  uint64_t raw_value_rows = 0;
};

inline CompressedCache RandomCache(const RandomCacheOptions& o, uint64_t seed) {
  std::mt19937_64 rng(seed);
  CompressedCache c;
  c.key_codec = o.key_codec;
  c.value_codec = o.value_codec;
  c.rank = o.value_codec == ValueCodec::kRaw ? 0 : o.rank;
  if (!o.layer_rank.empty()) c.rank = *std::max_element(o.layer_rank.begin(), o.layer_rank.end());
  c.group_size = o.group_size;
  c.projection_version = o.value_codec == ValueCodec::kRaw ? 0 : 1 + rng() % 1000;
  c.has_moments = o.moments;
  c.policy.key_codec = o.key_codec;
  c.policy.value_codec = o.value_codec;
  c.policy.rank = c.rank;
  c.policy.ratio = 0.25 + 0.5 * static_cast<double>(rng() % 1000) / 1000.0;
  c.Reset(o.layout, o.original_tokens);
  c.layer_rank = o.layer_rank;
  const uint64_t h = c.num_heads();
  std::vector<uint32_t> all(o.original_tokens);
  std::iota(all.begin(), all.end(), 0u);
  for (uint64_t i = 0; i < h; ++i) {
    const uint32_t k = static_cast<uint32_t>(rng() % (o.original_tokens + 1));
    c.kept[i] = k;
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<uint32_t> pick(all.begin(), all.begin() + k);
    std::sort(pick.begin(), pick.end());
    c.positions.insert(c.positions.end(), pick.begin(), pick.end());
  }
  const uint64_t t = c.total_kept();
  auto fill_bytes = [&](std::vector<uint8_t>* v, uint64_t n) {
    v->resize(n);
    for (auto& b : *v) b = static_cast<uint8_t>(rng());
  };
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  fill_bytes(&c.keys, t * c.KeyTokenBytes());
  fill_bytes(&c.values, c.ValueBytes());
  c.key_scales.resize(c.KeyScaleCount());  // int4: one group of scales per 128 kept tokens
  for (auto& s : c.key_scales) s = u(rng);
  c.value_scales.resize(c.ValueScaleCount());
  for (auto& s : c.value_scales) s = FloatToHalf(u(rng));
  if (o.raw_value_rows > 0 && t > 0) {
    std::vector<uint64_t> rows(t);
    std::iota(rows.begin(), rows.end(), uint64_t{0});
    std::shuffle(rows.begin(), rows.end(), rng);
    rows.resize(std::min<uint64_t>(o.raw_value_rows, t));
    std::sort(rows.begin(), rows.end());
    c.raw_value_rows = rows;
    fill_bytes(&c.raw_values, rows.size() * DTypeBytes(c.layout.dtype, c.layout.head_dim));
  }
  if (o.moments) {
    for (uint64_t i = 0; i < h; ++i) c.moment_count[i] = o.original_tokens - c.kept[i];
    for (auto& x : c.moment_key_sum) x = u(rng);
    for (auto& x : c.moment_value_sum) x = u(rng);
    for (auto& x : c.moment_vk_sum) x = u(rng);
  }
  return c;
}

}  // namespace testing
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_COMMON_RANDOM_CACHE_H_
