// How the CUDA selection in shared memory (BlockSelectKernel, scoring_kernels.cuh) splits a
// head, host code: one block per head up to kShortSelectMaxTokens tokens by default, else one
// thread-block cluster of up to kClusterMaxBlocks blocks per head, each holding a slice of the
// head's keys in shared memory.
#ifndef KVCOMP_KERNELS_SRC_CUDA_SELECT_PLAN_H_
#define KVCOMP_KERNELS_SRC_CUDA_SELECT_PLAN_H_

#include <algorithm>
#include <cstdint>

namespace kvcomp {
namespace cuda {

inline constexpr uint64_t kShortSelectCapacity = 32768;   // one block: 128 KiB of keys
inline constexpr uint64_t kShortSelectMaxTokens = 8192;   // the default longest one-block head
inline constexpr uint32_t kClusterMaxBlocks = 8;          // the portable cluster size
inline constexpr uint64_t kClusterSliceCapacity = 40960;  // tokens per block (160 KiB of keys)
inline constexpr uint64_t kClusterMinSlice = 1024;        // fewer blocks below this many each

// Blocks per head of the cluster form for `heads` heads of n tokens on `sms` SMs: the fewest (a
// power of two up to kClusterMaxBlocks) that leave at most kClusterMinSlice tokens to a block, or
// the most, halved while the grid exceeds two blocks per SM (many short heads: one block each
// has work enough); 0 when a slice would exceed kClusterSliceCapacity (the tiled path then).
inline uint32_t ClusterBlocks(uint64_t n, uint64_t heads, int sms) {
  auto slice_of = [n](uint64_t blocks) { return (n + blocks - 1) / blocks; };
  uint32_t blocks = 1;
  while (blocks < kClusterMaxBlocks && slice_of(blocks) > kClusterMinSlice) blocks *= 2;
  while (blocks > 1 && heads * blocks > 2 * static_cast<uint64_t>(std::max(sms, 1)) &&
         slice_of(blocks / 2) <= kClusterSliceCapacity) {
    blocks /= 2;
  }
  return slice_of(blocks) <= kClusterSliceCapacity ? blocks : 0;
}

// Tokens per block of a cluster of `blocks` over n tokens: ceil(n / blocks) rounded up to a
// multiple of 4 (whole 16-byte score loads); at most kClusterSliceCapacity when ClusterBlocks
// gave `blocks`.
inline uint64_t ClusterSlice(uint64_t n, uint32_t blocks) {
  return ((n + blocks - 1) / blocks + 3) / 4 * 4;
}

}  // namespace cuda
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_SELECT_PLAN_H_
