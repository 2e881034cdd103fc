// CUDA decode attention over a compressed layer (kept tokens ragged per kv head) plus the evicted
// set's MomentKV virtual token. A partial kernel and a combine kernel:
//   Partial kernels: grid (chunks [+ virtual CTAs], kv heads, row blocks). A CTA takes a chunk of
//     one kv head's kept tokens and ALL the query rows of that head's GQA group (q heads x
//     queries, up to kRows per row block), so each kept key and value is read from memory once;
//     the next tiles' loads are issued before the current tile is computed. It keeps an online
//     softmax (max, sum, fp32 accumulator) per row and writes it as a partial. Three forms:
//     DecodeMmaKernel (16-bit K/V, head_dim <= 128, at most kMmaRows rows: tensor cores),
//     DecodePartialKernel (16-bit K/V, other head_dims, at most kDecodeRows rows: CUDA cores,
//     16-bit tiles) and AttentionPartialKernel (the rest: fp32 tiles). With moments,
//     VirtualCtas(d) more CTAs per (kv head, row block) compute the virtual token of every row of
//     the block (logit t q.mu_k + ln n, value mu_v + t C q; the d x d summary read once per
//     block, not per row) and write it as one more partial, in parallel with the kept tokens'
//     CTAs.
//   AttentionCombineKernel: grid (rows, kv heads). Merges the partials of a row, writes out.
#ifndef KVCOMP_KERNELS_SRC_CUDA_ATTENTION_KERNELS_CUH_
#define KVCOMP_KERNELS_SRC_CUDA_ATTENTION_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../env_switch.h"
#include "chunk_plan.h"
#include "codec_kernels.cuh"
#include "moments_kernels.cuh"

namespace kvcomp {
namespace attention_cuda {

using moments_cuda::CpAsync16;
using moments_cuda::CpAsyncCommit;
using moments_cuda::CpAsyncWait;
using codec_cuda::FromF;
using moments_cuda::ToFloat;

constexpr int kThreads = 256;
constexpr int kKeys = 32;  // kept tokens per shared-memory tile (one per lane)

struct AttentionKernelParams {
  const void* q = nullptr;  // [Hq, nq, D], strides below
  uint64_t q_token_stride = 0, q_head_stride = 0;
  uint32_t nq = 0;
  uint32_t group = 0;          // q heads per kv head
  const void* keys = nullptr;  // ragged [total kept, D]
  const void* values = nullptr;
  const uint64_t* offsets = nullptr;  // [Hk + 1], device
  uint64_t chunk = 0;                 // kept tokens per CTA
  uint32_t chunks = 0;
  uint32_t slots = 0;  // partials per row: chunks, + 1 for the virtual token (VirtualCtas CTAs)
  float scale = 0.0f;
  // Partials [Hk][row][slot]: max, sum, acc[D].
  float* part_max = nullptr;
  float* part_sum = nullptr;
  float* part_acc = nullptr;
  // Combine.
  const unsigned long long* count = nullptr;  // null: no virtual token
  const float* key_sum = nullptr;
  const float* value_sum = nullptr;
  const float* vk_sum = nullptr;
  float* out = nullptr;  // [Hq, nq, D]
};

// Row stride of the fp32 key tile: padded by 4 floats so that each lane's row starts 16-byte
// aligned and the quarter-warps of a 16-byte load hit distinct banks.
template <int D>
constexpr int KeyTileStride() {
  return D + 4;
}

template <int D>
constexpr size_t PartialSmemBytes() {
  // q [kRows][D], K [kKeys][D+4], V [kKeys][D], P [kRows][kKeys], acc [kRows][D], max/sum/scale
  return sizeof(float) * (size_t{kRows} * D + size_t{kKeys} * KeyTileStride<D>() +
                          size_t{kKeys} * D +
                          size_t{kRows} * kKeys + size_t{kRows} * D + 3 * kRows);
}

// One tile's step of a row's online softmax: the old running max, the new one and the tile's
// sum of exp(logit - new max) give the factor on the earlier sums and accumulator, the new sum
// and the new max.
__device__ __forceinline__ void AdvanceRow(float old_max, float new_max, float tile_sum,
                                           float* scale, float* sum, float* max) {
  const float c = old_max == -INFINITY ? 0.0f : __expf(old_max - new_max);
  *scale = c;
  *sum = *sum * c + tile_sum;
  *max = new_max;
}

template <typename Q>
__device__ __forceinline__ const Q* QRow(const AttentionKernelParams& p, uint32_t kv_head,
                                         uint32_t row) {
  const uint32_t g = kv_head * p.group + row / p.nq, i = row % p.nq;
  return static_cast<const Q*>(p.q) + g * p.q_head_stride + uint64_t{i} * p.q_token_stride;
}

// The virtual token of the evicted set for every row of one (kv head, row block), as a partial
// of weight 1 at logit le: max = le, sum = 1, acc = ve. Computed in double where the CPU twin
// is. VirtualCtas(D) CTAs share it, each kVirtualCols columns of C q: thread (x, g) walks row x
// of the d x d summary once for the rows g, g + groups, ... of the block (up to 8 each, their
// products in registers; groups = blockDim / kVirtualCols), so the summary's rows are read once
// per CTA and the walk is a few L2 round trips long. smem: at least kRows * (D + 4) floats.
// Any multiple of 32 threads from 128 to 256.
template <int D>
constexpr size_t VirtualSmemBytes() {
  return size_t{kRows} * (D + 4) * sizeof(float);
}

template <typename Q, int D>
__device__ void VirtualTokenPartial(const AttentionKernelParams& p, uint32_t h, uint32_t row0,
                                    int rows, float* qs, int part) {
  constexpr int kLd = D + 4;  // padded: the row groups' 16-byte reads hit distinct banks
  const uint32_t rows_total = p.group * p.nq;
  const unsigned long long n = p.count[h];
  __shared__ double qmu[kRows];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint64_t slot0 = uint64_t{h} * rows_total + row0;
  const int x0 = part * kVirtualCols;
  if (n == 0) {
    for (int e = threadIdx.x; e < rows * kVirtualCols; e += blockDim.x) {
      const int r = e / kVirtualCols, x = x0 + e % kVirtualCols;
      const uint64_t slot = (slot0 + r) * p.slots + p.chunks;
      p.part_acc[slot * D + x] = 0.0f;
      if (x == 0) {
        p.part_max[slot] = -INFINITY;
        p.part_sum[slot] = 0.0f;
      }
    }
    return;
  }
  for (int e = threadIdx.x; e < kRows * D; e += blockDim.x) {
    const int r = e / D, x = e % D;
    qs[r * kLd + x] = r < rows ? ToFloat(QRow<Q>(p, h, row0 + r)[x]) : 0.0f;
  }
  __syncthreads();
  const double nd = static_cast<double>(n);
  for (int r = warp; r < rows; r += blockDim.x / 32) {
    double sum = 0.0;
    for (int x = lane; x < D; x += 32) {
      sum += double{qs[r * kLd + x]} * (p.key_sum[size_t{h} * D + x] / nd);
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) qmu[r] = sum;
  }
  __syncthreads();
  const double t = p.scale;
  constexpr int kGroup = 8;
  const int groups = static_cast<int>(blockDim.x) / kVirtualCols;
  const int x = x0 + static_cast<int>(threadIdx.x) / groups, g = threadIdx.x % groups;
  const float* srow = p.vk_sum + (size_t{h} * D + x) * D;
  const double mu_v = p.value_sum[size_t{h} * D + x] / nd;
  for (int rb = g; rb < rows; rb += kGroup * groups) {
    float cq[kGroup];
#pragma unroll
    for (int i = 0; i < kGroup; ++i) cq[i] = 0.0f;
    // 32 entries of the summary row per batch, loaded together (16-byte loads; the threads of
    // one x read the same addresses).
    for (int j0 = 0; j0 < D; j0 += 32) {
      float4 sv[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) sv[u] = reinterpret_cast<const float4*>(srow + j0)[u];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int j = j0 + 4 * u;
#pragma unroll
        for (int i = 0; i < kGroup; ++i) {
          const int r = rb + groups * i;
          if (r < rows) {  // rows past `rows` stay zero and are never written
            const float4 q4 = *reinterpret_cast<const float4*>(qs + r * kLd + j);
            cq[i] = fmaf(sv[u].x, q4.x, fmaf(sv[u].y, q4.y, fmaf(sv[u].z, q4.z,
                    fmaf(sv[u].w, q4.w, cq[i]))));
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      const int r = rb + groups * i;
      if (r < rows) {
        const uint64_t slot = (slot0 + r) * p.slots + p.chunks;
        p.part_acc[slot * D + x] =
            static_cast<float>(mu_v + t * (static_cast<double>(cq[i]) / nd - mu_v * qmu[r]));
        if (x == 0) {
          p.part_max[slot] = static_cast<float>(t * qmu[r] + log(nd));
          p.part_sum[slot] = 1.0f;
        }
      }
    }
  }
}

template <typename Q, typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) AttentionPartialKernel(AttentionKernelParams p) {
  extern __shared__ __align__(16) float sm[];
  float* qs = sm;                    // [kRows][D], pre-scaled
  constexpr int kStride = KeyTileStride<D>();
  float* kt = qs + kRows * D;        // [kKeys][kStride]
  float* vt = kt + kKeys * kStride;  // [kKeys][D]
  float* pr = vt + kKeys * D;        // [kRows][kKeys]
  float* acc = pr + kRows * kKeys;   // [kRows][D]
  float* rmax = acc + kRows * D;     // [kRows]
  float* rsum = rmax + kRows;
  float* rscale = rsum + kRows;

  const uint32_t h = blockIdx.y;
  const uint32_t rows_total = p.group * p.nq;
  const uint32_t row0 = blockIdx.z * kRows;
  const int rows = static_cast<int>(min(static_cast<uint32_t>(kRows), rows_total - row0));
  if (blockIdx.x >= p.chunks) {
    VirtualTokenPartial<Q, D>(p, h, row0, rows, qs, blockIdx.x - p.chunks);
    return;
  }
  const uint64_t a = p.offsets[h], b = p.offsets[h + 1];
  const uint64_t begin = min(b, a + blockIdx.x * p.chunk), end = min(b, begin + p.chunk);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  for (int e = threadIdx.x; e < kRows * D; e += kThreads) {
    const int r = e / D, x = e % D;
    qs[e] = r < rows ? ToFloat(QRow<Q>(p, h, row0 + r)[x]) * p.scale : 0.0f;
    acc[e] = 0.0f;
  }
  if (threadIdx.x < kRows) {
    rmax[threadIdx.x] = -INFINITY;
    rsum[threadIdx.x] = 0.0f;
  }
  __syncthreads();

  const T* kg = static_cast<const T*>(p.keys);
  const T* vg = static_cast<const T*>(p.values);
  // 16-byte loads, converted to fp32 in shared memory; tile i + 1's loads are in flight while
  // tile i is computed.
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kLoads = kKeys * D / kVec / kThreads;
  uint4 kx[kLoads], vx[kLoads];
  auto load_tile = [&](uint64_t t0) {
    const int m = static_cast<int>(min(static_cast<uint64_t>(kKeys), end - t0));
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int e = (threadIdx.x + u * kThreads) * kVec;
      const int j = e / D;
      kx[u] = vx[u] = make_uint4(0, 0, 0, 0);
      if (j < m) {
        kx[u] = __ldcs(reinterpret_cast<const uint4*>(kg + (t0 + j) * D + e % D));
        vx[u] = __ldcs(reinterpret_cast<const uint4*>(vg + (t0 + j) * D + e % D));
      }
    }
  };
  if (begin < end) load_tile(begin);
  for (uint64_t t0 = begin; t0 < end; t0 += kKeys) {
    const int m = static_cast<int>(min(static_cast<uint64_t>(kKeys), end - t0));
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int e = (threadIdx.x + u * kThreads) * kVec;
      const int j = e / D, x = e % D;
      const T* kv = reinterpret_cast<const T*>(&kx[u]);
      const T* vv = reinterpret_cast<const T*>(&vx[u]);
#pragma unroll
      for (int w = 0; w < kVec; ++w) {
        kt[j * kStride + x + w] = ToFloat(kv[w]);
        vt[e + w] = ToFloat(vv[w]);
      }
    }
    if (t0 + kKeys < end) load_tile(t0 + kKeys);
    __syncthreads();
    // Logits and online softmax: warp w takes rows w, w+8, ...; lane j takes key j.
    for (int r = warp; r < rows; r += kThreads / 32) {
      float l = -INFINITY;
      if (lane < m) {
        // 16-byte shared loads: the query row is a broadcast, each lane's key row its own.
        const float4* qr = reinterpret_cast<const float4*>(qs + r * D);
        const float4* kr = reinterpret_cast<const float4*>(kt + lane * kStride);
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll 8
        for (int x = 0; x < D / 4; x += 2) {
          const float4 q0 = qr[x], k0 = kr[x], q1 = qr[x + 1], k1 = kr[x + 1];
          s0 = fmaf(q0.x, k0.x, fmaf(q0.y, k0.y, fmaf(q0.z, k0.z, fmaf(q0.w, k0.w, s0))));
          s1 = fmaf(q1.x, k1.x, fmaf(q1.y, k1.y, fmaf(q1.z, k1.z, fmaf(q1.w, k1.w, s1))));
        }
        l = s0 + s1;
      }
      float mx = l;
#pragma unroll
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float old = rmax[r];
      const float nmax = fmaxf(old, mx);
      const float w = lane < m ? __expf(l - nmax) : 0.0f;
      float s = w;
#pragma unroll
      for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
      pr[r * kKeys + lane] = w;
      if (lane == 0) AdvanceRow(old, nmax, s, &rscale[r], &rsum[r], &rmax[r]);
    }
    __syncthreads();
    // Four columns per thread (16-byte loads of the value rows; the weights are broadcasts).
    for (int e = threadIdx.x; e < rows * (D / 4); e += kThreads) {
      const int r = e / (D / 4), x = (e % (D / 4)) * 4;
      const float c = rscale[r];
      float4 s = reinterpret_cast<const float4*>(acc)[e];
      s.x *= c;
      s.y *= c;
      s.z *= c;
      s.w *= c;
      const float* pw = pr + r * kKeys;
#pragma unroll 8
      for (int j = 0; j < kKeys; ++j) {
        const float pj = pw[j];
        const float4 v = *reinterpret_cast<const float4*>(vt + j * D + x);
        s.x = fmaf(pj, v.x, s.x);
        s.y = fmaf(pj, v.y, s.y);
        s.z = fmaf(pj, v.z, s.z);
        s.w = fmaf(pj, v.w, s.w);
      }
      reinterpret_cast<float4*>(acc)[e] = s;
    }
    __syncthreads();
  }
  // Partials of (h, row, chunk).
  for (int e = threadIdx.x; e < rows * D; e += kThreads) {
    const int r = e / D, x = e % D;
    const uint64_t slot = (uint64_t{h} * rows_total + row0 + r) * p.slots + blockIdx.x;
    p.part_acc[slot * D + x] = acc[e];
    if (x == 0) {
      p.part_max[slot] = rmax[r];
      p.part_sum[slot] = rsum[r];
    }
  }
}

// --- Decode steps: few query rows per kv head ----------------------------------------------
// A decode step has group x nq <= kDecodeRows rows per kv head (4 for one query under GQA 4), so
// the work per kept token is small and the kernel must stream K and V at the memory's pace.
// DecodePartialKernel (16-bit K/V): 128 threads; tiles of kDecodeTile(D) kept tokens are copied
// global -> shared as they are (cp.async, three stages, no conversion pass), so two tiles are in
// flight while one is computed. Logits: kDecodeSplit(D) threads per key, each a slice of the head
// dimension for every row; online softmax by one warp per row; values: each thread two columns
// of every row of its row group. Same partials as AttentionPartialKernel (fp32 products).
// (kDecodeRows and kDecodeCtasPerSm: chunk_plan.h, with the chunking.)
constexpr int kDecodeThreads = 128;
constexpr int kDecodeStages = 3;
template <int D>
constexpr int DecodeTile() {
  return 32;
}
template <int D>
constexpr int DecodeSplit() {
  return kDecodeThreads / DecodeTile<D>();
}
template <typename T, int D>
constexpr int DecodeKeyStride() {  // padded: the logit pass's 16-byte reads avoid bank conflicts
  return D + 16 / static_cast<int>(sizeof(T));
}
template <typename T, int D>
constexpr size_t DecodeSmemBytes() {
  constexpr size_t tile = DecodeTile<D>();
  const size_t stages = kDecodeStages * tile * (DecodeKeyStride<T, D>() + D) * sizeof(T);
  const size_t q = size_t{kDecodeRows} * D * sizeof(float);
  const size_t logits = size_t{DecodeSplit<D>()} * kDecodeRows * tile * sizeof(float);
  const size_t state = 3 * kDecodeRows * sizeof(float);
  const size_t total = stages + q + logits + state;
  return std::max(total, VirtualSmemBytes<D>());
}


template <typename Q, typename T, int D>
__global__ void __launch_bounds__(kDecodeThreads, kDecodeCtasPerSm)
    DecodePartialKernel(AttentionKernelParams p) {
  ptx::LaunchDependents();  // the combine's few CTAs may be placed now; they wait in-kernel
  constexpr int kTile = DecodeTile<D>();
  constexpr int kSplit = DecodeSplit<D>();
  constexpr int kSlice = D / kSplit;                 // head dims per logit thread
  constexpr int kLd = DecodeKeyStride<T, D>();
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kGroups = kDecodeThreads / (D / 2);  // row groups of the value pass
  constexpr int kRowsPer = kDecodeRows / kGroups;
  static_assert(kDecodeRows % kGroups == 0 && kGroups >= 1, "rows split evenly");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* kst = reinterpret_cast<T*>(smem_raw);                 // [stages][kTile][kLd]
  T* vst = kst + kDecodeStages * kTile * kLd;              // [stages][kTile][D]
  float* qs = reinterpret_cast<float*>(vst + kDecodeStages * kTile * D);  // [rows][D]
  float* lg = qs + kDecodeRows * D;                        // [kSplit][rows][kTile]
  float* rmax = lg + kSplit * kDecodeRows * kTile;
  float* rsum = rmax + kDecodeRows;
  float* rscale = rsum + kDecodeRows;

  const uint32_t h = blockIdx.y;
  const uint32_t rows_total = p.group * p.nq;  // <= kDecodeRows (the launcher's choice)
  const int rows = static_cast<int>(rows_total);
  if (blockIdx.x >= p.chunks) {
    VirtualTokenPartial<Q, D>(p, h, 0, rows, reinterpret_cast<float*>(smem_raw),
                              blockIdx.x - p.chunks);
    return;
  }
  const uint64_t a = p.offsets[h], b = p.offsets[h + 1];
  const uint64_t begin = min(b, a + blockIdx.x * p.chunk), end = min(b, begin + p.chunk);
  const T* kg = static_cast<const T*>(p.keys);
  const T* vg = static_cast<const T*>(p.values);
  const int tiles = static_cast<int>((end - begin + kTile - 1) / kTile);

  auto issue = [&](int i) {
    const uint64_t t0 = begin + uint64_t{kTile} * i;
    const int m = static_cast<int>(min(static_cast<uint64_t>(kTile), end - t0));
    T* ks = kst + (i % kDecodeStages) * kTile * kLd;
    T* vs = vst + (i % kDecodeStages) * kTile * D;
    constexpr int kPieces = kTile * D / kVec;
    for (int e = threadIdx.x; e < kPieces; e += kDecodeThreads) {
      const int j = e / (D / kVec), c = (e % (D / kVec)) * kVec;
      const bool in = j < m;
      const uint64_t row = in ? t0 + j : begin;
      CpAsync16(ks + j * kLd + c, kg + row * D + c, in ? 16 : 0);
      CpAsync16(vs + j * D + c, vg + row * D + c, in ? 16 : 0);
    }
  };
#pragma unroll
  for (int st = 0; st < kDecodeStages - 1; ++st) {
    if (st < tiles) issue(st);
    CpAsyncCommit();
  }
  for (int e = threadIdx.x; e < kDecodeRows * D; e += kDecodeThreads) {
    const int r = e / D, x = e % D;
    qs[e] = r < rows ? ToFloat(QRow<Q>(p, h, r)[x]) * p.scale : 0.0f;
  }
  if (threadIdx.x < kDecodeRows) {
    rmax[threadIdx.x] = -INFINITY;
    rsum[threadIdx.x] = 0.0f;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Value pass: columns c, c + 1 of rows g, g + kGroups, ...
  const int vc = (threadIdx.x % (D / 2)) * 2, vg0 = threadIdx.x / (D / 2);
  float acc[kRowsPer][2];
#pragma unroll
  for (int i = 0; i < kRowsPer; ++i) acc[i][0] = acc[i][1] = 0.0f;
  // Logit pass: key kj, head dims [ks0, ks0 + kSlice).
  const int kj = threadIdx.x % kTile, ks0 = (threadIdx.x / kTile) * kSlice;

  for (int i = 0; i < tiles; ++i) {
    const uint64_t t0 = begin + uint64_t{kTile} * i;
    const int m = static_cast<int>(min(static_cast<uint64_t>(kTile), end - t0));
    CpAsyncWait<kDecodeStages - 2>();
    __syncthreads();  // tile i landed everywhere; tile i - 1's stage is free
    if (i + kDecodeStages - 1 < tiles) issue(i + kDecodeStages - 1);
    CpAsyncCommit();
    const T* ks = kst + (i % kDecodeStages) * kTile * kLd;
    const T* vs = vst + (i % kDecodeStages) * kTile * D;
    // Partial logits of key kj over this thread's slice, every row.
    {
      float part[kDecodeRows];
#pragma unroll
      for (int r = 0; r < kDecodeRows; ++r) part[r] = 0.0f;
      const T* krow = ks + kj * kLd + ks0;
#pragma unroll 4
      for (int x = 0; x < kSlice; x += kVec) {
        const uint4 raw = *reinterpret_cast<const uint4*>(krow + x);
        const T* kv = reinterpret_cast<const T*>(&raw);
        float kf[kVec];
#pragma unroll
        for (int w = 0; w < kVec; ++w) kf[w] = ToFloat(kv[w]);
#pragma unroll
        for (int r = 0; r < kDecodeRows; ++r) {
          if (r < rows) {
            const float4 q0 = *reinterpret_cast<const float4*>(qs + r * D + ks0 + x);
            const float4 q1 = *reinterpret_cast<const float4*>(qs + r * D + ks0 + x + 4);
            part[r] = fmaf(q0.x, kf[0], fmaf(q0.y, kf[1], fmaf(q0.z, kf[2], fmaf(q0.w, kf[3],
                      fmaf(q1.x, kf[4], fmaf(q1.y, kf[5], fmaf(q1.z, kf[6],
                      fmaf(q1.w, kf[7], part[r]))))))));
          }
        }
      }
      float* out = lg + (threadIdx.x / kTile) * kDecodeRows * kTile + kj;
#pragma unroll
      for (int r = 0; r < kDecodeRows; ++r) {
        if (r < rows) out[r * kTile] = part[r];
      }
    }
    __syncthreads();
    // Online softmax: warp w takes rows w, w + 4; lane l keys l, l + 32.
    for (int r = warp; r < rows; r += kDecodeThreads / 32) {
      float l[kTile / 32];
      float mx = -INFINITY;
#pragma unroll
      for (int u = 0; u < kTile / 32; ++u) {
        const int j = lane + 32 * u;
        float v = -INFINITY;
        if (j < m) {
          v = 0.0f;
#pragma unroll
          for (int sp = 0; sp < kSplit; ++sp) v += lg[(sp * kDecodeRows + r) * kTile + j];
        }
        l[u] = v;
        mx = fmaxf(mx, v);
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float old = rmax[r];
      const float nmax = fmaxf(old, mx);
      float sum = 0.0f;
#pragma unroll
      for (int u = 0; u < kTile / 32; ++u) {
        const int j = lane + 32 * u;
        const float w = j < m ? __expf(l[u] - nmax) : 0.0f;
        lg[r * kTile + j] = w;  // split 0's slot of (r, j): read above by this lane only
        sum += w;
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (lane == 0) AdvanceRow(old, nmax, sum, &rscale[r], &rsum[r], &rmax[r]);
    }
    __syncthreads();
    // Values: acc(row, c..c+1) = acc * scale + sum_j w(row, j) v(j, c..c+1).
#pragma unroll
    for (int ri = 0; ri < kRowsPer; ++ri) {
      const int r = vg0 + kGroups * ri;
      if (r < rows) {
        const float c = rscale[r];
        acc[ri][0] *= c;
        acc[ri][1] *= c;
      }
    }
    for (int j = 0; j < m; j += 4) {
      float2 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const T* vr = vs + (j + u) * D + vc;  // rows past m are zero-filled
        v[u] = make_float2(ToFloat(vr[0]), ToFloat(vr[1]));
      }
#pragma unroll
      for (int ri = 0; ri < kRowsPer; ++ri) {
        const int r = vg0 + kGroups * ri;
        if (r < rows) {
          const float4 w = *reinterpret_cast<const float4*>(lg + r * kTile + j);
          acc[ri][0] = fmaf(w.x, v[0].x, fmaf(w.y, v[1].x, fmaf(w.z, v[2].x,
                       fmaf(w.w, v[3].x, acc[ri][0]))));
          acc[ri][1] = fmaf(w.x, v[0].y, fmaf(w.y, v[1].y, fmaf(w.z, v[2].y,
                       fmaf(w.w, v[3].y, acc[ri][1]))));
        }
      }
    }
  }
  CpAsyncWait<0>();
  __syncthreads();
  // Partials of (h, row, chunk); an empty chunk writes max -inf, sum 0.
#pragma unroll
  for (int ri = 0; ri < kRowsPer; ++ri) {
    const int r = vg0 + kGroups * ri;
    if (r < rows) {
      const uint64_t slot = (uint64_t{h} * rows_total + r) * p.slots + blockIdx.x;
      p.part_acc[slot * D + vc] = acc[ri][0];
      p.part_acc[slot * D + vc + 1] = acc[ri][1];
      if (vc == 0) {
        p.part_max[slot] = rmax[r];
        p.part_sum[slot] = rsum[r];
      }
    }
  }
}

// --- Decode steps on tensor cores ----------------------------------------------------------
// For 16-bit K/V with head_dim <= 128 and at most kMmaRows query rows per kv head (a decode step,
// or a few speculative queries per q head under GQA), DecodeMmaKernel computes both products on
// tensor cores (mma.sync m16n8k16, f32 accumulators): the rows are the M side (16 per m-tile,
// rows past the group's zero), the kept tokens the N side of the logits and the K side of P V,
// so a token costs a few instructions per warp instead of a hundred CUDA-core products.
// 128 threads; 64-token tiles of K and V copied global -> shared as they are (cp.async, three
// stages: two tiles in flight while one is computed), each row's 16-byte chunks XOR-swizzled by
// its low three bits so that the ldmatrix loads hit distinct banks. Warp w takes m-tile
// w % mtiles and the 16-token steps w / mtiles, w / mtiles + 4 / mtiles, ... of every tile with
// an online softmax of its own (the accumulator rescaled only when a row's max moves); the
// warps' states are merged through shared memory at the end and written as one partial per
// (row, chunk), the same partials as the other kernels'.
// Precision: the softmax weights enter P V as a pair of 16-bit values p = hi + lo (two
// products), f32 queries enter the logits as such a pair too, so both products carry about 16
// more bits than the 16-bit type; f16 query rows are first scaled by a power of two into f16's
// range (exact), which the logits' scale undoes.
// (kMmaRows, kMmaTile and kMmaCtasPerSm: chunk_plan.h, with the chunking.)
constexpr int kMmaStages = 3;
constexpr int kMmaWarps = kDecodeThreads / 32;

template <int D>
constexpr size_t MmaSmemBytes() {
  // K and V stages (16-bit); the end-of-chunk merge (f32 [warp][16][D], max and sum [warp][16])
  // and the virtual token's CTA reuse them; then the rows' logit scales.
  constexpr size_t stages = size_t{kMmaStages} * kMmaTile * D * 2 * 2;
  constexpr size_t merge = size_t{kMmaWarps} * 16 * (D + 2) * sizeof(float);
  constexpr size_t reused = std::max(stages, std::max(merge, VirtualSmemBytes<D>()));
  return reused + kMmaRows * sizeof(float);
}

// Element offset of 16-byte chunk c of row r in a [rows][D] tile of 16-bit elements whose chunks
// are XOR-swizzled by the row's low three bits.
template <int D>
__device__ __forceinline__ int Swizzled(int r, int c) {
  return r * D + ((c ^ (r & 7)) << 3);
}

// Two 16-bit values as the pair of an mma operand register (`first` in the low half).
template <typename T>
__device__ __forceinline__ uint32_t PackPair(T first, T second) {
  return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&first)) |
         (static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&second)) << 16);
}

template <typename Q, typename T, int D>
__global__ void __launch_bounds__(kDecodeThreads, kMmaCtasPerSm)
    DecodeMmaKernel(AttentionKernelParams p) {
  ptx::LaunchDependents();  // the combine's few CTAs may be placed now; they wait in-kernel
  static_assert(D == 64 || D == 128, "the accumulators of 16 rows x D columns stay in registers");
  constexpr bool kPairQ = !std::is_same<Q, T>::value;  // f32 queries: hi + lo
  constexpr bool kHalf = std::is_same<T, __half>::value;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kSteps = D / 16;  // k-steps of the logits, column pairs of P V
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* kst = reinterpret_cast<T*>(smem_raw);      // [stages][kMmaTile][D], swizzled
  T* vst = kst + kMmaStages * kMmaTile * D;     // [stages][kMmaTile][D], swizzled
  float* row_scale = reinterpret_cast<float*>(smem_raw + MmaSmemBytes<D>()) - kMmaRows;

  const uint32_t h = blockIdx.y;
  const int rows = static_cast<int>(p.group * p.nq);  // <= kMmaRows (the launcher's choice)
  if (blockIdx.x >= p.chunks) {
    VirtualTokenPartial<Q, D>(p, h, 0, rows, reinterpret_cast<float*>(smem_raw),
                              blockIdx.x - p.chunks);
    return;
  }
  const int mtiles = rows > 16 ? 2 : 1;
  const int groups = kMmaWarps / mtiles;  // warps per m-tile
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int mt = warp % mtiles, group = warp / mtiles;
  const uint64_t a = p.offsets[h], b = p.offsets[h + 1];
  const uint64_t begin = min(b, a + blockIdx.x * p.chunk), end = min(b, begin + p.chunk);
  const int tiles = static_cast<int>((end - begin + kMmaTile - 1) / kMmaTile);
  const T* kg = static_cast<const T*>(p.keys);
  const T* vg = static_cast<const T*>(p.values);

  auto issue = [&](int i) {
    const uint64_t t0 = begin + uint64_t{kMmaTile} * i;
    const int m = static_cast<int>(min(static_cast<uint64_t>(kMmaTile), end - t0));
    T* ks = kst + (i % kMmaStages) * kMmaTile * D;
    T* vs = vst + (i % kMmaStages) * kMmaTile * D;
    for (int e = threadIdx.x; e < kMmaTile * kChunks; e += kDecodeThreads) {
      const int j = e / kChunks, c = e % kChunks;
      const bool in = j < m;  // rows past the chunk are zero-filled
      const uint64_t row = in ? t0 + j : begin;
      CpAsync16(ks + Swizzled<D>(j, c), kg + row * D + c * 8, in ? 16 : 0);
      CpAsync16(vs + Swizzled<D>(j, c), vg + row * D + c * 8, in ? 16 : 0);
    }
  };
#pragma unroll
  for (int st = 0; st < kMmaStages - 1; ++st) {
    if (st < tiles) issue(st);
    CpAsyncCommit();
  }

  // The queries, as 16-bit hi (and lo) parts, staged in the last stage's K buffer (not issued
  // to before the loop's first barrier), then held in registers as A fragments.
  T* q_hi = kst + (kMmaStages - 1) * kMmaTile * D;  // [kMmaRows][D], swizzled
  T* q_lo = q_hi + kMmaRows * D;
  for (int r = warp; r < kMmaRows; r += kMmaWarps) {
    const Q* qr = r < rows ? QRow<Q>(p, h, static_cast<uint32_t>(r)) : nullptr;
    int e2 = 0;
    if (kHalf && qr != nullptr) {
      float mx = 0.0f;
      for (int x = lane; x < D; x += 32) mx = fmaxf(mx, fabsf(ToFloat(qr[x])));
#pragma unroll
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      if (mx > 0.0f && mx <= 3.0e38f) e2 = ilogbf(mx) - 13;  // largest |q| in [2^13, 2^14)
    }
    if (lane == 0) row_scale[r] = ldexpf(p.scale, e2);
    for (int x = lane; x < D; x += 32) {
      const float v = qr != nullptr ? ldexpf(ToFloat(qr[x]), -e2) : 0.0f;
      const T hi = FromF<T>(v);
      q_hi[Swizzled<D>(r, x / 8) + x % 8] = hi;
      if (kPairQ) q_lo[Swizzled<D>(r, x / 8) + x % 8] = FromF<T>(v - ToFloat(hi));
    }
  }
  __syncthreads();
  const int mi = lane / 8;  // the 8x8 matrix whose row address this lane gives to ldmatrix
  uint32_t qa[kSteps][4], qb[kPairQ ? kSteps : 1][4];
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    const int off = Swizzled<D>(16 * mt + lane % 8 + 8 * (mi % 2), 2 * kk + mi / 2);
    ptx::LdMatrixX4(qa[kk], q_hi + off);
    if constexpr (kPairQ) ptx::LdMatrixX4(qb[kk], q_lo + off);
  }
  const int g = lane / 4;  // this lane's rows g and g + 8 of the m-tile
  const float scale0 = row_scale[16 * mt + g], scale1 = row_scale[16 * mt + g + 8];

  float acc[2 * kSteps][4];  // O[16 rows][D]: block n holds columns 8n .. 8n + 7
#pragma unroll
  for (int n = 0; n < 2 * kSteps; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float max0 = -INFINITY, max1 = -INFINITY, sum0 = 0.0f, sum1 = 0.0f;

  for (int i = 0; i < tiles; ++i) {
    CpAsyncWait<kMmaStages - 2>();
    __syncthreads();  // tile i landed everywhere; tile i - 1's stage is free
    if (i + kMmaStages - 1 < tiles) issue(i + kMmaStages - 1);
    CpAsyncCommit();
    const int m = static_cast<int>(
        min(static_cast<uint64_t>(kMmaTile), end - begin - uint64_t{kMmaTile} * i));
    const T* ks = kst + (i % kMmaStages) * kMmaTile * D;
    const T* vs = vst + (i % kMmaStages) * kMmaTile * D;
    for (int j0 = 16 * group; j0 < m; j0 += 16 * groups) {
      // Logits of the m-tile's rows against tokens j0 .. j0 + 15 (two blocks of 8).
      float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk) {
        uint32_t kb[4];
        ptx::LdMatrixX4(kb, ks + Swizzled<D>(j0 + lane % 8 + 8 * (mi / 2), 2 * kk + mi % 2));
        ptx::Mma16<T>(s[0], qa[kk], kb[0], kb[1]);
        ptx::Mma16<T>(s[1], qa[kk], kb[2], kb[3]);
        if constexpr (kPairQ) {
          ptx::Mma16<T>(s[0], qb[kk], kb[0], kb[1]);
          ptx::Mma16<T>(s[1], qb[kk], kb[2], kb[3]);
        }
      }
      // Online softmax of rows g (s[.][0..1]) and g + 8 (s[.][2..3]); tokens past m masked.
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool in = j0 + 8 * n + 2 * (lane % 4) + e < m;
          s[n][e] = in ? s[n][e] * scale0 : -INFINITY;
          s[n][2 + e] = in ? s[n][2 + e] * scale1 : -INFINITY;
          mx0 = fmaxf(mx0, s[n][e]);
          mx1 = fmaxf(mx1, s[n][2 + e]);
        }
      }
#pragma unroll
      for (int o = 1; o <= 2; o *= 2) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
      }
      const float new0 = fmaxf(max0, mx0), new1 = fmaxf(max1, mx1);
      const float f0 = max0 == -INFINITY ? 0.0f : __expf(max0 - new0);
      const float f1 = max1 == -INFINITY ? 0.0f : __expf(max1 - new1);
      max0 = new0;
      max1 = new1;
      float w[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          w[n][e] = __expf(s[n][e] - new0);
          w[n][2 + e] = __expf(s[n][2 + e] - new1);
        }
      }
      sum0 = sum0 * f0 + (w[0][0] + w[0][1] + w[1][0] + w[1][1]);
      sum1 = sum1 * f1 + (w[0][2] + w[0][3] + w[1][2] + w[1][3]);
      if (__any_sync(0xffffffffu, f0 != 1.0f || f1 != 1.0f)) {
#pragma unroll
        for (int n = 0; n < 2 * kSteps; ++n) {
          acc[n][0] *= f0;
          acc[n][1] *= f0;
          acc[n][2] *= f1;
          acc[n][3] *= f1;
        }
      }
      // The weights as the A operand of P V (16 rows x 16 tokens): hi, then the remainder lo.
      uint32_t pa[4], pb[4];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        T hi[4], lo[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          hi[e] = FromF<T>(w[n][e]);
          lo[e] = FromF<T>(w[n][e] - ToFloat(hi[e]));
        }
        pa[2 * n] = PackPair(hi[0], hi[1]);  // row g, tokens 2 (lane % 4), + 1 of block n
        pa[2 * n + 1] = PackPair(hi[2], hi[3]);  // row g + 8
        pb[2 * n] = PackPair(lo[0], lo[1]);
        pb[2 * n + 1] = PackPair(lo[2], lo[3]);
      }
#pragma unroll
      for (int n2 = 0; n2 < kSteps; ++n2) {
        uint32_t vb[4];
        ptx::LdMatrixX4Trans(vb, vs + Swizzled<D>(j0 + lane % 8 + 8 * (mi % 2), 2 * n2 + mi / 2));
        ptx::Mma16<T>(acc[2 * n2], pa, vb[0], vb[1]);
        ptx::Mma16<T>(acc[2 * n2 + 1], pa, vb[2], vb[3]);
        ptx::Mma16<T>(acc[2 * n2], pb, vb[0], vb[1]);
        ptx::Mma16<T>(acc[2 * n2 + 1], pb, vb[2], vb[3]);
      }
    }
  }
  CpAsyncWait<0>();
#pragma unroll
  for (int o = 1; o <= 2; o *= 2) {
    sum0 += __shfl_xor_sync(0xffffffffu, sum0, o);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, o);
  }
  __syncthreads();  // every stage consumed: the merge reuses them
  float* mo = reinterpret_cast<float*>(smem_raw);  // [warp][16][D]
  float* mmax = mo + kMmaWarps * 16 * D;            // [warp][16]
  float* msum = mmax + kMmaWarps * 16;
#pragma unroll
  for (int n = 0; n < 2 * kSteps; ++n) {
    const int c = 8 * n + 2 * (lane % 4);
    *reinterpret_cast<float2*>(mo + (warp * 16 + g) * D + c) = make_float2(acc[n][0], acc[n][1]);
    *reinterpret_cast<float2*>(mo + (warp * 16 + g + 8) * D + c) =
        make_float2(acc[n][2], acc[n][3]);
  }
  if (lane % 4 == 0) {
    mmax[warp * 16 + g] = max0;
    mmax[warp * 16 + g + 8] = max1;
    msum[warp * 16 + g] = sum0;
    msum[warp * 16 + g + 8] = sum1;
  }
  __syncthreads();
  // Partials of (h, row, chunk): the warps of a row's m-tile merged; an empty chunk writes max
  // -inf, sum 0.
  for (int e = threadIdx.x; e < rows * D; e += kDecodeThreads) {
    const int row = e / D, x = e % D, t = row / 16, r = row % 16;
    float mx = -INFINITY;
    for (int w = t; w < kMmaWarps; w += mtiles) mx = fmaxf(mx, mmax[w * 16 + r]);
    float sum = 0.0f, o = 0.0f;
    if (mx != -INFINITY) {
      for (int w = t; w < kMmaWarps; w += mtiles) {
        const float c = __expf(mmax[w * 16 + r] - mx);
        sum += c * msum[w * 16 + r];
        o += c * mo[(w * 16 + r) * D + x];
      }
    }
    const uint64_t slot = (uint64_t{h} * static_cast<uint32_t>(rows) + row) * p.slots + blockIdx.x;
    p.part_acc[slot * D + x] = o;
    if (x == 0) {
      p.part_max[slot] = mx;
      p.part_sum[slot] = sum;
    }
  }
}

// One CTA per (row, kv head), D threads (64..256): the partials' weights exp(max_c - m) once into
// shared memory (in parallel over the slots), then each thread its column over the slots.
template <typename Q, int D>
__global__ void __launch_bounds__(D) AttentionCombineKernel(AttentionKernelParams p) {
  __shared__ double w[kMaxSlots];
  __shared__ double red[D / 32];
  __shared__ double bcast;
  const uint32_t h = blockIdx.y, row = blockIdx.x;
  const uint32_t rows_total = p.group * p.nq;
  const int x = threadIdx.x, warp = x / 32, lane = x % 32;
  const uint64_t slot0 = (uint64_t{h} * rows_total + row) * p.slots;
  ptx::GridDependencyWait();  // the partial kernel's slots (launched as its dependent)

  double m = -INFINITY;
  for (uint32_t c = x; c < p.slots; c += D) {
    if (p.part_sum[slot0 + c] > 0.0f) m = fmax(m, double{p.part_max[slot0 + c]});
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  if (x == 0) {
    double mm = -INFINITY;
    for (int i = 0; i < D / 32; ++i) mm = fmax(mm, red[i]);
    bcast = mm;
  }
  __syncthreads();
  m = bcast;
  double lsum = 0.0;
  for (uint32_t c = x; c < p.slots; c += D) {
    const float s = p.part_sum[slot0 + c];
    const double wc = s > 0.0f ? exp(double{p.part_max[slot0 + c]} - m) : 0.0;
    w[c] = wc;
    lsum += wc * s;
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) lsum += __shfl_xor_sync(0xffffffffu, lsum, o);
  __syncthreads();  // w[] complete; red[] free again
  if (lane == 0) red[warp] = lsum;
  __syncthreads();
  double l = 0.0;
  for (int i = 0; i < D / 32; ++i) l += red[i];
  // Eight slots' loads issued together (the partials are L2 hits; one at a time the column
  // walk is a chain of L2 latencies).
  constexpr int kBatch = 8;
  double a = 0.0;
  const float* acc = p.part_acc + slot0 * D + x;
  for (uint32_t c0 = 0; c0 < p.slots; c0 += kBatch) {
    float v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      v[u] = c0 + u < p.slots ? acc[uint64_t{c0 + u} * D] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (c0 + u < p.slots) a += w[c0 + u] * v[u];
    }
  }
  const uint32_t g = h * p.group + row / p.nq, i = row % p.nq;
  p.out[(uint64_t{g} * p.nq + i) * D + x] = l > 0.0 ? static_cast<float>(a / l) : 0.0f;
}

inline bool ProgrammaticLaunch() {
  static const bool on = internal::SwitchOn("KVCOMP_CUDA_PDL");
  return on;
}

// A decode-step partial kernel (kDecodeThreads threads, `smem` bytes of dynamic shared memory),
// then the combine as its programmatic dependent: the combine's launch overlaps the partial
// kernel's tail, and it waits for the slots in the kernel (GridDependencyWait).
// KVCOMP_CUDA_PDL=0 launches it the ordinary way (for comparisons).
template <typename Q, int D, typename Kernel>
cudaError_t LaunchDecodeKernels(Kernel partial, size_t smem, dim3 grid,
                                const AttentionKernelParams& p, uint32_t rows, uint32_t kv_heads,
                                cudaStream_t stream) {
  cudaError_t e =
      cudaFuncSetAttribute(partial, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  partial<<<grid, kDecodeThreads, smem, stream>>>(p);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  if (!ProgrammaticLaunch()) {
    AttentionCombineKernel<Q, D><<<dim3(rows, kv_heads), D, 0, stream>>>(p);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(rows, kv_heads);
  cfg.blockDim = dim3(D);
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, AttentionCombineKernel<Q, D>, p);
}

// CTAs of a partial kernel per (kv head, row block): the chunks, then the virtual token's.
template <int D>
uint32_t PartialCtas(const AttentionKernelParams& p) {
  return p.chunks + (p.slots > p.chunks ? VirtualCtas(D) : 0);
}

// p.chunk and p.chunks as PartialChunking gives them for the same rows, dtype and head_dim;
// p.slots = p.chunks, + 1 with the virtual token.
template <typename Q, typename T, int D>
cudaError_t LaunchAttention(const AttentionKernelParams& p, uint32_t kv_heads,
                            cudaStream_t stream) {
  const uint32_t rows = p.group * p.nq;
  const dim3 decode_grid(PartialCtas<D>(p), kv_heads, 1);
  if constexpr (sizeof(T) == 2 && D <= 128) {
    if (MmaDecode(rows, true, D)) {
      return LaunchDecodeKernels<Q, D>(DecodeMmaKernel<Q, T, D>, MmaSmemBytes<D>(), decode_grid,
                                       p, rows, kv_heads, stream);
    }
  }
  if constexpr (sizeof(T) == 2) {
    if (rows <= static_cast<uint32_t>(kDecodeRows)) {  // a decode step
      return LaunchDecodeKernels<Q, D>(DecodePartialKernel<Q, T, D>, DecodeSmemBytes<T, D>(),
                                       decode_grid, p, rows, kv_heads, stream);
    }
  }
  constexpr size_t smem = PartialSmemBytes<D>();
  auto partial = AttentionPartialKernel<Q, T, D>;
  if (smem > 48 * 1024) {
    cudaError_t e =
        cudaFuncSetAttribute(partial, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  const dim3 grid(PartialCtas<D>(p), kv_heads, (rows + kRows - 1) / kRows);
  partial<<<grid, kThreads, smem, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  AttentionCombineKernel<Q, D><<<dim3(rows, kv_heads), D, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attention_cuda
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_ATTENTION_KERNELS_CUH_
