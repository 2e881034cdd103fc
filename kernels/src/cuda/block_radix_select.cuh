// Radix select by one block, shared by the kernels that pick a head's k-th key in one block
// (moment-aware rescoring's provisional eviction, moments_aware.cu; KVSplice's outlier rows,
// codec_device.cu): 8 bits a pass, four passes over the keys, which stay in L2 or shared memory.
#ifndef KVCOMP_KERNELS_SRC_CUDA_BLOCK_RADIX_SELECT_CUH_
#define KVCOMP_KERNELS_SRC_CUDA_BLOCK_RADIX_SELECT_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace kvcomp {
namespace block_select {

// x's place in the order of the radix sorts (CUB's float keys): -0 below +0, NaN at the ends.
// For the non-NaN values the callers pass (-0 taken as +0 where it matters) it is the order of
// the values.
__device__ __forceinline__ uint32_t FloatOrderKey(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

// The block's shared state: the histogram of a pass, the selected digit and the rank left in
// it, plus a word per warp and a counter for the callers' own block-wide counts.
template <unsigned kWarps>
struct RadixSelectShared {
  uint32_t hist[256];
  uint32_t warp[kWarps];
  uint32_t digit, rank, count;
};

// The key of rank `k` (0-based, ascending) among key_of(0 .. n), k < n: radix select, 8 bits a
// pass from the top, every thread of the block calling it. Index is the type of n, k and the
// token index key_of takes. Whole warps a step (the lanes past n take part without a key):
// lanes with the same digit add their count once (keys of one head share their top bits, so one
// shared counter would otherwise take most of the warp's adds).
// kMatch = false: instead of matching every lane's digit, the lanes whose digit is the first
// counted lane's add their count once (the common digit of a pass's top bits) and the others add
// one each (the digits below the top differ among the few keys still counted).
template <typename Index, unsigned kWarps, typename Key, bool kMatch = true>
__device__ uint32_t BlockRadixSelect(Index n, Index k, RadixSelectShared<kWarps>& sh,
                                     Key key_of) {
  uint32_t prefix = 0, mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (uint32_t i = threadIdx.x; i < 256; i += blockDim.x) sh.hist[i] = 0;
    __syncthreads();
    const uint32_t lane = threadIdx.x & 31;
    for (Index base = 0; base < n; base += blockDim.x) {
      const Index i = base + threadIdx.x;
      const uint32_t key = i < n ? key_of(i) : 0;
      const bool counted = i < n && (key & mask) == prefix;
      const uint32_t digit = counted ? (key >> shift) & 255u : 256u + lane;
      if (kMatch) {
        const uint32_t peers = __match_any_sync(0xffffffffu, digit);
        if (counted && lane == static_cast<uint32_t>(__ffs(peers) - 1)) {
          atomicAdd(&sh.hist[digit], static_cast<uint32_t>(__popc(peers)));
        }
      } else {
        const uint32_t on = __ballot_sync(0xffffffffu, counted);
        if (on != 0) {
          const uint32_t first = __shfl_sync(0xffffffffu, digit, __ffs(on) - 1);
          const uint32_t same = __ballot_sync(0xffffffffu, counted && digit == first);
          if (counted && digit != first) {
            atomicAdd(&sh.hist[digit], 1u);
          } else if (counted && lane == static_cast<uint32_t>(__ffs(same) - 1)) {
            atomicAdd(&sh.hist[digit], static_cast<uint32_t>(__popc(same)));
          }
        }
      }
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane L holds bins [8 L, 8 L + 8); the digit is the bin where the running count passes k.
      uint32_t c[8], sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = sh.hist[threadIdx.x * 8 + j];
        sum += c[j];
      }
      uint32_t incl = sum;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint32_t up = __shfl_up_sync(0xffffffffu, incl, o);
        if (static_cast<int>(threadIdx.x) >= o) incl += up;
      }
      uint32_t below = incl - sum;
      if (below <= k && k < incl) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (k < below + c[j]) {
            sh.digit = threadIdx.x * 8 + j;
            sh.rank = static_cast<uint32_t>(k - below);
            break;
          }
          below += c[j];
        }
      }
    }
    __syncthreads();
    prefix |= sh.digit << shift;
    mask |= 0xffu << shift;
    k = sh.rank;
    __syncthreads();  // digit and rank read before the next pass writes them
  }
  return prefix;
}

}  // namespace block_select
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_BLOCK_RADIX_SELECT_CUH_
