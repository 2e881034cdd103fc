// CUDA kernels of MomentKV summaries. One kernel does both jobs of the engine's moment stage:
//   list mode:    sums the moments of the listed (evicted) tokens of each head (gather);
//   compact mode: walks every token of each head once, copies the kept ones to the compacted
//                 output and sums the moments of the others, in the same pass over the data.
// The v k^T sum is a matrix product over tokens: each CTA stages a tile of 64 tokens of K and V
// in shared memory and accumulates V^T K on the tensor cores (fp32 accumulators) for 16-bit
// inputs: mma.sync with the kept tokens masked in registers (MomentKernelMasked, d <= 128) or
// WMMA over rows zeroed in shared memory (the other kernels); fp32 inputs take exact fp32 FMAs.
// A CTA owns a chunk of tokens of one head and one 128x128 (or dxd when d < 128) block of S, and
// adds its result to the output with atomics.
#ifndef KVCOMP_KERNELS_SRC_CUDA_MOMENTS_KERNELS_CUH_
#define KVCOMP_KERNELS_SRC_CUDA_MOMENTS_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cstdint>

#include "chunk_plan.h"
#include "ptx_primitives.cuh"

namespace kvcomp {
namespace moments_cuda {

constexpr int kThreads = 256;  // 8 warps
// CTAs per SM the moment kernel is compiled for (register budget 65536 / (256 * this)).
#ifndef KVCOMP_MOMENTS_MIN_BLOCKS
#define KVCOMP_MOMENTS_MIN_BLOCKS 2
#endif

// Shared-memory row stride of a D-wide tile: 16 bytes of padding keep the tensor-core fragment
// loads free of bank conflicts.
template <typename T, int D>
constexpr int RowStride() {
  return D + 16 / static_cast<int>(sizeof(T));
}

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

struct MomentKernelParams {
  const void* k = nullptr;
  const void* v = nullptr;
  uint64_t k_token_stride = 0, k_head_stride = 0;  // elements
  uint64_t v_token_stride = 0, v_head_stride = 0;
  uint64_t num_tokens = 0;
  uint32_t heads = 0;
  // list mode: head h sums list[list_off[h] .. list_off[h+1]); compact mode: list = kept
  // (ascending), tokens not listed are summed and listed ones copied to kept_k/kept_v rows.
  const uint32_t* list = nullptr;
  const uint64_t* list_off = nullptr;
  void* kept_k = nullptr;
  void* kept_v = nullptr;
  // Outputs (compact mode: count == nullptr means no summary, copy only).
  unsigned long long* count = nullptr;
  float* key_sum = nullptr;
  float* value_sum = nullptr;
  float* vk_sum = nullptr;
  uint64_t chunk = 0;  // list entries (list mode) or tokens (compact mode) per CTA
  // Optional: when *abort is nonzero (bad lists found by CheckLists), every CTA returns at once.
  const unsigned int* abort = nullptr;
  // Optional, compact mode: every value row is held to the data check (NaN/Inf or a squared
  // norm beyond float32); the lowest bad head * num_tokens + token is kept here (atomic min).
  unsigned long long* bad_value = nullptr;
};

// ksum / vsum += the elements of one 16-byte piece of a key row and of a value row.
template <typename T, int kVec = 16 / sizeof(T)>
__device__ __forceinline__ void AddPiece(const uint4& kx, const uint4& vx, float (&ksum)[kVec],
                                         float (&vsum)[kVec]) {
  const T* kv = reinterpret_cast<const T*>(&kx);
  const T* vv = reinterpret_cast<const T*>(&vx);
#pragma unroll
  for (int w = 0; w < kVec; ++w) {
    ksum[w] += ToFloat(kv[w]);
    vsum[w] += ToFloat(vv[w]);
  }
}

// The sum of squares of one 16-byte piece of a row.
template <typename T>
__device__ __forceinline__ float SqSum16(const uint4& x) {
  const T* e = reinterpret_cast<const T*>(&x);
  float s = 0.0f;
#pragma unroll
  for (int w = 0; w < 16 / static_cast<int>(sizeof(T)); ++w) {
    const float f = ToFloat(e[w]);
    s = fmaf(f, f, s);
  }
  return s;
}

// dst[0..8) += src[0..8) (dst 16-byte aligned): two 16-byte atomics where the architecture has
// them (sm_90), else eight scalar ones.
__device__ __forceinline__ void AtomicAdd8(float* dst, const float* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(dst), make_float4(src[0], src[1], src[2], src[3]));
  atomicAdd(reinterpret_cast<float4*>(dst) + 1, make_float4(src[4], src[5], src[6], src[7]));
#else
#pragma unroll
  for (int i = 0; i < 8; ++i) atomicAdd(dst + i, src[i]);
#endif
}

// x summed over aligned groups of kWidth lanes (a power of two <= 32); every lane must call it.
template <int kWidth>
__device__ __forceinline__ float LaneGroupSum(float x) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xFFFFFFFFu, x, o);
  return x;
}

__device__ __forceinline__ bool SquaredNormBad(float sq) { return !(sq <= 3.402823466e+38f); }

// The CTA's column sums of K and V (thread t holds kVec columns from `col`, t's column fixed by
// t % kRowVecs) added to key_sum / value_sum: lanes of a warp sharing columns first, then the
// warps in shared memory (`red`, 2 D floats), then one global atomic per column instead of one
// per thread and column. Every thread must call it; it synchronises the CTA.
template <int D, int kVec, int kRowVecs>
__device__ void FlushColumnSums(float (&ksum)[kVec], float (&vsum)[kVec], int col, float* red,
                                float* key_sum, float* value_sum) {
  for (int x = threadIdx.x; x < 2 * D; x += blockDim.x) red[x] = 0.0f;
#pragma unroll
  for (int w = 0; w < kVec; ++w) {
#pragma unroll
    for (int o = kRowVecs; o < 32; o *= 2) {
      ksum[w] += __shfl_xor_sync(0xFFFFFFFFu, ksum[w], o);
      vsum[w] += __shfl_xor_sync(0xFFFFFFFFu, vsum[w], o);
    }
  }
  __syncthreads();
  if (threadIdx.x % 32 < kRowVecs) {
#pragma unroll
    for (int w = 0; w < kVec; ++w) {
      atomicAdd(&red[col + w], ksum[w]);
      atomicAdd(&red[D + col + w], vsum[w]);
    }
  }
  __syncthreads();
  for (int x = threadIdx.x; x < 2 * D; x += blockDim.x) {
    atomicAdd(x < D ? key_sum + x : value_sum + (x - D), red[x]);
  }
}

template <int D>
struct SBlock {
  static constexpr int B = D < 128 ? D : 128;  // S block edge owned by one CTA
  static constexpr int kBlocks = D / B;        // per dimension
  static constexpr int kTiles = (B / 16) * (B / 16);
  static constexpr int kTilesPerWarp = kTiles / (kThreads / 32);
  static_assert((B / 16) % kTilesPerWarp == 0, "a warp's tiles must share a tile row");
};

// Tensor-core accumulation of S_block += V_tile^T K_tile for 16-bit T. Each warp owns a
// kWr x kWc block of 16 x 16 tiles (2 x 4 of a 128 x 128 block): per 16-token step it loads
// kWr A and kWc B fragments for kWr * kWc products (6 loads for 8 products, where a row of 8
// tiles takes 9).
template <typename T, int D>
struct MmaAccumulator {
  using Blk = SBlock<D>;
  static constexpr int kLd = RowStride<T, D>();
  static constexpr int kEdge = Blk::B / 16;           // tiles along an edge of the block
  static constexpr int kWc = kEdge >= 8 ? 4 : 2;      // a warp's tile columns
  static constexpr int kWr = Blk::kTilesPerWarp / kWc;  // and tile rows
  static constexpr int kWarpCols = kEdge / kWc;       // warps along the columns
  static_assert(kWr * kWc == Blk::kTilesPerWarp && kWr >= 1, "a warp's tiles form a block");
  static_assert((kEdge / kWr) * kWarpCols == kThreads / 32, "the warps cover the block");
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> acc[kWr][kWc];
  __device__ void Init() {
#pragma unroll
    for (int a = 0; a < kWr; ++a) {
#pragma unroll
      for (int b = 0; b < kWc; ++b) nvcuda::wmma::fill_fragment(acc[a][b], 0.0f);
    }
  }
  __device__ void Add(const T* ks, const T* vs, int bi, int bj) {
    using namespace nvcuda;
    const int warp = threadIdx.x / 32;
    const int ti0 = (warp / kWarpCols) * kWr, tj0 = (warp % kWarpCols) * kWc;
#pragma unroll
    for (int kk = 0; kk < kTileT; kk += 16) {
      // A = V^T (D x tokens): element (i, t) at vs[t * ld + i] -> column-major.
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> a[kWr];
      // B = K (tokens x D): element (t, j) at ks[t * ld + j] -> row-major.
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b[kWc];
#pragma unroll
      for (int x = 0; x < kWr; ++x) {
        wmma::load_matrix_sync(a[x], vs + kk * kLd + bi * Blk::B + (ti0 + x) * 16, kLd);
      }
#pragma unroll
      for (int y = 0; y < kWc; ++y) {
        wmma::load_matrix_sync(b[y], ks + kk * kLd + bj * Blk::B + (tj0 + y) * 16, kLd);
      }
#pragma unroll
      for (int x = 0; x < kWr; ++x) {
#pragma unroll
        for (int y = 0; y < kWc; ++y) wmma::mma_sync(acc[x][y], a[x], b[y], acc[x][y]);
      }
    }
  }
  // Adds the block to s (row-major D x D, 16-byte aligned) with atomics, staging each tile in
  // `stage` (per warp 256 floats): a lane adds 8 consecutive floats of a tile row, as two
  // 16-byte atomics on Hopper (a quarter of the atomic operations of scalar adds).
  __device__ void Flush(float* s, float* stage, int bi, int bj) {
    using namespace nvcuda;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int ti0 = (warp / kWarpCols) * kWr, tj0 = (warp % kWarpCols) * kWc;
    float* st = stage + warp * 256;
#pragma unroll
    for (int x = 0; x < kWr; ++x) {
#pragma unroll
      for (int y = 0; y < kWc; ++y) {
        wmma::store_matrix_sync(st, acc[x][y], 16, wmma::mem_row_major);
        __syncwarp();
        const int e = lane * 8;
        const int r = bi * Blk::B + (ti0 + x) * 16 + e / 16;
        const int c = bj * Blk::B + (tj0 + y) * 16 + e % 16;
        AtomicAdd8(s + r * D + c, st + e);
        __syncwarp();
      }
    }
  }
};

// Exact fp32 accumulation for fp32 inputs.
template <int D>
struct FmaAccumulator {
  using Blk = SBlock<D>;
  static constexpr int kLd = RowStride<float, D>();
  static constexpr int kPerThread = Blk::B * Blk::B / kThreads;
  float acc[kPerThread];
  __device__ void Init() {
#pragma unroll
    for (int a = 0; a < kPerThread; ++a) acc[a] = 0.0f;
  }
  __device__ void Add(const float* ks, const float* vs, int bi, int bj) {
#pragma unroll 1
    for (int t = 0; t < kTileT; ++t) {
#pragma unroll
      for (int a = 0; a < kPerThread; ++a) {
        const int e = threadIdx.x + kThreads * a;
        const int i = e / Blk::B, j = e % Blk::B;
        acc[a] += vs[t * kLd + bi * Blk::B + i] * ks[t * kLd + bj * Blk::B + j];
      }
    }
  }
  __device__ void Flush(float* s, float* /*stage*/, int bi, int bj) {
#pragma unroll
    for (int a = 0; a < kPerThread; ++a) {
      const int e = threadIdx.x + kThreads * a;
      const int i = e / Blk::B, j = e % Blk::B;
      atomicAdd(s + (bi * Blk::B + i) * D + bj * Blk::B + j, acc[a]);
    }
  }
};

template <typename T, int D>
using Accumulator = typename std::conditional<std::is_same<T, float>::value, FmaAccumulator<D>,
                                              MmaAccumulator<T, D>>::type;

// Shared memory bytes of MomentKernel<T, D>.
template <typename T, int D>
constexpr size_t MomentSmemBytes() {
  const size_t tiles = 2 * size_t{kTileT} * RowStride<T, D>() * sizeof(T);
  const size_t stage = (kThreads / 32) * 256 * sizeof(float);
  return (tiles > stage ? tiles : stage) + kTileT * sizeof(int) + 2 * sizeof(int) +
         kTileT * sizeof(float);
}

// Grid: (chunks, heads, S blocks). See the top of the file.
template <typename T, int D, bool kCompact>
__global__ void __launch_bounds__(kThreads, KVCOMP_MOMENTS_MIN_BLOCKS)
    MomentKernel(MomentKernelParams p) {
  using Blk = SBlock<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem);
  constexpr int kLd = RowStride<T, D>();
  T* vs = ks + kTileT * kLd;
  int* flags = reinterpret_cast<int*>(smem + MomentSmemBytes<T, D>() - kTileT * sizeof(int) -
                                      2 * sizeof(int) - kTileT * sizeof(float));
  int* shared_kp = flags + kTileT;  // [0]: next kept entry (relative), [1]: kept in this tile
  float* rowsq = reinterpret_cast<float*>(shared_kp + 2);  // the values' squared norms

  const uint32_t h = blockIdx.y;
  const int bi = blockIdx.z / Blk::kBlocks, bj = blockIdx.z % Blk::kBlocks;
  const bool lead = blockIdx.z == 0;  // does the copies, counts and vector sums
  const bool summarize = p.count != nullptr;
  const uint64_t l0 = p.list_off[h], l1 = p.list_off[h + 1];
  uint64_t begin, end;
  if (kCompact) {
    begin = blockIdx.x * p.chunk;
    end = min(p.num_tokens, begin + p.chunk);
  } else {
    begin = l0 + blockIdx.x * p.chunk;
    end = min(l1, begin + p.chunk);
  }
  if (begin >= end) return;
  if (kCompact && !summarize && !lead) return;
  if (p.abort != nullptr && *p.abort != 0) return;

  const T* kbase = static_cast<const T*>(p.k) + h * p.k_head_stride;
  const T* vbase = static_cast<const T*>(p.v) + h * p.v_head_stride;
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte load
  constexpr int kRowVecs = D / kVec;

  if (kCompact && threadIdx.x == 0) {  // first kept entry >= begin
    uint64_t lo = l0, hi = l1;
    while (lo < hi) {
      const uint64_t mid = (lo + hi) / 2;
      if (p.list[mid] < begin)
        lo = mid + 1;
      else
        hi = mid;
    }
    shared_kp[0] = static_cast<int>(lo - l0);
  }
  const bool check = kCompact && lead && p.bad_value != nullptr;
  if (threadIdx.x < kTileT) rowsq[threadIdx.x] = 0.0f;
  __syncthreads();
  uint64_t kp = l0 + shared_kp[0];

  Accumulator<T, D> acc;
  acc.Init();
  static_assert(kThreads % kRowVecs == 0, "a thread's columns must stay fixed");
  const int my_col = (threadIdx.x % kRowVecs) * kVec;
  float ksum[kVec], vsum[kVec];
#pragma unroll
  for (int w = 0; w < kVec; ++w) ksum[w] = vsum[w] = 0.0f;
  unsigned long long evicted = 0;

  // Thread's u-th 16-byte piece of a tile: row e / kRowVecs, column (e % kRowVecs) * kVec.
  constexpr int kLoads = kTileT * kRowVecs / kThreads;
  static_assert(kLoads <= 4 || kLoads % 4 == 0, "loads come in batches of 4");
  // Prefetching the next tile into registers while the tensor cores work measured slower on an
  // H200 (it spills at 128 registers; at 255 registers one CTA per SM is slower still), so it
  // is off; the path stays for a later cp.async version.
  constexpr bool kPrefetch = false;
  auto load = [&](uint64_t t, int mm, int u, uint4& kx, uint4& vx) {
    const int e = threadIdx.x + u * kThreads;
    const int r = e / kRowVecs, c = (e % kRowVecs) * kVec;
    kx = vx = make_uint4(0, 0, 0, 0);
    if (r < mm) {
      const uint64_t tok = kCompact ? t + r : p.list[t + r];
      kx = __ldg(reinterpret_cast<const uint4*>(kbase + tok * p.k_token_stride + c));
      vx = __ldg(reinterpret_cast<const uint4*>(vbase + tok * p.v_token_stride + c));
    }
  };
  auto stage = [&](uint64_t t, int mm, uint64_t kpos, int u, uint4 kx, uint4 vx) {
    const int e = threadIdx.x + u * kThreads;
    const int r = e / kRowVecs, c = (e % kRowVecs) * kVec;
    if (check) {  // the row's squared norm: lanes of a row first, then one add per warp
      constexpr int kWidth = kRowVecs < 32 ? kRowVecs : 32;
      const float sq = LaneGroupSum<kWidth>(SqSum16<T>(vx));
      if (r < mm && threadIdx.x % kWidth == 0) atomicAdd(&rowsq[r], sq);
    }
    if (kCompact && r < mm && flags[r] >= 0) {
      if (lead) {
        const uint64_t row = kpos + flags[r];
        *reinterpret_cast<uint4*>(static_cast<T*>(p.kept_k) + row * D + c) = kx;
        *reinterpret_cast<uint4*>(static_cast<T*>(p.kept_v) + row * D + c) = vx;
      }
      kx = vx = make_uint4(0, 0, 0, 0);
    }
    *reinterpret_cast<uint4*>(ks + r * kLd + c) = kx;
    *reinterpret_cast<uint4*>(vs + r * kLd + c) = vx;
    if (summarize && lead) {  // this thread's columns never change (kThreads % kRowVecs == 0)
      AddPiece<T>(kx, vx, ksum, vsum);
    }
  };
  uint4 pk[kPrefetch ? kLoads : 1], pv[kPrefetch ? kLoads : 1];
  if constexpr (kPrefetch) {
    const int m0 = static_cast<int>(min(static_cast<uint64_t>(kTileT), end - begin));
#pragma unroll
    for (int u = 0; u < kLoads; ++u) load(begin, m0, u, pk[u], pv[u]);
  }

  for (uint64_t t0 = begin; t0 < end; t0 += kTileT) {
    const int m = static_cast<int>(min(static_cast<uint64_t>(kTileT), end - t0));
    int kept_here = 0;
    if (kCompact) {
      if (threadIdx.x < kTileT) flags[threadIdx.x] = -1;
      __syncthreads();
      bool is = false;
      if (threadIdx.x < kTileT) {
        const uint64_t j = kp + threadIdx.x;
        if (j < l1 && p.list[j] < t0 + m) {
          is = true;
          flags[p.list[j] - t0] = static_cast<int>(threadIdx.x);
        }
      }
      kept_here = __syncthreads_count(is);
    }
    // Stage the tile (rows >= m and kept rows are zero), copying kept rows out on the way.
    if constexpr (kPrefetch) {
#pragma unroll
      for (int u = 0; u < kLoads; ++u) stage(t0, m, kp, u, pk[u], pv[u]);
    } else {
#pragma unroll
      for (int b0 = 0; b0 < kLoads; b0 += 4) {
        uint4 kx[4], vx[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) load(t0, m, b0 + u, kx[u], vx[u]);
#pragma unroll
        for (int u = 0; u < 4; ++u) stage(t0, m, kp, b0 + u, kx[u], vx[u]);
      }
    }
    __syncthreads();
    if (check && threadIdx.x < kTileT) {
      if (threadIdx.x < m && SquaredNormBad(rowsq[threadIdx.x])) {
        atomicMin(p.bad_value,
                  static_cast<unsigned long long>(uint64_t{h} * p.num_tokens + t0 + threadIdx.x));
      }
      rowsq[threadIdx.x] = 0.0f;  // read again only after the loop's closing barrier
    }
    if constexpr (kPrefetch) {  // the next tile's loads fly while the tensor cores work
      const uint64_t next = t0 + kTileT;
      if (next < end) {
        const int mn = static_cast<int>(min(static_cast<uint64_t>(kTileT), end - next));
#pragma unroll
        for (int u = 0; u < kLoads; ++u) load(next, mn, u, pk[u], pv[u]);
      }
    }
    if (summarize) {
      if (lead) {
        evicted += m - kept_here;
      }
      acc.Add(ks, vs, bi, bj);
    }
    kp += kept_here;
    __syncthreads();
  }
  if (!summarize) return;
  float* scratch = reinterpret_cast<float*>(smem);
  acc.Flush(p.vk_sum + size_t{h} * D * D, scratch, bi, bj);
  if (lead) {
    static_assert(MomentSmemBytes<T, D>() >= ((kThreads / 32) * 256 + 2 * D) * sizeof(float),
                  "room for the column sums after the flush's staging");
    FlushColumnSums<D, kVec, kRowVecs>(ksum, vsum, my_col, scratch + (kThreads / 32) * 256,
                                       p.key_sum + size_t{h} * D, p.value_sum + size_t{h} * D);
    if (threadIdx.x == 0) atomicAdd(p.count + h, evicted);
  }
}

// --- The pipelined kernel for 16-bit inputs (d 64 and 128): cp.async, three stages, one
// barrier per tile --------------------------------------------------------------------------
// Tiles i+1 and i+2 are copied global -> shared (cp.async, zero-filled past the end) while the
// tensor cores work on tile i. Each warp finds the tile's kept tokens itself (its lanes hold the
// next 64 entries of the kept list, loaded a tile ahead; two warp-wide ORs make a 64-bit mask
// of the tile), so neither a search per token nor a barrier is needed for it; kept rows are
// copied out and left in shared memory, and the product V^T K runs on mma.sync with the V
// fragments of kept tokens zeroed in registers. The column sums of the evicted rows and the
// values' check are taken from the same 16-byte reads. One block barrier per tile (the tile
// landed, the oldest stage is free).

using ptx::CpAsync16;
using ptx::CpAsyncCommit;
using ptx::CpAsyncWait;

constexpr int kAsyncStages = 3;

// S += V^T K over one 64-token tile, the tokens whose bit is set in `excluded` left out. Warp w
// owns rows [(w / 2) D / 4, + D / 4) (V's dims) and columns [(w % 2) D / 2, + D / 2) (K's) of S.
template <typename T, int D>
struct MaskedMma {
  static constexpr int kLd = RowStride<T, D>();
  static constexpr int kMT = D / 64;  // 16-row m-tiles per warp
  static constexpr int kNT = D / 16;  // 8-column n-tiles per warp
  static_assert(kThreads == 256 && (D == 64 || D == 128), "8 warps over a D x D block");
  float c[kMT][kNT][4];
  __device__ void Init() {
#pragma unroll
    for (int m = 0; m < kMT; ++m) {
#pragma unroll
      for (int n = 0; n < kNT; ++n) c[m][n][0] = c[m][n][1] = c[m][n][2] = c[m][n][3] = 0.0f;
    }
  }
  __device__ void Add(const T* ks, const T* vs, uint64_t excluded) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, mi = lane / 8, q = lane % 4;
    const int row0 = (warp / 2) * (D / 4), col0 = (warp % 2) * (D / 2);
#pragma unroll
    for (int k0 = 0; k0 < kTileT; k0 += 16) {
      // A = V^T (rows: V's dims, k: tokens): this lane's k pairs 2q, 2q + 1 and 2q + 8, 2q + 9.
      const uint32_t bits = static_cast<uint32_t>(excluded >> k0);
      const uint32_t keep01 = ((bits >> (2 * q)) & 1u ? 0u : 0x0000FFFFu) |
                              ((bits >> (2 * q + 1)) & 1u ? 0u : 0xFFFF0000u);
      const uint32_t keep89 = ((bits >> (2 * q + 8)) & 1u ? 0u : 0x0000FFFFu) |
                              ((bits >> (2 * q + 9)) & 1u ? 0u : 0xFFFF0000u);
      uint32_t a[kMT][4];
#pragma unroll
      for (int m = 0; m < kMT; ++m) {
        ptx::LdMatrixX4Trans(a[m], vs + (k0 + lane % 8 + 8 * (mi >> 1)) * kLd + row0 + 16 * m +
                                       8 * (mi & 1));
        a[m][0] &= keep01;
        a[m][1] &= keep01;
        a[m][2] &= keep89;
        a[m][3] &= keep89;
      }
#pragma unroll
      for (int n2 = 0; n2 < kNT / 2; ++n2) {
        // B = K (k: tokens, columns: K's dims), two n-tiles per load.
        uint32_t b[4];
        ptx::LdMatrixX4Trans(b, ks + (k0 + lane % 8 + 8 * (mi & 1)) * kLd + col0 + 16 * n2 +
                                    8 * (mi >> 1));
#pragma unroll
        for (int m = 0; m < kMT; ++m) {
          ptx::Mma16<T>(c[m][2 * n2], a[m], b[0], b[1]);
          ptx::Mma16<T>(c[m][2 * n2 + 1], a[m], b[2], b[3]);
        }
      }
    }
  }
  // Adds the block to s (row-major D x D) through `stage` (D x (D + 4) floats of shared memory):
  // the fragments stored there, then 8 consecutive floats per atomic step. Synchronises the CTA.
  __device__ void Flush(float* s, float* stage) {
    constexpr int kLs = D + 4;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const int row0 = (warp / 2) * (D / 4), col0 = (warp % 2) * (D / 2);
#pragma unroll
    for (int m = 0; m < kMT; ++m) {
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
        const int r = row0 + 16 * m + g, col = col0 + 8 * n + 2 * q;
        *reinterpret_cast<float2*>(stage + r * kLs + col) = make_float2(c[m][n][0], c[m][n][1]);
        *reinterpret_cast<float2*>(stage + (r + 8) * kLs + col) =
            make_float2(c[m][n][2], c[m][n][3]);
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < D * D / 8; e += kThreads) {
      const int r = e / (D / 8), c8 = (e % (D / 8)) * 8;
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = stage[r * kLs + c8 + i];
      AtomicAdd8(s + r * D + c8, v);
    }
  }
};

template <typename T, int D>
constexpr size_t MaskedMomentSmemBytes() {
  const size_t tiles = size_t{kAsyncStages} * 2 * kTileT * RowStride<T, D>() * sizeof(T);
  const size_t flush = (size_t{D} * (D + 4) + 2 * D) * sizeof(float);
  return (tiles > flush ? tiles : flush) + 16;  // + the first kept entry's index
}

template <typename T, int D, bool kCompact>
__global__ void __launch_bounds__(kThreads, 2) MomentKernelMasked(MomentKernelParams p) {
  constexpr int kLd = RowStride<T, D>();
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kRowVecs = D / kVec;
  constexpr int kLoads = kTileT * kRowVecs / kThreads;
  constexpr int kStage = 2 * kTileT * kLd;  // elements of one stage (K then V)
  constexpr int S = kAsyncStages;
  static_assert(kTileT == 64, "a tile's kept tokens are one 64-bit mask");
  static_assert(kRowVecs <= 32 && kThreads % kRowVecs == 0, "a row's lanes share a warp");
  extern __shared__ __align__(128) unsigned char smem[];
  T* stages = reinterpret_cast<T*>(smem);
  uint64_t* first_kept =
      reinterpret_cast<uint64_t*>(smem + MaskedMomentSmemBytes<T, D>() - 16);

  const uint32_t h = blockIdx.y;
  const bool summarize = p.count != nullptr;
  const bool check = kCompact && p.bad_value != nullptr;
  const uint64_t l0 = p.list_off[h], l1 = p.list_off[h + 1];
  uint64_t begin, end;
  if (kCompact) {
    begin = blockIdx.x * p.chunk;
    end = min(p.num_tokens, begin + p.chunk);
  } else {
    begin = l0 + blockIdx.x * p.chunk;
    end = min(l1, begin + p.chunk);
  }
  if (begin >= end) return;
  if (p.abort != nullptr && *p.abort != 0) return;
  const T* kbase = static_cast<const T*>(p.k) + h * p.k_head_stride;
  const T* vbase = static_cast<const T*>(p.v) + h * p.v_head_stride;
  const int lane = threadIdx.x % 32;

  if (kCompact && threadIdx.x == 0) {  // the first kept entry at or after begin
    uint64_t lo = l0, hi = l1;
    while (lo < hi) {
      const uint64_t mid = (lo + hi) / 2;
      if (p.list[mid] < begin) lo = mid + 1; else hi = mid;
    }
    *first_kept = lo;
  }

  auto issue = [&](uint64_t t, int stage) {
    const int mm = static_cast<int>(min(static_cast<uint64_t>(kTileT), end - t));
    T* ks = stages + stage * kStage;
    T* vs = ks + kTileT * kLd;
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int e = threadIdx.x + u * kThreads;
      const int r = e / kRowVecs, c = (e % kRowVecs) * kVec;
      const bool in = r < mm;
      const uint64_t tok = in ? (kCompact ? t + r : p.list[t + r]) : 0;
      CpAsync16(ks + r * kLd + c, kbase + tok * p.k_token_stride + c, in ? 16 : 0);
      CpAsync16(vs + r * kLd + c, vbase + tok * p.v_token_stride + c, in ? 16 : 0);
    }
  };

  MaskedMma<T, D> acc;
  acc.Init();
  const int my_col = (threadIdx.x % kRowVecs) * kVec;  // fixed: kThreads % kRowVecs == 0
  float ksum[kVec], vsum[kVec];
#pragma unroll
  for (int w = 0; w < kVec; ++w) ksum[w] = vsum[w] = 0.0f;
  unsigned long long evicted = 0;
  const int tiles = static_cast<int>((end - begin + kTileT - 1) / kTileT);
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < tiles) issue(begin + uint64_t{kTileT} * st, st);
    CpAsyncCommit();
  }
  __syncthreads();
  uint64_t kp = kCompact ? *first_kept : 0;
  // This lane's entries of the kept list for the coming tile: kp + lane and kp + 32 + lane.
  uint32_t e0 = 0xFFFFFFFFu, e1 = 0xFFFFFFFFu;
  if (kCompact) {
    if (kp + lane < l1) e0 = p.list[kp + lane];
    if (kp + 32 + lane < l1) e1 = p.list[kp + 32 + lane];
  }
  for (int i = 0; i < tiles; ++i) {
    const uint64_t t0 = begin + uint64_t{kTileT} * i;
    const int m = static_cast<int>(min(static_cast<uint64_t>(kTileT), end - t0));
    CpAsyncWait<S - 2>();
    __syncthreads();  // tile i landed for every thread; the stage tile i - 1 used is free
    if (i + S - 1 < tiles) issue(begin + uint64_t{kTileT} * (i + S - 1), (i + S - 1) % S);
    CpAsyncCommit();
    // The tile's kept tokens as a mask (the list is ascending: the entries below t0 + m).
    uint64_t kept = 0;
    const uint64_t kp0 = kp;
    if (kCompact) {
      uint32_t lo = 0, hi = 0;
      const uint64_t lim = t0 + m;
      if (e0 >= t0 && e0 < lim) {
        const uint32_t bit = static_cast<uint32_t>(e0 - t0);
        (bit < 32 ? lo : hi) |= 1u << (bit & 31u);
      }
      if (e1 >= t0 && e1 < lim) {
        const uint32_t bit = static_cast<uint32_t>(e1 - t0);
        (bit < 32 ? lo : hi) |= 1u << (bit & 31u);
      }
      lo = __reduce_or_sync(0xFFFFFFFFu, lo);
      hi = __reduce_or_sync(0xFFFFFFFFu, hi);
      kept = (uint64_t{hi} << 32) | lo;
      kp += __popcll(kept);
      // The next tile's entries: the loads fly while this tile is worked on.
      e0 = kp + lane < l1 ? p.list[kp + lane] : 0xFFFFFFFFu;
      e1 = kp + 32 + lane < l1 ? p.list[kp + 32 + lane] : 0xFFFFFFFFu;
    }
    const int kept_here = __popcll(kept);
    const T* ks = stages + (i % S) * kStage;
    const T* vs = ks + kTileT * kLd;
    // One 16-byte read per piece: kept rows copied out, the values checked, the evicted rows'
    // column sums (rows past m are zero).
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int e = threadIdx.x + u * kThreads;
      const int r = e / kRowVecs, c = (e % kRowVecs) * kVec;
      const uint4 kx = *reinterpret_cast<const uint4*>(ks + r * kLd + c);
      const uint4 vx = *reinterpret_cast<const uint4*>(vs + r * kLd + c);
      if (check) {
        const float sq = LaneGroupSum<kRowVecs>(SqSum16<T>(vx));
        if (r < m && threadIdx.x % kRowVecs == 0 && SquaredNormBad(sq)) {
          atomicMin(p.bad_value, static_cast<unsigned long long>(uint64_t{h} * p.num_tokens +
                                                                  t0 + r));
        }
      }
      if (kCompact && ((kept >> r) & 1u)) {
        const uint64_t row = kp0 + __popcll(kept & ((uint64_t{1} << r) - 1));
        *reinterpret_cast<uint4*>(static_cast<T*>(p.kept_k) + row * D + c) = kx;
        *reinterpret_cast<uint4*>(static_cast<T*>(p.kept_v) + row * D + c) = vx;
      } else if (summarize) {
        AddPiece<T>(kx, vx, ksum, vsum);
      }
    }
    if (summarize) {
      evicted += m - kept_here;
      if (kept_here < m) acc.Add(ks, vs, kept);
    }
  }
  CpAsyncWait<0>();
  if (!summarize) return;
  __syncthreads();  // the tiles are done with: the flush stages in their shared memory
  float* scratch = reinterpret_cast<float*>(smem);
  acc.Flush(p.vk_sum + size_t{h} * D * D, scratch);
  FlushColumnSums<D, kVec, kRowVecs>(ksum, vsum, my_col, scratch + D * (D + 4),
                                     p.key_sum + size_t{h} * D, p.value_sum + size_t{h} * D);
  if (threadIdx.x == 0) atomicAdd(p.count + h, evicted);
}

// Launches `kernel` with `smem` bytes of dynamic shared memory, raising the kernel's limit above
// the default 48 KiB first (and, with `max_shared`, asking for the largest shared-memory carveout:
// two CTAs of the three-stage kernel need most of a multiprocessor's shared memory).
template <typename Kernel>
cudaError_t LaunchWithSmem(Kernel kernel, size_t smem, bool max_shared, dim3 grid,
                           cudaStream_t stream, const MomentKernelParams& p) {
  if (smem > 48 * 1024) {
    cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    if (max_shared) {
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
      if (e != cudaSuccess) return e;
    }
  }
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D, bool kCompact>
cudaError_t LaunchMomentKernel(const MomentKernelParams& p, uint64_t chunks, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(chunks), p.heads, SBlock<D>::kBlocks * SBlock<D>::kBlocks);
  // 16-bit inputs with 2 D <= kThreads (a row's 16-byte pieces within one warp) take the
  // pipelined kernel.
  if constexpr (sizeof(T) == 2 && 2 * D <= kThreads) {
    return LaunchWithSmem(MomentKernelMasked<T, D, kCompact>, MaskedMomentSmemBytes<T, D>(),
                          /*max_shared=*/true, grid, stream, p);
  } else {
    return LaunchWithSmem(MomentKernel<T, D, kCompact>, MomentSmemBytes<T, D>(),
                          /*max_shared=*/false, grid, stream, p);
  }
}

// Sets *error to 1 when an index of head h's list is >= num_tokens or, when `ascending`, not
// strictly above its predecessor. Grid: (blocks, heads).
// `max_list` (bounds every list's length) and a nonzero offsets[0] are checked as well.
static __global__ void CheckLists(const uint32_t* list, const uint64_t* off, uint64_t num_tokens,
                                  bool ascending, unsigned int* error, uint64_t max_list) {
  const uint32_t h = blockIdx.y;
  const uint64_t a = off[h], b = off[h + 1];
  if (b < a || b - a > max_list || (h == 0 && a != 0)) {
    if (threadIdx.x == 0 && blockIdx.x == 0) *error = 1;
    return;
  }
  for (uint64_t i = a + blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < b;
       i += uint64_t{gridDim.x} * blockDim.x) {
    if (list[i] >= num_tokens || (ascending && i > a && list[i] <= list[i - 1])) *error = 1;
  }
}

// dst += src element-wise (n floats) and for counts.
static __global__ void AddFloats(float* dst, const float* src, uint64_t n) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    dst[i] += src[i];
  }
}
static __global__ void AddCounts(unsigned long long* dst, const unsigned long long* src,
                                 uint32_t n) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    dst[i] += src[i];
  }
}

}  // namespace moments_cuda
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_MOMENTS_KERNELS_CUH_
