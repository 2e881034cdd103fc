// CUDA kernels of MomentKV summaries. One kernel does both jobs of the engine's moment stage:
//   list mode:    sums the moments of the listed (evicted) tokens of each head (gather);
//   compact mode: walks every token of each head once, copies the kept ones to the compacted
//                 output and sums the moments of the others, in the same pass over the data.
// The v k^T sum is a matrix product over tokens: each CTA stages a tile of 64 tokens of K and V
// in shared memory and accumulates V^T K on the tensor cores (WMMA, fp32 accumulators) for
// 16-bit inputs; fp32 inputs take exact fp32 FMAs. A CTA owns a chunk of tokens of one head and
// one 128x128 (or dxd when d < 128) block of S, and adds its result to the output with atomics.
#ifndef KVCOMP_KERNELS_SRC_CUDA_MOMENTS_KERNELS_CUH_
#define KVCOMP_KERNELS_SRC_CUDA_MOMENTS_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>

namespace kvcomp {
namespace moments_cuda {

constexpr int kThreads = 256;  // 8 warps
// CTAs per SM the moment kernel is compiled for (register budget 65536 / (256 * this)).
#ifndef KVCOMP_MOMENTS_MIN_BLOCKS
#define KVCOMP_MOMENTS_MIN_BLOCKS 2
#endif
constexpr int kTileT = 64;  // tokens per shared-memory tile

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
};

template <int D>
struct SBlock {
  static constexpr int B = D < 128 ? D : 128;  // S block edge owned by one CTA
  static constexpr int kBlocks = D / B;        // per dimension
  static constexpr int kTiles = (B / 16) * (B / 16);
  static constexpr int kTilesPerWarp = kTiles / (kThreads / 32);
  static_assert((B / 16) % kTilesPerWarp == 0, "a warp's tiles must share a tile row");
};

// Tensor-core accumulation of S_block += V_tile^T K_tile for 16-bit T.
template <typename T, int D>
struct MmaAccumulator {
  using Blk = SBlock<D>;
  static constexpr int kLd = RowStride<T, D>();
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> acc[Blk::kTilesPerWarp];
  __device__ void Init() {
#pragma unroll
    for (int i = 0; i < Blk::kTilesPerWarp; ++i) nvcuda::wmma::fill_fragment(acc[i], 0.0f);
  }
  __device__ void Add(const T* ks, const T* vs, int bi, int bj) {
    using namespace nvcuda;
    const int warp = threadIdx.x / 32;
    // A warp's tiles share one tile row (kTilesPerWarp divides B / 16), so its A fragment is
    // loaded once per k-step.
    const int ti = (warp * Blk::kTilesPerWarp) / (Blk::B / 16);
#pragma unroll
    for (int kk = 0; kk < kTileT; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> a;
      // A = V^T (D x tokens): element (i, t) at vs[t * D + i] -> column-major, ld D.
      wmma::load_matrix_sync(a, vs + kk * kLd + bi * Blk::B + ti * 16, kLd);
#pragma unroll
      for (int i = 0; i < Blk::kTilesPerWarp; ++i) {
        const int tj = (warp * Blk::kTilesPerWarp + i) % (Blk::B / 16);
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
        // B = K (tokens x D): element (t, j) at ks[t * D + j] -> row-major, ld D.
        wmma::load_matrix_sync(b, ks + kk * kLd + bj * Blk::B + tj * 16, kLd);
        wmma::mma_sync(acc[i], a, b, acc[i]);
      }
    }
  }
  // Adds the block to s (row-major D x D) with atomics, staging each tile in `stage` (per warp
  // 256 floats).
  __device__ void Flush(float* s, float* stage, int bi, int bj) {
    using namespace nvcuda;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* st = stage + warp * 256;
#pragma unroll
    for (int i = 0; i < Blk::kTilesPerWarp; ++i) {
      const int tile = warp * Blk::kTilesPerWarp + i;
      const int ti = tile / (Blk::B / 16), tj = tile % (Blk::B / 16);
      wmma::store_matrix_sync(st, acc[i], 16, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) {
        const int r = bi * Blk::B + ti * 16 + e / 16, c = bj * Blk::B + tj * 16 + e % 16;
        atomicAdd(s + r * D + c, st[e]);
      }
      __syncwarp();
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
  return (tiles > stage ? tiles : stage) + kTileT * sizeof(int) + 2 * sizeof(int);
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
                                      2 * sizeof(int));
  int* shared_kp = flags + kTileT;  // [0]: next kept entry (relative), [1]: kept in this tile

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
      const T* kv = reinterpret_cast<const T*>(&kx);
      const T* vv = reinterpret_cast<const T*>(&vx);
#pragma unroll
      for (int w = 0; w < kVec; ++w) {
        ksum[w] += ToFloat(kv[w]);
        vsum[w] += ToFloat(vv[w]);
      }
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
  acc.Flush(p.vk_sum + size_t{h} * D * D, reinterpret_cast<float*>(smem), bi, bj);
  if (lead) {
#pragma unroll
    for (int w = 0; w < kVec; ++w) {
      atomicAdd(p.key_sum + size_t{h} * D + my_col + w, ksum[w]);
      atomicAdd(p.value_sum + size_t{h} * D + my_col + w, vsum[w]);
    }
    if (threadIdx.x == 0) atomicAdd(p.count + h, evicted);
  }
}

// --- The pipelined variant for 16-bit inputs: cp.async double buffering --------------------
// Tile i+1 is copied global -> shared (cp.async, zero-filled past the end) while the tensor
// cores work on tile i, so loads and MMAs overlap within a CTA. Kept rows are copied out of
// shared memory and zeroed there before the MMA.

__device__ __forceinline__ void CpAsync16(void* smem_dst, const void* gmem_src, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <typename T, int D>
constexpr size_t AsyncMomentSmemBytes() {
  const size_t tiles = 2 * 2 * size_t{kTileT} * RowStride<T, D>() * sizeof(T);  // 2 stages
  return tiles + kTileT * sizeof(int) + 2 * sizeof(int);
}

template <typename T, int D, bool kCompact>
__global__ void __launch_bounds__(kThreads, 2) MomentKernelAsync(MomentKernelParams p) {
  using Blk = SBlock<D>;
  constexpr int kLd = RowStride<T, D>();
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kRowVecs = D / kVec;
  constexpr int kLoads = kTileT * kRowVecs / kThreads;
  constexpr int kStage = 2 * kTileT * kLd;  // elements of one stage (K then V)
  extern __shared__ __align__(128) unsigned char smem[];
  T* stages = reinterpret_cast<T*>(smem);
  int* flags = reinterpret_cast<int*>(smem + AsyncMomentSmemBytes<T, D>() -
                                      kTileT * sizeof(int) - 2 * sizeof(int));
  int* shared_kp = flags + kTileT;

  const uint32_t h = blockIdx.y;
  const int bi = blockIdx.z / Blk::kBlocks, bj = blockIdx.z % Blk::kBlocks;
  const bool lead = blockIdx.z == 0;
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

  if (kCompact && threadIdx.x == 0) {
    uint64_t lo = l0, hi = l1;
    while (lo < hi) {
      const uint64_t mid = (lo + hi) / 2;
      if (p.list[mid] < begin) lo = mid + 1; else hi = mid;
    }
    shared_kp[0] = static_cast<int>(lo - l0);
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
    CpAsyncCommit();
  };

  Accumulator<T, D> acc;
  acc.Init();
  float colsum = 0.0f;  // column threadIdx.x of [K | V] (lead CTA), when threadIdx.x < 2 D
  unsigned long long evicted = 0;
  issue(begin, 0);
  __syncthreads();
  uint64_t kp = l0 + shared_kp[0];
  int stage = 0;
  for (uint64_t t0 = begin; t0 < end; t0 += kTileT, stage ^= 1) {
    const int m = static_cast<int>(min(static_cast<uint64_t>(kTileT), end - t0));
    const bool more = t0 + kTileT < end;
    if (more) issue(t0 + kTileT, stage ^ 1);
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
    if (more) CpAsyncWait<1>(); else CpAsyncWait<0>();
    __syncthreads();
    T* ks = stages + stage * kStage;
    T* vs = ks + kTileT * kLd;
    if (kCompact && kept_here > 0) {  // copy kept rows out, then zero them
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int e = threadIdx.x + u * kThreads;
        const int r = e / kRowVecs, c = (e % kRowVecs) * kVec;
        if (r < m && flags[r] >= 0) {
          uint4* kr = reinterpret_cast<uint4*>(ks + r * kLd + c);
          uint4* vr = reinterpret_cast<uint4*>(vs + r * kLd + c);
          if (lead) {
            const uint64_t row = kp + flags[r];
            *reinterpret_cast<uint4*>(static_cast<T*>(p.kept_k) + row * D + c) = *kr;
            *reinterpret_cast<uint4*>(static_cast<T*>(p.kept_v) + row * D + c) = *vr;
          }
          *kr = *vr = make_uint4(0, 0, 0, 0);
        }
      }
      __syncthreads();
    }
    if (summarize) {
      if (lead) {
        if (threadIdx.x < 2 * D) {
          const T* col = threadIdx.x < D ? ks + threadIdx.x : vs + (threadIdx.x - D);
          float s0 = 0.0f, s1 = 0.0f;
#pragma unroll 8
          for (int r = 0; r < kTileT; r += 2) {
            s0 += ToFloat(col[r * kLd]);
            s1 += ToFloat(col[(r + 1) * kLd]);
          }
          colsum += s0 + s1;
        }
        evicted += m - kept_here;
      }
      acc.Add(ks, vs, bi, bj);
    }
    kp += kept_here;
    __syncthreads();  // the next iteration's issue() overwrites this stage
  }
  if (!summarize) return;
  acc.Flush(p.vk_sum + size_t{h} * D * D, reinterpret_cast<float*>(smem), bi, bj);
  if (lead) {
    if (threadIdx.x < D) {
      atomicAdd(p.key_sum + size_t{h} * D + threadIdx.x, colsum);
    } else if (threadIdx.x < 2 * D) {
      atomicAdd(p.value_sum + size_t{h} * D + threadIdx.x - D, colsum);
    }
    if (threadIdx.x == 0) atomicAdd(p.count + h, evicted);
  }
}

template <typename T, int D, bool kCompact>
cudaError_t LaunchMomentKernel(const MomentKernelParams& p, uint64_t chunks, cudaStream_t stream) {
  // 16-bit inputs with 2 D <= kThreads (one column sum per thread) take the pipelined kernel.
  constexpr bool kAsync = sizeof(T) == 2 && 2 * D <= kThreads;
  constexpr size_t smem = kAsync ? AsyncMomentSmemBytes<T, D>() : MomentSmemBytes<T, D>();
  auto kernel = kAsync ? MomentKernelAsync<T, D, kCompact> : MomentKernel<T, D, kCompact>;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  const dim3 grid(static_cast<unsigned>(chunks), p.heads, SBlock<D>::kBlocks * SBlock<D>::kBlocks);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
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
