// Views of K, V and other per-head arrays as the engine's operations see them. Views never own
// memory; the caller keeps the buffer alive for the call. `space` says whose memory it is: a
// host pointer given to a CUDA op (or the reverse) is InvalidArgument, never a crash.
#ifndef KVCOMP_KERNELS_TENSOR_H_
#define KVCOMP_KERNELS_TENSOR_H_

#include <cstddef>
#include <cstdint>

#include "kvcomp/core/dtype.h"

namespace kvcomp {

enum class MemorySpace : uint8_t {
  kHost = 0,
  kDevice = 1,  // CUDA device memory of the backend's device
};

// One layer's keys or values: [num_heads, num_tokens, head_dim], dense along head_dim, tokens
// `token_stride` elements apart and heads `head_stride` elements apart (a dense tensor has
// token_stride == head_dim and head_stride == num_tokens * head_dim).
struct HeadsView {
  const void* data = nullptr;
  DType dtype = DType::kBF16;
  uint32_t num_heads = 0;
  uint64_t num_tokens = 0;
  uint32_t head_dim = 0;
  uint64_t token_stride = 0;  // elements
  uint64_t head_stride = 0;   // elements
  MemorySpace space = MemorySpace::kHost;

  static HeadsView Dense(const void* data, DType dtype, uint32_t heads, uint64_t tokens,
                         uint32_t head_dim, MemorySpace space = MemorySpace::kHost) {
    return HeadsView{data, dtype, heads, tokens, head_dim, head_dim,
                     tokens * head_dim, space};
  }
  // Element offset of (head, token, 0).
  uint64_t offset(uint32_t head, uint64_t token) const {
    return uint64_t{head} * head_stride + token * token_stride;
  }
};

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_TENSOR_H_
