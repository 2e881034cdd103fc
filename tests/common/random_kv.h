// Dense random K and V for tests that put caches through the SDK: per layer one
// [kv_heads, tokens, head_dim] f16 array of keys and one of values, normal(0, 1) draws.
#ifndef KVCOMP_TESTS_COMMON_RANDOM_KV_H_
#define KVCOMP_TESTS_COMMON_RANDOM_KV_H_

#include <cstdint>
#include <random>
#include <vector>

#include "kvcomp/core/dtype.h"
#include "kvcomp/core/layout.h"

namespace kvcomp {
namespace testing {

// Fills `k` and `v` with one array per layer of `layout` for `tokens` tokens, drawn from a
// std::mt19937 seeded with `seed` (a layer's keys, then its values, layer by layer).
inline void RandomLayersF16(const KvLayout& layout, uint64_t tokens, uint32_t seed,
                            std::vector<std::vector<uint16_t>>* k,
                            std::vector<std::vector<uint16_t>>* v) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01;
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    k->emplace_back(layout.num_kv_heads * tokens * layout.head_dim);
    v->emplace_back(k->back().size());
    for (auto& x : k->back()) x = FloatToHalf(n01(rng));
    for (auto& x : v->back()) x = FloatToHalf(n01(rng));
  }
}

}  // namespace testing
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_COMMON_RANDOM_KV_H_
