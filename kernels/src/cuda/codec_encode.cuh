// The KVSplice value encoder on CUDA: projection, outlier measure, gamma, group scales and
// quantization fused in one kernel, one launch for every layer and head of a cache (each tile
// carries its layer's rank and where its latents go). The arithmetic is the CPU reference's
// (cpu/codec_cpu_internal.h: ProjectRows, EncodeRowsF32), so both write the same bytes:
//   p[i][j]   = fmaf chain over the channels k = 0 .. d - 1 in order from +0 of v[i][k] B[k][j]
//   energy[i] = the same chain of v[i][k]^2; proj = chain over j < rank of p[i][j]^2
//   lost[i]   = max(+0, energy - proj)
//   z[i][j]   = p[i][j] / gamma[j] (IEEE division) when gamma applies, then the group scale
//               and round-half-even quantization of codec_kernels.cuh
// No step sums in another order (no tree reductions, no tensor cores), so the order of the
// f32 rounding steps is fixed by the formula, not by the launch shape.
//
// Work split: a block takes kFusedRows rows of one head; 256 threads each own 4 rows x 4 latent
// directions per item (one or more items). V is staged once as f32, transposed (a channel's
// rows contiguous, so a thread's four rows are one 16-byte shared load, as its four directions
// of the basis are: two loads per 16 FMAs); the basis B = P_r^T ([d][R] of the head) streams
// through shared memory kFusedK channels at a time, and the last kFusedRows threads extend
// their row's energy chain by the same channels. The latents then take V's place in shared
// memory for the measure, gamma, the group scales and the codes.
#ifndef KVCOMP_KERNELS_SRC_CUDA_CODEC_ENCODE_CUH_
#define KVCOMP_KERNELS_SRC_CUDA_CODEC_ENCODE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "codec_kernels.cuh"

namespace kvcomp {
namespace codec_cuda {

constexpr int kFusedRows = 64;
constexpr int kFusedThreads = 256;
constexpr int kFusedK = 32;

// One head of a launch: rows [begin, begin + rows) at `rank`, its latents from byte latent_at,
// its scales from element scale_at; its tiles of kFusedRows rows are blocks
// [first_tile, first_tile + ceil(rows / kFusedRows)) of the grid. A few bytes per head, so the
// work list costs nothing to send whatever the length of the cache.
struct FusedHead {
  uint64_t begin;
  uint64_t latent_at;
  uint64_t scale_at;
  uint32_t head;  // absolute head of the projection
  uint32_t rows;
  uint32_t rank;  // 1..R
  uint32_t first_tile;
};

// One block's share of a head.
struct FusedTile {
  uint64_t begin, latent_at, scale_at;
  uint32_t head, rows, rank;
};

struct FusedParams {
  const FusedHead* heads;
  uint32_t num_heads;
  uint32_t first_block;  // grid offset of this launch
  const void* values;    // [rows][d] of T
  const float* basis_t;  // [heads][d][R] f32, B = P^T of each head
  const float* gamma;    // [heads][R], nullptr: no gamma
  uint8_t* latent;       // nullptr: the measure only
  uint16_t* scales;
  float* energy;         // nullptr: no measure
  float* lost;
  uint32_t d, R, group_size;
  LatentKind kind;
  bool vec;              // 16-byte loads of V (d * sizeof(T) % 16 == 0, values aligned)
};

__host__ __device__ inline uint32_t FusedRPad(uint32_t r) { return (r + 3u) & ~3u; }

__host__ __device__ inline uint32_t FusedLatentBytes(LatentKind kind, uint32_t r) {
  return kind == LatentKind::kF16 ? 2 * r : kind == LatentKind::kInt8 ? r : (r + 1) / 2;
}

// Block b's tile: the last head whose first tile is <= b (empty heads share the next one's).
__device__ __forceinline__ FusedTile FindTile(const FusedParams& p, uint32_t b) {
  uint32_t lo = 0, hi = p.num_heads;  // first head with first_tile > b is in [lo, hi]
  while (lo < hi) {
    const uint32_t mid = (lo + hi) / 2;
    if (p.heads[mid].first_tile <= b) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  const FusedHead h = p.heads[lo - 1];
  const uint32_t ti = b - h.first_tile;
  const uint64_t skip = static_cast<uint64_t>(ti) * kFusedRows;
  const uint32_t groups = p.kind == LatentKind::kF16 ? 0 : (h.rank + p.group_size - 1) / p.group_size;
  FusedTile t;
  t.begin = h.begin + skip;
  t.latent_at = h.latent_at + skip * FusedLatentBytes(p.kind, h.rank);
  t.scale_at = h.scale_at + skip * groups;
  t.head = h.head;
  t.rows = min(static_cast<uint32_t>(kFusedRows), static_cast<uint32_t>(h.rows - skip));
  t.rank = h.rank;
  return t;
}

// Shared memory of a launch whose largest rank is R: V transposed (later the latents), the
// basis chunk [kFusedK][FusedRPad(R)], energies, gamma and the scales of the tile. The first
// region holds V^T ([d][kVtLd]: a channel's 64 rows, four of them one 16-byte load) and then
// the latents ([kFusedRows][rpad + 1]).
constexpr uint32_t kVtLd = kFusedRows + 4;
__host__ __device__ inline uint32_t FusedFirstFloats(uint32_t d, uint32_t R) {
  const uint32_t v = d * kVtLd, z = kFusedRows * (FusedRPad(R) + 1);
  return v > z ? v : z;
}
__host__ __device__ inline size_t FusedSmemBytes(uint32_t d, uint32_t R, uint32_t groups) {
  return sizeof(float) * (static_cast<size_t>(FusedFirstFloats(d, R)) +
                          kFusedK * FusedRPad(R) + kFusedRows + R +
                          static_cast<size_t>(kFusedRows) * (groups > 0 ? groups : 1));
}

// V^T of the tile: vt[k * kVtLd + t] = v[t][k] as f32, rows past the tile zero. Consecutive
// threads take consecutive rows of one run of channels, so the transposed stores meet no bank
// conflicts (each 16-byte load is completed from L1 by the neighbouring runs).
template <typename T>
__device__ __forceinline__ void StageRows(const FusedParams& p, const FusedTile& tile,
                                          float* vt) {
  const uint32_t d = p.d;
  const T* in = static_cast<const T*>(p.values) + tile.begin * d;
  if (p.vec) {
    constexpr uint32_t kVec = 16 / sizeof(T);
    const uint32_t per_row = d / kVec;
    for (uint32_t c = threadIdx.x; c < kFusedRows * per_row; c += blockDim.x) {
      const uint32_t t = c % kFusedRows, k = (c / kFusedRows) * kVec;
      float* dst = vt + k * kVtLd + t;
      if (t < tile.rows) {
        const uint4 raw = *reinterpret_cast<const uint4*>(in + static_cast<uint64_t>(t) * d + k);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (uint32_t i = 0; i < kVec; ++i) dst[i * kVtLd] = ToF<T>(e[i]);
      } else {
#pragma unroll
        for (uint32_t i = 0; i < kVec; ++i) dst[i * kVtLd] = 0.0f;
      }
    }
    return;
  }
  for (uint32_t i = threadIdx.x; i < kFusedRows * d; i += blockDim.x) {
    const uint32_t t = i % kFusedRows, k = i / kFusedRows;
    vt[k * kVtLd + t] = t < tile.rows ? ToF<T>(in[static_cast<uint64_t>(t) * d + k]) : 0.0f;
  }
}

template <typename T, int kItems>
__global__ void __launch_bounds__(kFusedThreads) FusedEncodeKernel(FusedParams p) {
  extern __shared__ float smem[];
  const FusedTile tile = FindTile(p, p.first_block + blockIdx.x);
  const uint32_t d = p.d, r = tile.rank, rows = tile.rows;
  const uint32_t rpad_max = FusedRPad(p.R), rpad = FusedRPad(r);
  float* vt = smem;                              // [d][kVtLd]
  float* bc = vt + FusedFirstFloats(d, p.R);     // [kFusedK][rpad_max]
  float* es = bc + kFusedK * rpad_max;           // [kFusedRows]
  float* gs = es + kFusedRows;                   // [R]
  float* sc = gs + p.R;                          // [kFusedRows][groups]
  const float* basis = p.basis_t + static_cast<uint64_t>(tile.head) * d * p.R;

  StageRows<T>(p, tile, vt);
  if (p.gamma != nullptr) {
    for (uint32_t j = threadIdx.x; j < r; j += blockDim.x) {
      gs[j] = p.gamma[static_cast<uint64_t>(tile.head) * p.R + j];
    }
  }
  // The energy chains: one thread of the last kFusedRows per row, the channels in order, a
  // chunk at a time beside the projection (each step's latency hidden by the other warps).
  const uint32_t erow = threadIdx.x - (kFusedThreads - kFusedRows);
  const bool energy_thread = p.energy != nullptr && threadIdx.x >= kFusedThreads - kFusedRows &&
                             erow < rows;
  float e = 0.0f;

  // The projection: item = (row quad, direction quad), rows fastest across the lanes.
  const uint32_t quads = rpad / 4, items = (kFusedRows / 4) * quads;
  float acc[kItems][4][4];
#pragma unroll
  for (int s = 0; s < kItems; ++s) {
#pragma unroll
    for (int a = 0; a < 4; ++a) {
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[s][a][c] = 0.0f;
    }
  }
  for (uint32_t k0 = 0; k0 < d; k0 += kFusedK) {
    const uint32_t kn = min(static_cast<uint32_t>(kFusedK), d - k0);
    __syncthreads();  // the previous chunk is consumed
    for (uint32_t i = threadIdx.x; i < kn * rpad; i += blockDim.x) {
      const uint32_t kk = i / rpad, j = i - kk * rpad;
      bc[kk * rpad_max + j] = j < r ? basis[static_cast<uint64_t>(k0 + kk) * p.R + j] : 0.0f;
    }
    __syncthreads();
    if (energy_thread) {
      const float* col = vt + k0 * kVtLd + erow;
      for (uint32_t kk = 0; kk < kn; ++kk) e = fmaf(col[kk * kVtLd], col[kk * kVtLd], e);
    }
#pragma unroll
    for (int s = 0; s < kItems; ++s) {
      const uint32_t item = threadIdx.x + s * kFusedThreads;
      if (item >= items) continue;
      const uint32_t rq = item % (kFusedRows / 4), cq = item / (kFusedRows / 4);
      const float* v0 = vt + k0 * kVtLd + rq * 4;
      const float* b0 = bc + cq * 4;
#pragma unroll 4
      for (uint32_t kk = 0; kk < kn; ++kk) {
        const float4 b = *reinterpret_cast<const float4*>(b0 + kk * rpad_max);
        const float4 a4 = *reinterpret_cast<const float4*>(v0 + kk * kVtLd);
        const float a[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          acc[s][t][0] = fmaf(a[t], b.x, acc[s][t][0]);
          acc[s][t][1] = fmaf(a[t], b.y, acc[s][t][1]);
          acc[s][t][2] = fmaf(a[t], b.z, acc[s][t][2]);
          acc[s][t][3] = fmaf(a[t], b.w, acc[s][t][3]);
        }
      }
    }
  }
  if (energy_thread) es[erow] = e;
  __syncthreads();  // V is read for the last time: the latents take its place
  float* zs = vt;   // [kFusedRows][ldz]
  const uint32_t ldz = rpad_max + 1;
#pragma unroll
  for (int s = 0; s < kItems; ++s) {
    const uint32_t item = threadIdx.x + s * kFusedThreads;
    if (item >= items) continue;
    const uint32_t rq = item % (kFusedRows / 4), cq = item / (kFusedRows / 4);
#pragma unroll
    for (int t = 0; t < 4; ++t) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint32_t j = cq * 4 + c;
        if (j < r) zs[(rq * 4 + t) * ldz + j] = acc[s][t][c];
      }
    }
  }
  __syncthreads();
  // The outlier measure, one thread per row (the directions in order).
  if (p.energy != nullptr && threadIdx.x < rows) {
    float pp = 0.0f;
    const float* z = zs + threadIdx.x * ldz;
    for (uint32_t j = 0; j < r; ++j) pp = fmaf(z[j], z[j], pp);
    const float e = es[threadIdx.x];
    const float l = e - pp;
    p.energy[tile.begin + threadIdx.x] = e;
    p.lost[tile.begin + threadIdx.x] = l > 0.0f ? l : 0.0f;
  }
  if (p.latent == nullptr) return;
  if (p.gamma != nullptr) {
    __syncthreads();  // the measure read p before it is divided
    for (uint32_t i = threadIdx.x; i < rows * r; i += blockDim.x) {
      const uint32_t t = i / r, j = i - t * r;
      zs[t * ldz + j] = zs[t * ldz + j] / gs[j];
    }
    __syncthreads();
  }
  uint8_t* out = p.latent + tile.latent_at;
  if (p.kind == LatentKind::kF16) {
    uint16_t* h = reinterpret_cast<uint16_t*>(out);
    for (uint32_t i = threadIdx.x; i < rows * r; i += blockDim.x) {
      const uint32_t t = i / r, j = i - t * r;
      h[i] = __half_as_ushort(
          __float2half_rn(fminf(fmaxf(zs[t * ldz + j], -65504.0f), 65504.0f)));
    }
    return;
  }
  const int qmax = p.kind == LatentKind::kInt4 ? 7 : 127;
  const uint32_t gsz = p.group_size, groups = (r + gsz - 1) / gsz;
  for (uint32_t i = threadIdx.x; i < rows * groups; i += blockDim.x) {
    const uint32_t t = i / groups, g = i - t * groups;
    const uint32_t lo = g * gsz, hi = min(r, lo + gsz);
    float m = 0.0f;
    for (uint32_t j = lo; j < hi; ++j) m = fmaxf(m, fabsf(zs[t * ldz + j]));
    const uint16_t s = GroupScaleHalf(m, qmax);
    p.scales[tile.scale_at + i] = s;
    sc[i] = __half2float(__ushort_as_half(s));
  }
  __syncthreads();
  if (p.kind == LatentKind::kInt8) {
    for (uint32_t i = threadIdx.x; i < rows * r; i += blockDim.x) {
      const uint32_t t = i / r, j = i - t * r;
      const int q = QuantizeOne(zs[t * ldz + j], sc[t * groups + j / gsz], qmax);
      out[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
    }
  } else {
    const uint32_t half_r = r / 2;
    for (uint32_t i = threadIdx.x; i < rows * half_r; i += blockDim.x) {
      const uint32_t t = i / half_r, j = (i - t * half_r) * 2;
      const int q0 = QuantizeOne(zs[t * ldz + j], sc[t * groups + j / gsz], qmax);
      const int q1 = QuantizeOne(zs[t * ldz + j + 1], sc[t * groups + (j + 1) / gsz], qmax);
      out[i] = static_cast<uint8_t>((static_cast<uint32_t>(q0) & 15u) |
                                    ((static_cast<uint32_t>(q1) & 15u) << 4));
    }
  }
}

}  // namespace codec_cuda
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_CODEC_ENCODE_CUH_
