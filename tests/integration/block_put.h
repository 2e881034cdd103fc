// Puts over the data plane as the daemon integration tests send them: the PutBegin of a cache,
// a block holding whole layers, and a whole put of normal(0, 1) K and V sent one block per layer.
#ifndef KVCOMP_TESTS_INTEGRATION_BLOCK_PUT_H_
#define KVCOMP_TESTS_INTEGRATION_BLOCK_PUT_H_

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/client.h"

namespace kvcomp {
namespace testing {

// The PutBegin of `tokens` tokens of `layout` under `model` and `key` (the tenant's default
// policy).
inline transport::wire::PutBegin MakePutBegin(const KvLayout& layout, uint64_t tokens,
                                              const std::string& model, const std::string& key) {
  transport::wire::PutBegin begin;
  begin.layout = layout;
  begin.num_tokens = tokens;
  begin.model_id = model;
  begin.key = key;
  return begin;
}

// Keys and values of the whole of layers [layer_begin, layer_end) of put `put_id` (every token of
// `tokens`), as one block.
inline transport::wire::Block LayersBlock(uint64_t put_id, const KvLayout& layout, uint64_t tokens,
                                          uint32_t layer_begin, uint32_t layer_end) {
  transport::wire::Block b;
  b.put_id = put_id;
  b.layer_begin = layer_begin;
  b.layer_end = layer_end;
  b.token_begin = 0;
  b.token_end = tokens;
  b.parts = transport::wire::kPartBoth;
  b.key_bytes = b.value_bytes = uint64_t{layer_end - layer_begin} * layout.LayerBytes(tokens);
  return b;
}

// Puts `begin` (an f16 layout) over `c`, one block per layer, keys and values drawn from
// normal(0, 1) with `seed` (each layer's keys and values in turn, element by element). `edit`,
// when given, may change a layer's K and V ([kv_head][token][head_dim] f16) before they are
// sent. Returns what the daemon stored.
inline absl::StatusOr<transport::wire::CacheSummary> PutRandomF16(
    transport::UcxClient& c, const transport::wire::PutBegin& begin, uint64_t seed,
    const std::function<void(uint32_t layer, std::vector<uint16_t>& k, std::vector<uint16_t>& v)>&
        edit = nullptr) {
  KVCOMP_ASSIGN_OR_RETURN(uint64_t id, c.PutBegin(begin));
  const KvLayout& layout = begin.layout;
  const uint64_t tokens = begin.num_tokens;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const size_t count = uint64_t{layout.num_kv_heads} * tokens * layout.head_dim;
  std::vector<uint16_t> k(count), v(count);
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    for (size_t i = 0; i < count; ++i) {
      k[i] = FloatToHalf(n(rng));
      v[i] = FloatToHalf(n(rng));
    }
    if (edit) edit(l, k, v);
    KVCOMP_RETURN_IF_ERROR(
        c.SendBlock(LayersBlock(id, layout, tokens, l, l + 1), k.data(), v.data()));
  }
  return c.PutCommit(id, layout.num_layers);
}

}  // namespace testing
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_INTEGRATION_BLOCK_PUT_H_
