// KVSplice CUDA kernels (codec_ops.h has the arithmetic; the CPU reference is
// cpu/codec_cpu_internal.h and these follow it: f16 scales rounded up, round-half-even,
// clamp before conversion).
//
// Work is a list of tiles (head, first row, rows) built on the host from the ragged offsets, one
// thread block per tile, so every block reads one head's matrix.
//   FusedEncodeKernel (codec_encode.cuh): projection, outlier measure and quantization of
//     every layer in one launch, the CPU reference's arithmetic bit for bit.
//   ExpandValuesKernel (below): the fused dequantize + expand on mma.sync, pipelined; what the
//     codec op and the decode library run wherever the latent layout allows it.
//   DecodeValuesKernel: the fused dequantize + expand for every other layout (and, with
//     KVCOMP_CUDA_EXPAND=0, for all). Each block stages its head's decode matrix
//     (f16) in shared memory once, then per 64-row sub-tile dequantizes the latent into f16
//     (q * s, exact for int4/int8 up to the f16 rounding of the product), multiplies on tensor
//     cores (WMMA 16x16x16, f32 accumulate) and writes V' in the output dtype. Nothing but V' is
//     written to global memory.
#ifndef KVCOMP_KERNELS_SRC_CUDA_CODEC_KERNELS_CUH_
#define KVCOMP_KERNELS_SRC_CUDA_CODEC_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/policy.h"
#include "codec_tiles.h"
#include "ptx_primitives.cuh"

namespace kvcomp {
namespace codec_cuda {

enum class LatentKind : int { kF16 = 0, kInt8 = 1, kInt4 = 2 };

// The latent of a value codec (not kRaw).
inline LatentKind KindOf(ValueCodec c) {
  return c == ValueCodec::kOrthogonalInt8   ? LatentKind::kInt8
         : c == ValueCodec::kOrthogonalInt4 ? LatentKind::kInt4
                                            : LatentKind::kF16;
}

template <typename T>
__device__ __forceinline__ float ToF(T x);
template <>
__device__ __forceinline__ float ToF<float>(float x) { return x; }
template <>
__device__ __forceinline__ float ToF<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float ToF<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromF(float x);
template <>
__device__ __forceinline__ float FromF<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half FromF<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// As codec_internal::GroupScaleHalf.
__device__ __forceinline__ uint16_t GroupScaleHalf(float max_abs, int qmax) {
  const float s = max_abs / static_cast<float>(qmax);
  if (!(s > 0.0f)) return 0;
  if (s >= 65504.0f) return 0x7bff;
  uint16_t h = __half_as_ushort(__float2half_rn(s));
  if (__half2float(__ushort_as_half(h)) < s) ++h;
  return h;
}

__device__ __forceinline__ int QuantizeOne(float z, float scale, int qmax) {
  if (scale == 0.0f) return 0;
  const float q = fminf(fmaxf(z / scale, -static_cast<float>(qmax)), static_cast<float>(qmax));
  return __float2int_rn(q);
}

__device__ __forceinline__ int Int4Value(uint32_t nibble) {
  return static_cast<int>((nibble ^ 8u) & 15u) - 8;
}

constexpr int kDecodeThreads = 128;  // 4 warps
constexpr int kDecodeSubTiles = 4;   // sub-tiles of M rows per block (rows per tile: 4 M)
constexpr int kStageLd = 20;         // floats per row of a warp's 16x16 output staging tile

template <int D>
struct DecodeShape {
  static constexpr int M = D >= 256 ? 32 : 64;          // rows per sub-tile
  static constexpr int kRowGroups = M / 16;              // warps along rows
  static constexpr int kColGroups = 4 / kRowGroups;      // warps along columns
  static constexpr int kColsPerWarp = D / kColGroups;
  static constexpr int kFrags = kColsPerWarp / 16;
  static constexpr int kLdD = D + 8;                     // halves, padding against bank conflicts
  static constexpr int kTileRows = M * kDecodeSubTiles;
};

struct DecodeParams {
  const Tile* tiles;
  const uint8_t* latent;
  const uint16_t* scales;
  const __half* dec;  // [heads][r_pad][D] f16, rows >= r zero
  void* out;          // [rows][D] of T
  uint32_t r, r_pad, group_size, groups, latent_bytes;
  LatentKind kind;
  bool vector_path;   // r % 8 == 0, group_size % 8 == 0, latent 16-byte aligned
};

template <int D>
__host__ __device__ constexpr size_t DecodeSmemBytes(uint32_t r_pad) {
  using S = DecodeShape<D>;
  return static_cast<size_t>(r_pad) * S::kLdD * 2 +        // decode matrix
         static_cast<size_t>(S::M) * (r_pad + 8) * 2 +      // dequantized latent
         static_cast<size_t>(kDecodeThreads / 32) * 16 * kStageLd * 4;  // per-warp staging
}

__device__ __forceinline__ float ScaleAt(const DecodeParams& p, uint64_t row, uint32_t j) {
  return __half2float(__ushort_as_half(p.scales[row * p.groups + j / p.group_size]));
}

// Dequantizes rows [grow0, grow0 + m) of the latent into `as` (M x r_pad f16, ld lda), zeros
// beyond m rows and r columns. Vector path: 8 latent elements (one scale) per thread-iteration.
template <int M>
__device__ __forceinline__ void DequantizeTile(const DecodeParams& p, uint64_t grow0, uint32_t m,
                                               __half* as, uint32_t lda) {
  const uint32_t r = p.r, r_pad = p.r_pad;
  if (p.vector_path) {
    const uint32_t cpr = r_pad / 8;
    for (uint32_t i = threadIdx.x; i < M * cpr; i += blockDim.x) {
      const uint32_t t = i / cpr, j = (i - t * cpr) * 8;
      uint4 packed = make_uint4(0, 0, 0, 0);
      if (t < m && j < r) {
        const uint64_t g = grow0 + t;
        const uint8_t* row = p.latent + g * p.latent_bytes;
        __half2* h = reinterpret_cast<__half2*>(&packed);
        if (p.kind == LatentKind::kF16) {
          packed = *reinterpret_cast<const uint4*>(row + 2 * j);
        } else if (p.kind == LatentKind::kInt8) {
          const float s = ScaleAt(p, g, j);
          const uint2 raw = *reinterpret_cast<const uint2*>(row + j);
          const uint32_t w[2] = {raw.x, raw.y};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const uint32_t word = w[k / 2];
            const int sh = (k % 2) * 16;
            const float a = static_cast<float>(static_cast<int8_t>((word >> sh) & 0xff)) * s;
            const float b = static_cast<float>(static_cast<int8_t>((word >> (sh + 8)) & 0xff)) * s;
            h[k] = __floats2half2_rn(a, b);
          }
        } else {
          const float s = ScaleAt(p, g, j);
          const uint32_t raw = *reinterpret_cast<const uint32_t*>(row + j / 2);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const uint32_t byte = (raw >> (8 * k)) & 0xff;
            h[k] = __floats2half2_rn(Int4Value(byte & 15u) * s, Int4Value(byte >> 4) * s);
          }
        }
      }
      *reinterpret_cast<uint4*>(as + t * lda + j) = packed;
    }
    return;
  }
  if (p.kind == LatentKind::kInt4) {
    const uint32_t hb = r_pad / 2;
    for (uint32_t i = threadIdx.x; i < M * hb; i += blockDim.x) {
      const uint32_t t = i / hb, jb = i % hb, j = jb * 2;
      __half2 v = __floats2half2_rn(0.0f, 0.0f);
      if (t < m && j < r) {
        const uint64_t g = grow0 + t;
        const uint8_t b = p.latent[g * p.latent_bytes + jb];
        v = __floats2half2_rn(Int4Value(b & 15u) * ScaleAt(p, g, j),
                              Int4Value(b >> 4) * ScaleAt(p, g, j + 1));
      }
      *reinterpret_cast<__half2*>(as + t * lda + j) = v;
    }
    return;
  }
  for (uint32_t i = threadIdx.x; i < M * r_pad; i += blockDim.x) {
    const uint32_t t = i / r_pad, j = i % r_pad;
    float v = 0.0f;
    if (t < m && j < r) {
      const uint64_t g = grow0 + t;
      if (p.kind == LatentKind::kInt8) {
        v = static_cast<int8_t>(p.latent[g * p.latent_bytes + j]) * ScaleAt(p, g, j);
      } else {
        v = __half2float(reinterpret_cast<const __half*>(p.latent + g * p.latent_bytes)[j]);
      }
    }
    as[t * lda + j] = __float2half_rn(v);
  }
}

template <typename T>
__device__ __forceinline__ void Store8(T* dst, const float* src) {
  if constexpr (sizeof(T) == 4) {
    reinterpret_cast<float4*>(dst)[0] = make_float4(src[0], src[1], src[2], src[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(src[4], src[5], src[6], src[7]);
  } else {
    T v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = FromF<T>(src[k]);
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(v);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kDecodeThreads) DecodeValuesKernel(DecodeParams p) {
  using namespace nvcuda;
  using S = DecodeShape<D>;
  extern __shared__ __align__(128) unsigned char dsmem[];
  const Tile tile = p.tiles[blockIdx.x];
  const uint32_t r_pad = p.r_pad, lda = r_pad + 8;
  __half* dm = reinterpret_cast<__half*>(dsmem);
  __half* as = dm + static_cast<size_t>(r_pad) * S::kLdD;
  float* stage_all = reinterpret_cast<float*>(as + static_cast<size_t>(S::M) * lda);

  // The head's decode matrix, 16-byte loads.
  const __half* dg = p.dec + static_cast<uint64_t>(tile.head) * r_pad * D;
  for (uint32_t i = threadIdx.x; i < r_pad * (D / 8); i += blockDim.x) {
    const uint32_t row = i / (D / 8), c8 = (i % (D / 8)) * 8;
    *reinterpret_cast<uint4*>(dm + row * S::kLdD + c8) =
        *reinterpret_cast<const uint4*>(dg + static_cast<uint64_t>(row) * D + c8);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr = warp % S::kRowGroups, wc = warp / S::kRowGroups;
  float* stage = stage_all + warp * 16 * kStageLd;
  T* out = static_cast<T*>(p.out);

  for (uint32_t row0 = 0; row0 < tile.rows; row0 += S::M) {
    const uint32_t m = min(static_cast<uint32_t>(S::M), tile.rows - row0);
    const uint64_t grow0 = tile.begin + row0;
    __syncthreads();  // the previous sub-tile's MMAs are done with `as` (and dm is loaded)
    DequantizeTile<S::M>(p, grow0, m, as, lda);
    __syncthreads();
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[S::kFrags];
#pragma unroll
    for (int f = 0; f < S::kFrags; ++f) wmma::fill_fragment(acc[f], 0.0f);
    for (uint32_t k = 0; k < r_pad; k += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
      wmma::load_matrix_sync(a, as + wr * 16 * lda + k, lda);
#pragma unroll
      for (int f = 0; f < S::kFrags; ++f) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> b;
        wmma::load_matrix_sync(b, dm + k * S::kLdD + wc * S::kColsPerWarp + f * 16, S::kLdD);
        wmma::mma_sync(acc[f], a, b, acc[f]);
      }
    }
    // Each warp writes its 16 x kColsPerWarp block of V' through a 16 x 16 staging tile: lane
    // l writes row l / 2, columns (l % 2) * 8 .. + 8 (16 or 32 contiguous bytes).
    const uint32_t t = wr * 16 + lane / 2;
#pragma unroll
    for (int f = 0; f < S::kFrags; ++f) {
      wmma::store_matrix_sync(stage, acc[f], kStageLd, wmma::mem_row_major);
      __syncwarp();
      if (t < m) {
        const uint32_t c = wc * S::kColsPerWarp + f * 16 + (lane % 2) * 8;
        Store8<T>(out + (grow0 + t) * D + c, stage + (lane / 2) * kStageLd + (lane % 2) * 8);
      }
      __syncwarp();
    }
  }
}

// --- The pipelined expand: tensor cores through mma.sync (sm_80 and later) ---------------
// For ranks that are a multiple of 4 (int4: 8) and, for int8/int4, group_size % 16 == 0
// (ExpandEligible). A block takes one tile (one head's rows) in sub-tiles of M rows:
//   - the head's decode matrix is staged once in shared memory (f16, rows permuted as below);
//   - the latent rows and scales of sub-tile i + 2 are copied to shared memory (cp.async, three
//     stages) while sub-tile i multiplies (odd scale counts per row: loaded into registers a
//     sub-tile ahead);
//   - each warp computes 32 rows x 64 columns of V' (two m16 x eight n8 blocks of
//     mma.m16n8k16, f32 accumulators) with its A operand built in registers straight from the
//     latent bytes: within each 16-wide k step, lane q = lane % 4 owns the four adjacent latent
//     columns 4q .. 4q + 3 (one 32-bit read of int8, 16 bits of int4, 64 bits of f16) for
//     MMA slots 2q, 2q + 1, 2q + 8, 2q + 9, and the decode matrix rows are stored in that same
//     order, so the sum over k is unchanged;
//   - int8 and int4 become f16 by placing the biased integer into the mantissa of 1024 (exact)
//     and one f16 multiply by the group's scale: q * s rounded once, as the other paths;
//   - V' goes through a padded shared-memory tile to 16-byte stores.
constexpr int kExpandThreads = 128;  // 4 warps
constexpr int kExpandStages = 3;

template <int D>
struct ExpandShape {
  static constexpr int kWarpRows = 32;
  static constexpr int kWarpCols = 64;
  static constexpr int kColWarps = D / kWarpCols;                        // 1, 2, 4
  static constexpr int kRowWarps = (kExpandThreads / 32) / kColWarps;    // 4, 2, 1
  static constexpr int M = kRowWarps * kWarpRows;                        // rows per sub-tile
  static constexpr int kLdDec = D + 8;                                   // halves
  static constexpr int kLdOut = D + 8;                                   // elements
};

// Latent row stride in shared memory: room for r_pad columns in whole 16-byte units, chosen so
// that the eight rows a warp reads at once fall in distinct banks (int8/int4: row offsets an odd
// multiple of 4 words apart; f16, 8-byte reads: an odd multiple of 8 words among each
// half-warp's four rows).
__host__ __device__ constexpr uint32_t ExpandLatentStride(uint32_t r_pad, LatentKind kind) {
  const uint32_t row = kind == LatentKind::kF16    ? 2 * r_pad
                       : kind == LatentKind::kInt8 ? r_pad
                                                   : (r_pad / 2 + 15) / 16 * 16;
  return kind == LatentKind::kF16 ? row + ((row / 4) % 16 == 0 ? 32u : 0u)
                                  : row + ((row / 4) % 8 == 0 ? 16u : 0u);
}

// Ranks whose latent columns come in whole groups of four per lane (r % 4, int4 r % 8: rows of
// whole 4-byte units at a 4-byte aligned base) and scale groups of whole k steps
// (group_size % 16); columns past r in the last k step are zero in the A operands.
__host__ __device__ inline bool ExpandEligible(uint32_t r, uint32_t group_size,
                                               uint32_t latent_bytes, LatentKind kind,
                                               uintptr_t latent_addr) {
  return r > 0 && r % (kind == LatentKind::kInt4 ? 8 : 4) == 0 && latent_bytes % 4 == 0 &&
         latent_addr % 4 == 0 && (kind == LatentKind::kF16 || group_size % 16 == 0);
}

struct ExpandSmem {
  size_t dec, latent, scales, out, total;
};

template <int D>
__host__ __device__ constexpr ExpandSmem ExpandSmemLayout(uint32_t r_pad, LatentKind kind,
                                                          uint32_t groups, uint32_t out_bytes) {
  using S = ExpandShape<D>;
  const size_t dec = size_t{r_pad} * S::kLdDec * 2;
  const size_t latent = size_t{kExpandStages} * S::M * ExpandLatentStride(r_pad, kind);
  const size_t scales = (size_t{kExpandStages} * S::M * groups * 2 + 15) / 16 * 16;
  const size_t out = size_t{S::M} * S::kLdOut * out_bytes;
  return ExpandSmem{dec, latent, scales, out, dec + latent + scales + out};
}

// The latent column (within its 16-wide k step) that MMA k slot l (0..15) holds: lane q's
// columns 4q .. 4q + 3 go to slots 2q, 2q + 1 (first register) and 2q + 8, 2q + 9 (second) in
// the order the conversion produces them: 4q, 4q + 1 | 4q + 2, 4q + 3, for int4
// 4q, 4q + 2 | 4q + 1, 4q + 3 (Int4x4ToHalf pairs the nibbles one byte apart).
template <LatentKind K>
__device__ __forceinline__ uint32_t ExpandSlotColumn(uint32_t l) {
  const uint32_t base = ((l & 7u) / 2) * 4;
  if constexpr (K == LatentKind::kInt4) return base + (l < 8 ? 0u : 1u) + 2 * (l & 1);
  return base + (l < 8 ? 0u : 2u) + (l & 1);
}

// Four int8 (two's complement) -> two f16 pairs times the scale s2.
__device__ __forceinline__ void Int8x4ToHalf(uint32_t w, __half2 s2, uint32_t& lo, uint32_t& hi) {
  w ^= 0x80808080u;  // q + 128 in 0..255
  const __half2 bias = __half2half2(__ushort_as_half(0x6480));  // 1152 = 1024 + 128
  uint32_t a = __byte_perm(w, 0x64646464u, 0x4140u), b = __byte_perm(w, 0x64646464u, 0x4342u);
  __half2 ha = __hmul2(__hsub2(*reinterpret_cast<__half2*>(&a), bias), s2);
  __half2 hb = __hmul2(__hsub2(*reinterpret_cast<__half2*>(&b), bias), s2);
  lo = *reinterpret_cast<uint32_t*>(&ha);
  hi = *reinterpret_cast<uint32_t*>(&hb);
}

// Four int4 (16 bits, element 2i in the low nibble) -> two f16 pairs times the scale s2: lo =
// elements 0 and 2, hi = elements 1 and 3. The two bytes go to bytes 0 and 2 (one byte
// permute); then each pair is one three-input logic op: the nibble's bit 3 flipped (q + 8 in
// 0..15) inside the mask, the exponent bits of 1024 outside it.
__device__ __forceinline__ void Int4x4ToHalf(uint32_t w, __half2 s2, uint32_t& lo, uint32_t& hi) {
  const __half2 bias = __half2half2(__ushort_as_half(0x6408));  // 1032 = 1024 + 8
  constexpr uint32_t kMask = 0x000F000Fu, kBits = 0x64086408u;    // 0x6400 | 8 in each half
  const uint32_t x = __byte_perm(w, 0u, 0x4140u);
  uint32_t a = ((x ^ kBits) & kMask) | (kBits & ~kMask);
  uint32_t b = (((x >> 4) ^ kBits) & kMask) | (kBits & ~kMask);
  __half2 ha = __hmul2(__hsub2(*reinterpret_cast<__half2*>(&a), bias), s2);
  __half2 hb = __hmul2(__hsub2(*reinterpret_cast<__half2*>(&b), bias), s2);
  lo = *reinterpret_cast<uint32_t*>(&ha);
  hi = *reinterpret_cast<uint32_t*>(&hb);
}

template <typename T>
__device__ __forceinline__ void StorePair(T* dst, float a, float b) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float2*>(dst) = make_float2(a, b);
  } else if constexpr (std::is_same_v<T, __half>) {
    *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(a, b);
  } else {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
  }
}

template <typename T, int D, LatentKind K>
__global__ void __launch_bounds__(kExpandThreads, 4) ExpandValuesKernel(DecodeParams p) {
  using S = ExpandShape<D>;
  constexpr int M = S::M;
  extern __shared__ __align__(128) unsigned char xsmem[];
  const Tile tile = p.tiles[blockIdx.x];
  const uint32_t r_pad = p.r_pad, lb = p.latent_bytes, groups = p.groups;
  const uint32_t ls = ExpandLatentStride(r_pad, K);
  // Whole 16-byte units where the rows are, else 4-byte units.
  const bool wide = lb % 16 == 0 && reinterpret_cast<uintptr_t>(p.latent) % 16 == 0;
  const ExpandSmem lay = ExpandSmemLayout<D>(r_pad, K, groups, sizeof(T));
  __half* dec_s = reinterpret_cast<__half*>(xsmem);
  unsigned char* lat_s = xsmem + lay.dec;
  uint16_t* sc_s = reinterpret_cast<uint16_t*>(xsmem + lay.dec + lay.latent);
  T* out_s = reinterpret_cast<T*>(xsmem + lay.dec + lay.latent + lay.scales);
  const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const uint32_t wr = warp % S::kRowWarps, wc = warp / S::kRowWarps;
  const uint32_t g = lane / 4, q = lane % 4;
  const uint32_t nsub = (tile.rows + M - 1) / M;

  // The decode matrix, rows permuted within each 16-row step (ExpandSlotColumn<K>).
  const __half* dg = p.dec + static_cast<uint64_t>(tile.head) * r_pad * D;
  for (uint32_t i = tid; i < r_pad * (D / 8); i += kExpandThreads) {
    const uint32_t row = i / (D / 8), c8 = (i % (D / 8)) * 8;
    const uint32_t src = (row & ~15u) + ExpandSlotColumn<K>(row & 15u);
    ptx::CpAsync16(dec_s + row * S::kLdDec + c8, dg + static_cast<uint64_t>(src) * D + c8, 16);
  }
  // Sub-tile s's latent into stage s % kExpandStages (rows past the tile are left as they are:
  // their products land in rows that are never written out), and its
  // scales too when a row has an even number of them (4-byte units: every sub-tile starts a
  // whole row).
  const bool async_scales = K != LatentKind::kF16 && groups % 2 == 0 &&
                            reinterpret_cast<uintptr_t>(p.scales) % 4 == 0;
  auto issue = [&](uint32_t s) {
    if (s >= nsub) return;
    const uint32_t row0 = s * M, m = min(static_cast<uint32_t>(M), tile.rows - row0);
    const unsigned char* src = p.latent + (tile.begin + row0) * lb;
    unsigned char* dst = lat_s + (s % kExpandStages) * M * ls;
    if (wide) {
      const uint32_t units = lb / 16;
      for (uint32_t i = tid; i < m * units; i += kExpandThreads) {
        const uint32_t t = i / units, u = i - t * units;
        ptx::CpAsync16(dst + t * ls + u * 16, src + static_cast<uint64_t>(t) * lb + u * 16, 16);
      }
    } else {
      const uint32_t units = lb / 4;
      for (uint32_t i = tid; i < m * units; i += kExpandThreads) {
        const uint32_t t = i / units, u = i - t * units;
        ptx::CpAsync4(dst + t * ls + u * 4, src + static_cast<uint64_t>(t) * lb + u * 4);
      }
    }
    if (async_scales) {
      const uint16_t* ssrc = p.scales + (tile.begin + row0) * groups;
      uint16_t* sdst = sc_s + (s % kExpandStages) * M * groups;
      for (uint32_t i = tid; i < m * groups / 2; i += kExpandThreads) {
        ptx::CpAsync4(sdst + 2 * i, ssrc + 2 * i);
      }
    }
  };
  // Odd scale counts per row: loaded into registers a sub-tile ahead, stored after the
  // products.
  constexpr int kScaleRegs = 4;  // M * groups <= 4 * kExpandThreads for group_size >= 16
  uint16_t sreg[kScaleRegs];
  auto load_scales = [&](uint32_t s) {
    if (K == LatentKind::kF16 || async_scales || s >= nsub) return;
    const uint32_t row0 = s * M, m = min(static_cast<uint32_t>(M), tile.rows - row0);
    const uint16_t* src = p.scales + (tile.begin + row0) * groups;
#pragma unroll
    for (int k = 0; k < kScaleRegs; ++k) {
      const uint32_t i = tid + k * kExpandThreads;
      sreg[k] = i < m * groups ? src[i] : uint16_t{0};
    }
  };
  auto store_scales = [&](uint32_t s) {
    if (K == LatentKind::kF16 || async_scales || s >= nsub) return;
    uint16_t* dst = sc_s + (s % kExpandStages) * M * groups;
#pragma unroll
    for (int k = 0; k < kScaleRegs; ++k) {
      const uint32_t i = tid + k * kExpandThreads;
      if (i < M * groups) dst[i] = sreg[k];
    }
  };

  issue(0);
  ptx::CpAsyncCommit();  // with the decode matrix
  for (int s = 1; s < kExpandStages - 1; ++s) {
    issue(s);
    ptx::CpAsyncCommit();
  }
  load_scales(0);
  store_scales(0);

  const uint32_t row_w = wr * S::kWarpRows, col_w = wc * S::kWarpCols;
  for (uint32_t i = 0; i < nsub; ++i) {
    issue(i + kExpandStages - 1);
    ptx::CpAsyncCommit();
    load_scales(i + 1);
    ptx::CpAsyncWait<kExpandStages - 1>();
    __syncthreads();  // sub-tile i's latent and scales are in shared memory

    const unsigned char* lat = lat_s + (i % kExpandStages) * M * ls;
    const uint16_t* sc = sc_s + (i % kExpandStages) * M * groups;
    float acc[2][8][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;

#pragma unroll 2
    for (uint32_t ks = 0; ks < r_pad / 16; ++ks) {
      const bool live = ks * 16 + q * 4 < p.r;  // this lane's four columns (r % 4 == 0)
      uint32_t a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const uint32_t r0 = row_w + mt * 16 + g, r1 = r0 + 8;
        if constexpr (K == LatentKind::kF16) {
          const uint2 x0 = *reinterpret_cast<const uint2*>(lat + r0 * ls + ks * 32 + q * 8);
          const uint2 x1 = *reinterpret_cast<const uint2*>(lat + r1 * ls + ks * 32 + q * 8);
          a[mt][0] = x0.x;
          a[mt][2] = x0.y;
          a[mt][1] = x1.x;
          a[mt][3] = x1.y;
        } else {
          const uint32_t grp = ks * 16 / p.group_size;
          const __half2 s0 = __half2half2(__ushort_as_half(sc[r0 * groups + grp]));
          const __half2 s1 = __half2half2(__ushort_as_half(sc[r1 * groups + grp]));
          if constexpr (K == LatentKind::kInt8) {
            const uint32_t w0 = *reinterpret_cast<const uint32_t*>(lat + r0 * ls + ks * 16 + q * 4);
            const uint32_t w1 = *reinterpret_cast<const uint32_t*>(lat + r1 * ls + ks * 16 + q * 4);
            Int8x4ToHalf(w0, s0, a[mt][0], a[mt][2]);
            Int8x4ToHalf(w1, s1, a[mt][1], a[mt][3]);
          } else {
            const uint32_t w0 = *reinterpret_cast<const uint16_t*>(lat + r0 * ls + ks * 8 + q * 2);
            const uint32_t w1 = *reinterpret_cast<const uint16_t*>(lat + r1 * ls + ks * 8 + q * 2);
            Int4x4ToHalf(w0, s0, a[mt][0], a[mt][2]);
            Int4x4ToHalf(w1, s1, a[mt][1], a[mt][3]);
          }
        }
        // Columns past r read shared memory beyond the row's bytes: zero operands instead.
        if (!live) a[mt][0] = a[mt][1] = a[mt][2] = a[mt][3] = 0u;
      }
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b[4];
        ptx::LdMatrixX4Trans(
            b, dec_s + (ks * 16 + (lane & 15)) * S::kLdDec + col_w + np * 16 + (lane / 16) * 8);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          ptx::MmaF16(acc[mt][2 * np], a[mt], b[0], b[1]);
          ptx::MmaF16(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const uint32_t r0 = row_w + mt * 16 + g;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const uint32_t c = col_w + nt * 8 + 2 * q;
        StorePair<T>(out_s + r0 * S::kLdOut + c, acc[mt][nt][0], acc[mt][nt][1]);
        StorePair<T>(out_s + (r0 + 8) * S::kLdOut + c, acc[mt][nt][2], acc[mt][nt][3]);
      }
    }
    __syncthreads();  // the output tile is complete; stage i is free
    // After the barrier, so that the scales' loads (issued before the products) are waited
    // for here and never inside the products.
    store_scales(i + 1);

    const uint32_t row0 = i * M, m = min(static_cast<uint32_t>(M), tile.rows - row0);
    constexpr uint32_t kUnits = D * sizeof(T) / 16, kPer = 16 / sizeof(T);
    T* out = static_cast<T*>(p.out) + (tile.begin + row0) * D;
    for (uint32_t j = tid; j < m * kUnits; j += kExpandThreads) {
      const uint32_t t = j / kUnits, u = j - t * kUnits;
      *reinterpret_cast<uint4*>(out + static_cast<uint64_t>(t) * D + u * kPer) =
          *reinterpret_cast<const uint4*>(out_s + t * S::kLdOut + u * kPer);
    }
  }
}

// Eight consecutive elements of T at `p` (16-byte aligned) as f32.
template <typename T>
__device__ __forceinline__ void Load8(const T* p, float* v) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = ToF<T>(e[k]);
  }
}

// Per (head, channel) max |k| / 127 over the head's rows: blocks (head, share of its rows); with
// `vec` each thread reads eight channels of a row with one 16-byte load (d % 8 == 0, rows
// aligned), else one channel.
template <typename T>
__global__ void KeyScalesKernel(const T* keys, const uint64_t* offsets, uint32_t d, bool vec,
                                float* scales) {
  // Block (h, y) takes the y-th share of head h's rows; each thread one channel of a stride of
  // rows, then the largest |k| into the head's channel as bits (non-negative floats order like
  // their bits, so atomicMax is the max in any order: the result is the CPU's). `scales` holds
  // zero bits on entry; KeyScalesFinish divides by 127.
  const uint32_t h = blockIdx.x;
  const uint64_t b = offsets[h], e = offsets[h + 1];
  const uint64_t per = (e - b + gridDim.y - 1) / gridDim.y;
  const uint64_t lo = b + blockIdx.y * per, hi = min(e, lo + per);
  if (lo >= hi) return;
  auto* bits = reinterpret_cast<unsigned int*>(scales) + static_cast<uint64_t>(h) * d;
  if (vec && d / 8 <= blockDim.x) {
    // Eight channels per thread (16-byte loads), blockDim.x / (d / 8) rows at a time; the
    // block's maxima meet in shared memory first, then one global atomic per channel.
    extern __shared__ unsigned int key_scale_bits[];  // [d]
    const uint32_t per_row = d / 8, phases = blockDim.x / per_row;
    for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) key_scale_bits[c] = 0;
    __syncthreads();
    if (threadIdx.x < phases * per_row) {
      const uint32_t c0 = (threadIdx.x % per_row) * 8, ph = threadIdx.x / per_row;
      float m[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
      for (uint64_t i = lo + ph; i < hi; i += phases) {
        float v[8];
        Load8<T>(keys + i * d + c0, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) m[k] = fmaxf(m[k], fabsf(v[k]));
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        if (m[k] > 0.0f) atomicMax(key_scale_bits + c0 + k, __float_as_uint(m[k]));
      }
    }
    __syncthreads();
    for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) {
      if (key_scale_bits[c] != 0) atomicMax(bits + c, key_scale_bits[c]);
    }
    return;
  }
  if (d <= blockDim.x) {
    const uint32_t phases = blockDim.x / d;
    if (threadIdx.x >= phases * d) return;
    const uint32_t c = threadIdx.x % d, ph = threadIdx.x / d;
    float m = 0.0f;
    for (uint64_t i = lo + ph; i < hi; i += phases) m = fmaxf(m, fabsf(ToF<T>(keys[i * d + c])));
    if (m > 0.0f) atomicMax(bits + c, __float_as_uint(m));
    return;
  }
  for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) {
    float m = 0.0f;
    for (uint64_t i = lo; i < hi; ++i) m = fmaxf(m, fabsf(ToF<T>(keys[i * d + c])));
    if (m > 0.0f) atomicMax(bits + c, __float_as_uint(m));
  }
}

// The int8 key scales from KeyScalesKernel's maxima: max / 127 (a template, as every kernel of
// this header, so that each translation unit including it may instantiate it).
template <typename T = float>
__global__ void KeyScalesFinishKernel(T* scales, uint64_t n) {
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    scales[i] = __uint_as_float(reinterpret_cast<const unsigned int*>(scales)[i]) / 127.0f;
  }
}

// Tiles of tile_rows rows over every head, found on the device (no per-tile list to send):
// first_tile[h] counts the tiles before head h (heads + 1 entries), offsets are the heads' rows.
struct TileList {
  const uint64_t* offsets;
  const uint32_t* first_tile;
  uint32_t heads;
  uint32_t tile_rows;
};

// Block b's tile: the last head whose first tile is <= b (empty heads share the next one's).
__device__ __forceinline__ Tile TileAt(const TileList& list, uint32_t b) {
  uint32_t lo = 0, hi = list.heads;
  while (lo < hi) {
    const uint32_t mid = (lo + hi) / 2;
    if (list.first_tile[mid] <= b) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  const uint32_t h = lo - 1;
  const uint64_t begin = list.offsets[h] + uint64_t{b - list.first_tile[h]} * list.tile_rows;
  Tile t;
  t.head = h;
  t.begin = begin;
  t.rows = static_cast<uint32_t>(min(static_cast<uint64_t>(list.tile_rows),
                                     list.offsets[h + 1] - begin));
  return t;
}

// Keys of one tile per block: int8 with the head's scales, or f16. `vec`: eight elements per
// thread and step (d % 8 == 0, keys and output 16-byte aligned), the same arithmetic.
template <typename T>
__global__ void EncodeKeysKernel(TileList tiles, const T* keys, uint32_t d,
                                 const float* scales, bool int8, bool vec, void* out) {
  const Tile tile = TileAt(tiles, blockIdx.x);
  if (vec) {
    const uint64_t base = tile.begin * d;
    const float* sc = int8 ? scales + static_cast<uint64_t>(tile.head) * d : nullptr;
    for (uint32_t i = threadIdx.x * 8; i < tile.rows * d; i += blockDim.x * 8) {
      float v[8];
      Load8<T>(keys + base + i, v);
      if (int8) {
        const uint32_t c = i % d;
        uint32_t w[2] = {0u, 0u};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const int q = QuantizeOne(v[k], sc[c + k], 127);
          w[k / 4] |= static_cast<uint32_t>(static_cast<uint8_t>(static_cast<int8_t>(q)))
                      << (8 * (k % 4));
        }
        *reinterpret_cast<uint2*>(static_cast<int8_t*>(out) + base + i) = make_uint2(w[0], w[1]);
      } else {
        uint4 packed;
        __half2* h = reinterpret_cast<__half2*>(&packed);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          h[k] = __halves2half2(__float2half_rn(v[2 * k]), __float2half_rn(v[2 * k + 1]));
        }
        *reinterpret_cast<uint4*>(static_cast<__half*>(out) + base + i) = packed;
      }
    }
    return;
  }
  for (uint32_t i = threadIdx.x; i < tile.rows * d; i += blockDim.x) {
    const uint64_t e = tile.begin * d + i;
    const float v = ToF<T>(keys[e]);
    if (int8) {
      const float s = scales[static_cast<uint64_t>(tile.head) * d + i % d];
      static_cast<int8_t*>(out)[e] = static_cast<int8_t>(QuantizeOne(v, s, 127));
    } else {
      static_cast<__half*>(out)[e] = __float2half_rn(v);
    }
  }
}

// Decodes keys (int8 with scales, f16, or raw of type In) into Out. `vec`: eight elements per
// thread and step (d % 8 == 0; int8 input 8-byte, 16-bit input, scales and output 16-byte
// aligned), the same arithmetic.
template <typename In, typename Out>
__global__ void DecodeKeysKernel(const Tile* tiles, const void* in, uint32_t d,
                                 const float* scales, bool int8, bool vec, Out* out) {
  const Tile tile = tiles[blockIdx.x];
  if (vec) {
    const uint64_t base = tile.begin * d;
    for (uint32_t i = threadIdx.x * 8; i < tile.rows * d; i += blockDim.x * 8) {
      float v[8];
      if (int8) {
        const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const int8_t*>(in) + base + i);
        const float* sc = scales + static_cast<uint64_t>(tile.head) * d + i % d;
        const float4 s0 = *reinterpret_cast<const float4*>(sc);
        const float4 s1 = *reinterpret_cast<const float4*>(sc + 4);
        const float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const uint32_t w = k < 4 ? raw.x : raw.y;
          v[k] = static_cast<float>(static_cast<int8_t>((w >> (8 * (k % 4))) & 0xffu)) * sv[k];
        }
      } else {
        const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const In*>(in) + base + i);
        const In* x = reinterpret_cast<const In*>(&raw);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = ToF<In>(x[k]);
      }
      Store8<Out>(out + base + i, v);
    }
    return;
  }
  for (uint32_t i = threadIdx.x; i < tile.rows * d; i += blockDim.x) {
    const uint64_t e = tile.begin * d + i;
    float v;
    if (int8) {
      v = static_cast<const int8_t*>(in)[e] * scales[static_cast<uint64_t>(tile.head) * d + i % d];
    } else {
      v = ToF<In>(static_cast<const In*>(in)[e]);
    }
    out[e] = FromF<Out>(v);
  }
}

// First key scale of head h for int4 keys: its earlier heads' groups of kKeyInt4GroupRows rows,
// d scales each.
__device__ __forceinline__ uint64_t Int4KeyScaleStart(const uint64_t* offsets, uint32_t h,
                                                      uint32_t d) {
  uint64_t groups = 0;
  for (uint32_t i = 0; i < h; ++i) {
    groups += (offsets[i + 1] - offsets[i] + kKeyInt4GroupRows - 1) / kKeyInt4GroupRows;
  }
  return groups * d;
}

// int4 key scales: one block per head; each thread takes (group, channel) pairs of the head and
// writes max |k| over the group's rows / 7.
template <typename T>
__global__ void KeyInt4ScalesKernel(const T* keys, const uint64_t* offsets, uint32_t d,
                                    float* scales) {
  const uint32_t h = blockIdx.x;
  const uint64_t begin = offsets[h], rows = offsets[h + 1] - begin;
  const uint64_t groups = (rows + kKeyInt4GroupRows - 1) / kKeyInt4GroupRows;
  float* sc = scales + Int4KeyScaleStart(offsets, h, d);
  // Blocks (h, y) share the head's (group, channel) scales; each one thread's scan in order.
  for (uint64_t i = uint64_t{blockIdx.y} * blockDim.x + threadIdx.x; i < groups * d;
       i += uint64_t{gridDim.y} * blockDim.x) {
    const uint64_t g = i / d, c = i % d;
    const uint64_t r0 = begin + g * kKeyInt4GroupRows;
    const uint64_t r1 = min(r0 + kKeyInt4GroupRows, begin + rows);
    float m = 0.0f;
    for (uint64_t r = r0; r < r1; ++r) m = fmaxf(m, fabsf(ToF<T>(keys[r * d + c])));
    sc[i] = m / 7.0f;
  }
}

// int4 keys of one tile per block (a tile never spans two scale groups: tiles of 64 rows start
// at the head's first row and kKeyInt4GroupRows is a multiple of 64); one thread per byte.
template <typename T>
__global__ void EncodeKeysInt4Kernel(TileList tiles, const T* keys, const uint64_t* offsets,
                                     uint32_t d, const float* scales, uint8_t* out) {
  const Tile tile = TileAt(tiles, blockIdx.x);
  const uint32_t nb = (d + 1) / 2;
  const float* sc = scales + Int4KeyScaleStart(offsets, tile.head, d) +
                    (tile.begin - offsets[tile.head]) / kKeyInt4GroupRows * d;
  for (uint32_t i = threadIdx.x; i < tile.rows * nb; i += blockDim.x) {
    const uint64_t row = tile.begin + i / nb;
    const uint32_t c0 = 2 * (i % nb), c1 = c0 + 1;
    const int lo = QuantizeOne(ToF<T>(keys[row * d + c0]), sc[c0], 7);
    const int hi = c1 < d ? QuantizeOne(ToF<T>(keys[row * d + c1]), sc[c1], 7) : 0;
    out[row * nb + i % nb] = static_cast<uint8_t>((lo & 15) | ((hi & 15) << 4));
  }
}

// Decodes int4 keys of one tile per block into Out.
template <typename Out>
__global__ void DecodeKeysInt4Kernel(const Tile* tiles, const uint8_t* in,
                                     const uint64_t* offsets, uint32_t d, const float* scales,
                                     Out* out) {
  const Tile tile = tiles[blockIdx.x];
  const uint32_t nb = (d + 1) / 2;
  const float* sc = scales + Int4KeyScaleStart(offsets, tile.head, d) +
                    (tile.begin - offsets[tile.head]) / kKeyInt4GroupRows * d;
  for (uint32_t i = threadIdx.x; i < tile.rows * d; i += blockDim.x) {
    const uint64_t row = tile.begin + i / d;
    const uint32_t c = i % d;
    const uint8_t byte = in[row * nb + c / 2];
    const int q = Int4Value(c % 2 == 0 ? byte & 15u : byte >> 4);
    out[row * d + c] = FromF<Out>(static_cast<float>(q) * sc[c]);
  }
}

// [heads][tokens][d] strided view of T into dense f32.
template <typename T>
__global__ void GatherF32Kernel(const T* in, uint32_t heads, uint64_t tokens, uint32_t d,
                                uint64_t token_stride, uint64_t head_stride, float* out) {
  const uint64_t n = static_cast<uint64_t>(heads) * tokens * d;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = i / (tokens * d), t = (i / d) % tokens, k = i % d;
    out[i] = ToF<T>(in[h * head_stride + t * token_stride + k]);
  }
}

// Stream-ordered launches (codec_cuda.cu) for callers that keep their inputs on the device and
// their tile tables prepared: nothing but the launch on the host, nothing waited for.
//   LaunchExpandValues: the pipelined expand of p (an ExpandEligible layout, tiles from
//     ExpandTiles with ExpandShape<head_dim>::M and ExpandSlots) into [rows][head_dim] of
//     out_dtype.
//   LaunchDecodeKeys: int8 (scales per head and channel) or f16 keys, or raw keys of in_dtype,
//     over UniformTiles of 64 rows, into out_dtype.
absl::Status LaunchExpandValues(cudaStream_t stream, const DecodeParams& p, size_t tiles,
                                uint32_t head_dim, DType out_dtype);
// Blocks of the expand kernel for (p's layout, head_dim, out_dtype) the current device runs at
// once (its occupancy per SM times the SMs), for ExpandTiles; InvalidArgument for a layout the
// kernel does not take.
absl::StatusOr<uint64_t> ExpandSlots(const DecodeParams& p, uint32_t head_dim, DType out_dtype);
absl::Status LaunchDecodeKeys(cudaStream_t stream, const Tile* tiles, size_t num_tiles,
                              const void* in, DType in_dtype, uint32_t head_dim,
                              const float* scales, bool int8, void* out, DType out_dtype);

}  // namespace codec_cuda
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_CODEC_KERNELS_CUH_
