// CUDA decode attention over a compressed layer (kept tokens ragged per kv head) plus the evicted
// set's MomentKV virtual token. Two kernels:
//   AttentionPartialKernel: grid (chunks, kv heads, row blocks). A CTA takes a chunk of one kv
//     head's kept tokens and ALL the query rows of that head's GQA group (q heads x queries, up
//     to kRows per row block), so each kept key and value is read from memory once. It keeps an
//     online softmax (max, sum, fp32 accumulator) per row and writes it as a partial.
//   AttentionCombineKernel: grid (rows, kv heads). Merges the chunks of a row and folds in the
//     virtual token (logit t q.mu_k + ln n, value mu_v + t C q, computed in double), writes out.
#ifndef KVCOMP_KERNELS_SRC_CUDA_ATTENTION_KERNELS_CUH_
#define KVCOMP_KERNELS_SRC_CUDA_ATTENTION_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "moments_kernels.cuh"

namespace kvcomp {
namespace attention_cuda {

using moments_cuda::ToFloat;

constexpr int kThreads = 256;
constexpr int kRows = 32;  // query rows per CTA
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
  float scale = 0.0f;
  // Partials [Hk][row][chunk]: max, sum, acc[D].
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

template <int D>
constexpr size_t PartialSmemBytes() {
  // q [kRows][D], K [kKeys][D+1], V [kKeys][D], P [kRows][kKeys], acc [kRows][D], max/sum/scale
  return sizeof(float) * (size_t{kRows} * D + size_t{kKeys} * (D + 1) + size_t{kKeys} * D +
                          size_t{kRows} * kKeys + size_t{kRows} * D + 3 * kRows);
}

template <typename Q>
__device__ __forceinline__ const Q* QRow(const AttentionKernelParams& p, uint32_t kv_head,
                                         uint32_t row) {
  const uint32_t g = kv_head * p.group + row / p.nq, i = row % p.nq;
  return static_cast<const Q*>(p.q) + g * p.q_head_stride + uint64_t{i} * p.q_token_stride;
}

template <typename Q, typename T, int D>
__global__ void __launch_bounds__(kThreads) AttentionPartialKernel(AttentionKernelParams p) {
  extern __shared__ __align__(16) float sm[];
  float* qs = sm;                    // [kRows][D], pre-scaled
  float* kt = qs + kRows * D;        // [kKeys][D + 1] (padded: no bank conflicts)
  float* vt = kt + kKeys * (D + 1);  // [kKeys][D]
  float* pr = vt + kKeys * D;        // [kRows][kKeys]
  float* acc = pr + kRows * kKeys;   // [kRows][D]
  float* rmax = acc + kRows * D;     // [kRows]
  float* rsum = rmax + kRows;
  float* rscale = rsum + kRows;

  const uint32_t h = blockIdx.y;
  const uint32_t rows_total = p.group * p.nq;
  const uint32_t row0 = blockIdx.z * kRows;
  const int rows = static_cast<int>(min(static_cast<uint32_t>(kRows), rows_total - row0));
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
  for (uint64_t t0 = begin; t0 < end; t0 += kKeys) {
    const int m = static_cast<int>(min(static_cast<uint64_t>(kKeys), end - t0));
    // 16-byte loads (all issued first), converted to fp32 in shared memory.
    constexpr int kVec = 16 / sizeof(T);
    constexpr int kLoads = kKeys * D / kVec / kThreads;
    uint4 kx[kLoads], vx[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int e = (threadIdx.x + u * kThreads) * kVec;
      const int j = e / D;
      kx[u] = vx[u] = make_uint4(0, 0, 0, 0);
      if (j < m) {
        kx[u] = __ldg(reinterpret_cast<const uint4*>(kg + (t0 + j) * D + e % D));
        vx[u] = __ldg(reinterpret_cast<const uint4*>(vg + (t0 + j) * D + e % D));
      }
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int e = (threadIdx.x + u * kThreads) * kVec;
      const int j = e / D, x = e % D;
      const T* kv = reinterpret_cast<const T*>(&kx[u]);
      const T* vv = reinterpret_cast<const T*>(&vx[u]);
#pragma unroll
      for (int w = 0; w < kVec; ++w) {
        kt[j * (D + 1) + x + w] = ToFloat(kv[w]);
        vt[e + w] = ToFloat(vv[w]);
      }
    }
    __syncthreads();
    // Logits and online softmax: warp w takes rows w, w+8, ...; lane j takes key j.
    for (int r = warp; r < rows; r += kThreads / 32) {
      float l = -INFINITY;
      if (lane < m) {
        float s = 0.0f;
        const float* qr = qs + r * D;
        const float* kr = kt + lane * (D + 1);
#pragma unroll 8
        for (int x = 0; x < D; ++x) s += qr[x] * kr[x];
        l = s;
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
      if (lane == 0) {
        const float c = old == -INFINITY ? 0.0f : __expf(old - nmax);
        rscale[r] = c;
        rsum[r] = rsum[r] * c + s;
        rmax[r] = nmax;
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < rows * D; e += kThreads) {
      const int r = e / D, x = e % D;
      float s = acc[e] * rscale[r];
      const float* pw = pr + r * kKeys;
#pragma unroll 8
      for (int j = 0; j < kKeys; ++j) s += pw[j] * vt[j * D + x];
      acc[e] = s;
    }
    __syncthreads();
  }
  // Partials of (h, row, chunk).
  for (int e = threadIdx.x; e < rows * D; e += kThreads) {
    const int r = e / D, x = e % D;
    const uint64_t slot = (uint64_t{h} * rows_total + row0 + r) * p.chunks + blockIdx.x;
    p.part_acc[slot * D + x] = acc[e];
    if (x == 0) {
      p.part_max[slot] = rmax[r];
      p.part_sum[slot] = rsum[r];
    }
  }
}

// One CTA per (row, kv head), D threads (64..256).
template <typename Q, int D>
__global__ void __launch_bounds__(D) AttentionCombineKernel(AttentionKernelParams p) {
  __shared__ double red[D / 32];
  __shared__ double bcast[2];
  __shared__ double qv[D];
  __shared__ float qf[D];
  __shared__ double cq[D];
  const uint32_t h = blockIdx.y, row = blockIdx.x;
  const uint32_t rows_total = p.group * p.nq;
  const int x = threadIdx.x, warp = x / 32, lane = x % 32;
  const uint64_t slot0 = (uint64_t{h} * rows_total + row) * p.chunks;

  double m = -INFINITY;
  for (uint32_t c = 0; c < p.chunks; ++c) {
    if (p.part_sum[slot0 + c] > 0.0f) m = fmax(m, double{p.part_max[slot0 + c]});
  }
  double l = 0.0, a = 0.0;
  for (uint32_t c = 0; c < p.chunks; ++c) {
    const float s = p.part_sum[slot0 + c];
    if (s > 0.0f) {
      const double w = exp(double{p.part_max[slot0 + c]} - m);
      l += w * s;
      a += w * p.part_acc[(slot0 + c) * D + x];
    }
  }
  const unsigned long long n = p.count != nullptr ? p.count[h] : 0ull;
  if (n > 0) {
    const double nd = static_cast<double>(n);
    qf[x] = ToFloat(QRow<Q>(p, h, row)[x]);
    qv[x] = qf[x];
    __syncthreads();
    // q . mu_k
    double part = qv[x] * (p.key_sum[size_t{h} * D + x] / nd);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) part += __shfl_xor_sync(0xffffffffu, part, o);
    if (lane == 0) red[warp] = part;
    // (S q)_x: thread x walks row x of S (its lines stay in L1 across the walk).
    {
      const float* srow = p.vk_sum + size_t{h} * D * D + static_cast<size_t>(x) * D;
      float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll 8
      for (int j = 0; j < D; j += 2) {
        acc0 += srow[j] * qf[j];
        acc1 += srow[j + 1] * qf[j + 1];
      }
      cq[x] = static_cast<double>(acc0) + acc1;
    }
    __syncthreads();
    if (x == 0) {
      double qmu = 0.0;
      for (int w = 0; w < D / 32; ++w) qmu += red[w];
      bcast[0] = qmu;
    }
    __syncthreads();
    const double qmu = bcast[0];
    const double t = p.scale;
    const double mu_v = p.value_sum[size_t{h} * D + x] / nd;
    const double ve = mu_v + t * (cq[x] / nd - mu_v * qmu);
    const double le = t * qmu + log(nd);
    const double nm = fmax(m, le);
    const double c = l > 0.0 ? exp(m - nm) : 0.0, w = exp(le - nm);
    l = l * c + w;
    a = a * c + w * ve;
  }
  const uint32_t g = h * p.group + row / p.nq, i = row % p.nq;
  p.out[(uint64_t{g} * p.nq + i) * D + x] = l > 0.0 ? static_cast<float>(a / l) : 0.0f;
}

template <typename Q, typename T, int D>
cudaError_t LaunchAttention(const AttentionKernelParams& p, uint32_t kv_heads,
                            cudaStream_t stream) {
  constexpr size_t smem = PartialSmemBytes<D>();
  auto partial = AttentionPartialKernel<Q, T, D>;
  if (smem > 48 * 1024) {
    cudaError_t e =
        cudaFuncSetAttribute(partial, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  const uint32_t rows = p.group * p.nq;
  const dim3 grid(p.chunks, kv_heads, (rows + kRows - 1) / kRows);
  partial<<<grid, kThreads, smem, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  AttentionCombineKernel<Q, D><<<dim3(rows, kv_heads), D, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attention_cuda
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_ATTENTION_KERNELS_CUH_
