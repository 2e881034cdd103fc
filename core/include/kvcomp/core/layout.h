// The shape of one sequence's KV cache: for every layer, keys and values of shape
// [num_kv_heads, num_tokens, head_dim] in `dtype`; num_q_heads query heads share the kv heads
// (grouped-query attention). num_tokens is per sequence, not part of the layout.
#ifndef KVCOMP_CORE_LAYOUT_H_
#define KVCOMP_CORE_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "kvcomp/core/dtype.h"

namespace kvcomp {

struct KvLayout {
  // Limits enforced by Validate(); the format and protocol reject anything beyond them.
  static constexpr uint32_t kMaxLayers = 1024;
  static constexpr uint32_t kMaxKvHeads = 256;
  static constexpr uint32_t kMaxQHeads = 4096;
  static constexpr uint64_t kMaxTokens = uint64_t{1} << 31;

  uint32_t num_layers = 0;    // transformer layers, 1..kMaxLayers
  uint32_t num_kv_heads = 0;  // key/value heads per layer, 1..kMaxKvHeads
  uint32_t num_q_heads = 0;   // query heads per layer, a multiple of num_kv_heads
  uint32_t head_dim = 0;      // 64, 128 or 256
  DType dtype = DType::kBF16;  // f32, f16 or bf16

  // OK, or InvalidArgument naming the first field out of range.
  absl::Status Validate() const;

  uint32_t group_size() const { return num_q_heads / num_kv_heads; }  // q heads per kv head
  uint64_t num_heads_total() const { return uint64_t{num_layers} * num_kv_heads; }
  // Bytes of K (or V) for one layer of `tokens` tokens.
  uint64_t LayerBytes(uint64_t tokens) const {
    return DTypeBytes(dtype, uint64_t{num_kv_heads} * tokens * head_dim);
  }
  // Bytes of K plus V over all layers for `tokens` tokens: the uncompressed size.
  uint64_t CacheBytes(uint64_t tokens) const { return 2 * num_layers * LayerBytes(tokens); }

  std::string DebugString() const;
  friend bool operator==(const KvLayout& a, const KvLayout& b) {
    return a.num_layers == b.num_layers && a.num_kv_heads == b.num_kv_heads &&
           a.num_q_heads == b.num_q_heads && a.head_dim == b.head_dim && a.dtype == b.dtype;
  }
  friend bool operator!=(const KvLayout& a, const KvLayout& b) { return !(a == b); }
};

// True for the head dimensions the kernels are built for (64, 128, 256).
bool IsSupportedHeadDim(uint32_t head_dim);

}  // namespace kvcomp

#endif  // KVCOMP_CORE_LAYOUT_H_
