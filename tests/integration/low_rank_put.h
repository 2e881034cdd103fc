// A whole-cache put of values near a fixed rank-8 subspace, for the daemon integration tests that
// calibrate KVSplice projections: every cache and head shares the same 8 directions (so a
// calibrated rank-32 projection reconstructs them closely), values carry 1% noise, keys are
// random. One block per layer, f16.
#ifndef KVCOMP_TESTS_INTEGRATION_LOW_RANK_PUT_H_
#define KVCOMP_TESTS_INTEGRATION_LOW_RANK_PUT_H_

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "absl/status/statusor.h"
#include "block_put.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/client.h"

namespace kvcomp {
namespace testing {

// Puts `begin` (layout f16) over `c`: its values to `sent_values` when given (as sent, in block
// order); `midway` runs after the first layer's block.
inline absl::StatusOr<transport::wire::CacheSummary> PutLowRankCache(
    transport::UcxClient& c, const transport::wire::PutBegin& begin, uint64_t seed,
    std::vector<float>* sent_values = nullptr, const std::function<void()>& midway = nullptr) {
  KVCOMP_ASSIGN_OR_RETURN(uint64_t id, c.PutBegin(begin));
  const KvLayout& layout = begin.layout;
  const uint32_t D = layout.head_dim;
  const uint64_t tokens = begin.num_tokens;
  std::mt19937_64 basis_rng(42), rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> basis(8 * D);
  for (auto& x : basis) x = n(basis_rng);
  const size_t count = uint64_t{layout.num_kv_heads} * tokens * D;
  std::vector<uint16_t> k(count), v(count);
  if (sent_values != nullptr) sent_values->clear();
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    for (size_t row = 0; row < count / D; ++row) {
      float coef[8];
      for (float& cf : coef) cf = n(rng);
      for (uint32_t j = 0; j < D; ++j) {
        float x = 0.01f * n(rng);
        for (int r = 0; r < 8; ++r) x += coef[r] * basis[r * D + j];
        v[row * D + j] = FloatToHalf(x);
        k[row * D + j] = FloatToHalf(n(rng));
        if (sent_values != nullptr) sent_values->push_back(HalfToFloat(v[row * D + j]));
      }
    }
    KVCOMP_RETURN_IF_ERROR(
        c.SendBlock(LayersBlock(id, layout, tokens, l, l + 1), k.data(), v.data()));
    if (l == 0 && midway) midway();
  }
  return c.PutCommit(id, layout.num_layers);
}

}  // namespace testing
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_INTEGRATION_LOW_RANK_PUT_H_
