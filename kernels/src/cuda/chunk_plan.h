// How the CUDA attention and moment kernels split the heads' tokens into chunks, one CTA each,
// host code (attention_kernels.cuh and moments_kernels.cuh launch with it; a CPU test checks
// it): about one wave of CTAs over the multiprocessors, whole tiles per chunk, and for the
// attention a few slots of the wave kept for the virtual token's CTAs.
#ifndef KVCOMP_KERNELS_SRC_CUDA_CHUNK_PLAN_H_
#define KVCOMP_KERNELS_SRC_CUDA_CHUNK_PLAN_H_

#include <algorithm>
#include <cstdint>

#include "../env_switch.h"

namespace kvcomp {
namespace attention_cuda {

inline constexpr int kRows = 32;  // query rows per CTA of the general kernel (a row block)
// A decode step of the CUDA-core kernel: at most kDecodeRows rows per kv head; 32-token tiles,
// three CTAs' stages fit an SM (d <= 128).
inline constexpr int kDecodeRows = 8;
inline constexpr int kDecodeCtasPerSm = 3;
// The tensor-core decode kernel: at most kMmaRows rows per kv head (two m-tiles), 64-token
// tiles, two CTAs per SM.
inline constexpr int kMmaRows = 32;
inline constexpr int kMmaTile = 64;
inline constexpr int kMmaCtasPerSm = 2;
// Most partials a row may have (the combine kernel's limit; the plan keeps chunks below it).
inline constexpr uint32_t kMaxSlots = 1024;
// Columns of C q per virtual-token CTA, hence head_dim / kVirtualCols such CTAs per (kv head,
// row block).
inline constexpr int kVirtualCols = 32;
constexpr uint32_t VirtualCtas(uint32_t head_dim) { return head_dim / kVirtualCols; }

// Whether a launch of (rows per kv head, 16-bit K/V, head_dim) takes the tensor-core decode
// kernel. KVCOMP_CUDA_MMA_DECODE=0 keeps the CUDA-core kernels (for comparisons).
inline bool MmaDecode(uint32_t rows, bool sixteen_bit, uint32_t head_dim) {
  static const bool on = internal::SwitchOn("KVCOMP_CUDA_MMA_DECODE");
  return on && sixteen_bit && head_dim <= 128 && rows <= static_cast<uint32_t>(kMmaRows);
}

// Kept tokens per partial CTA and their count for the longest head (max_kept): one wave of
// CTAs (kMmaCtasPerSm per multiprocessor for the tensor-core decode kernel, kDecodeCtasPerSm
// for the CUDA-core one, two for the general kernel) less VirtualCtas(head_dim) slots per
// (kv head, row block) with the virtual token, chunks of whole 64-token tiles (tensor cores) or
// of at least 128 (decode) or 256 tokens in multiples of 32, fewer chunks than kMaxSlots.
// (Three CTAs per multiprocessor of the general kernel and 128-token chunks were measured
// slower on an H100: 95 registers left room for two.)
struct Chunking {
  uint64_t chunk = 0;
  uint32_t chunks = 0;
};
inline Chunking PartialChunking(uint32_t rows, bool sixteen_bit, uint32_t head_dim, uint32_t sms,
                                uint32_t kv_heads, uint64_t max_kept, bool virtual_token) {
  const bool mma = MmaDecode(rows, sixteen_bit, head_dim);
  const bool decode = !mma && sixteen_bit && rows <= static_cast<uint32_t>(kDecodeRows);
  const uint64_t row_blocks = mma ? 1 : (rows + kRows - 1) / kRows;
  const uint64_t per_sm =
      mma ? kMmaCtasPerSm : (decode && head_dim <= 128 ? kDecodeCtasPerSm : 2);
  const uint64_t per_head =
      per_sm * sms / std::max<uint64_t>(1, uint64_t{kv_heads} * row_blocks);
  const uint64_t spare = virtual_token ? VirtualCtas(head_dim) : 0;
  const uint64_t target = std::max<uint64_t>(
      1, std::min<uint64_t>(kMaxSlots - 1, per_head > spare ? per_head - spare : 1));
  const uint64_t step = mma ? kMmaTile : 32;
  uint64_t chunk =
      std::max<uint64_t>(mma ? kMmaTile : decode ? 128 : 256, (max_kept + target - 1) / target);
  chunk = (chunk + step - 1) / step * step;
  Chunking c;
  c.chunk = chunk;
  c.chunks = static_cast<uint32_t>(std::max<uint64_t>(1, (max_kept + chunk - 1) / chunk));
  return c;
}

}  // namespace attention_cuda

namespace moments_cuda {

inline constexpr int kTileT = 64;  // tokens per shared-memory tile of the moment kernels

// Tokens (compact mode) or list entries per CTA over a span of `span` per head: one wave of two
// CTAs per SM over the heads (and S blocks), at least kMinMomentChunk (each CTA ends with a
// flush of its S block, 64 KiB of atomics at d 128), whole tiles. Where kMinMomentChunk would
// leave SMs without a CTA (short spans), the floor is the chunk that gives about one CTA per SM,
// down to kMinShortMomentChunk: 2K tokens over 8 heads take 128-token chunks (16 CTAs per head
// instead of 4), 8K keep 512.
inline constexpr uint64_t kMinMomentChunk = 512;
inline constexpr uint64_t kMinShortMomentChunk = 128;
inline uint64_t MomentChunk(uint64_t span, uint32_t heads, uint32_t sblocks, int sms) {
  const uint64_t groups = std::max<uint64_t>(1, uint64_t{heads} * sblocks);
  const uint64_t sm = static_cast<uint64_t>(std::max(sms, 1));
  const uint64_t target = std::max<uint64_t>(1, 2 * sm / groups);
  const uint64_t fill = (groups * span / sm + kTileT - 1) / kTileT * kTileT;
  const uint64_t floor = std::clamp(fill, kMinShortMomentChunk, kMinMomentChunk);
  const uint64_t chunk = std::max<uint64_t>(floor, (span + target - 1) / target);
  return (chunk + kTileT - 1) / kTileT * kTileT;
}

}  // namespace moments_cuda
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_CHUNK_PLAN_H_
