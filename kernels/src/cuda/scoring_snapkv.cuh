// SnapKV scores on CUDA (kvpress's form, as the CPU reference): the last w queries attend
// causally over all keys (softmax in f32); the weights on the first n - w tokens are averaged over
// the queries, average-pooled over tokens (zero padding, divided by the width) and averaged over
// the GQA group; the window's own tokens get the layer's maximum score. Scalar loads: this
// scorer is not on the bandwidth path.
#ifndef KVCOMP_KERNELS_SRC_CUDA_SCORING_SNAPKV_CUH_
#define KVCOMP_KERNELS_SRC_CUDA_SCORING_SNAPKV_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>

#include "kvcomp/kernels/tensor.h"
#include "scoring_kernels.cuh"

namespace kvcomp {
namespace cuda {

struct SnapKVParams {
  HeadsView keys;     // [H, n, D], dense or strided
  HeadsView queries;  // [Hq, w, D]
  uint32_t pool = 5;
  float2* stats = nullptr;      // [Hq, w]: (max logit, sum of exp)
  float* acc = nullptr;         // [Hq, n]: attention mass per token, summed over the window
  uint32_t* max_key = nullptr;  // OrderKey of the layer's largest prefix score
  float* scores = nullptr;      // [H, n]
  ErrorSlots* errors = nullptr;
};

__device__ inline float LoadF(const float* p) { return *p; }
__device__ inline float LoadF(const __half* p) { return __half2float(*p); }
__device__ inline float LoadF(const __nv_bfloat16* p) { return __bfloat162float(*p); }

template <typename T>
__device__ inline float Dot(const T* a, const T* b, uint32_t d) {
  float s = 0.0f;
  for (uint32_t j = 0; j < d; ++j) s = fmaf(LoadF(a + j), LoadF(b + j), s);
  return s;
}

template <typename T>
__device__ inline const T* Row(const HeadsView& v, uint32_t h, uint64_t t) {
  return static_cast<const T*>(v.data) + uint64_t{h} * v.head_stride + t * v.token_stride;
}

// Per query row (jq, r): the max logit and the softmax denominator over its visible keys.
// grid (w, Hq), kThreads threads.
template <typename T>
__global__ void __launch_bounds__(kThreads) SnapStatsKernel(SnapKVParams p) {
  __shared__ float red[kThreads];
  const uint32_t jq = blockIdx.y;
  const uint32_t r = blockIdx.x;
  const uint32_t group = p.queries.num_heads / p.keys.num_heads;
  const uint32_t h = jq / group;
  const uint64_t n = p.keys.num_tokens;
  const uint64_t w = p.queries.num_tokens;
  const uint64_t visible = n - w + r + 1;
  const uint32_t d = p.keys.head_dim;
  const float scale = 1.0f / sqrtf(static_cast<float>(d));
  const T* q = Row<T>(p.queries, jq, r);
  float m = -FLT_MAX;
  for (uint64_t t = threadIdx.x; t < visible; t += kThreads) {
    m = fmaxf(m, Dot(q, Row<T>(p.keys, h, t), d) * scale);
  }
  red[threadIdx.x] = m;
  __syncthreads();
  for (int o = kThreads / 2; o > 0; o /= 2) {
    if (threadIdx.x < o) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + o]);
    __syncthreads();
  }
  m = red[0];
  __syncthreads();
  float z = 0.0f;
  for (uint64_t t = threadIdx.x; t < visible; t += kThreads) {
    z += expf(Dot(q, Row<T>(p.keys, h, t), d) * scale - m);
  }
  red[threadIdx.x] = z;
  __syncthreads();
  for (int o = kThreads / 2; o > 0; o /= 2) {
    if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) p.stats[uint64_t{jq} * w + r] = make_float2(m, red[0]);
}

// acc[jq][t] = sum over the window's queries of their softmax weight on token t (t < n - w).
// grid (ceil((n - w) / kThreads), Hq), kThreads threads.
template <typename T>
__global__ void __launch_bounds__(kThreads) SnapAccumulateKernel(SnapKVParams p) {
  const uint32_t jq = blockIdx.y;
  const uint32_t group = p.queries.num_heads / p.keys.num_heads;
  const uint32_t h = jq / group;
  const uint64_t n = p.keys.num_tokens;
  const uint64_t w = p.queries.num_tokens;
  const uint64_t prefix = n - w;
  const uint64_t t = uint64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (t >= prefix) return;
  const uint32_t d = p.keys.head_dim;
  const float scale = 1.0f / sqrtf(static_cast<float>(d));
  const T* k = Row<T>(p.keys, h, t);
  double acc = 0.0;
  for (uint64_t r = 0; r < w; ++r) {
    const float2 st = p.stats[uint64_t{jq} * w + r];
    const float weight = expf(Dot(Row<T>(p.queries, jq, r), k, d) * scale - st.x);
    acc += weight * (1.0f / st.y);
  }
  p.acc[uint64_t{jq} * n + t] = static_cast<float>(acc);
}

// Pooling and group mean of the prefix tokens, and the layer maximum.
// grid (ceil((n - w) / kThreads), H), kThreads threads.
__global__ void __launch_bounds__(kThreads) SnapPoolKernel(SnapKVParams p) {
  const uint32_t h = blockIdx.y;
  const uint32_t group = p.queries.num_heads / p.keys.num_heads;
  const uint64_t n = p.keys.num_tokens;
  const uint64_t w = p.queries.num_tokens;
  const int64_t prefix = static_cast<int64_t>(n - w);
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= prefix) return;
  const int64_t half = p.pool / 2;
  const int64_t lo = t - half < 0 ? 0 : t - half;
  const int64_t hi = t + half > prefix - 1 ? prefix - 1 : t + half;
  double group_sum = 0.0;
  for (uint32_t g = 0; g < group; ++g) {
    const float* a = p.acc + uint64_t{h * group + g} * n;
    double s = 0.0;
    for (int64_t u = lo; u <= hi; ++u) s += a[u];
    group_sum += static_cast<float>(s / static_cast<double>(w) / p.pool);
  }
  const float score = static_cast<float>(group_sum / group);
  p.scores[uint64_t{h} * n + t] = score;
  atomicMax(p.max_key, OrderKey(score));
}

__device__ inline float FromOrderKey(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// The window's tokens score the layer maximum (1 when there is no prefix).
// grid (ceil(w / kThreads), H), kThreads threads.
__global__ void __launch_bounds__(kThreads) SnapFillKernel(SnapKVParams p) {
  const uint32_t h = blockIdx.y;
  const uint64_t n = p.keys.num_tokens;
  const uint64_t w = p.queries.num_tokens;
  const uint64_t i = uint64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (i >= w) return;
  const float m = n == w ? 1.0f : FromOrderKey(*p.max_key);
  p.scores[uint64_t{h} * n + (n - w) + i] = m;
}

}  // namespace cuda
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_SCORING_SNAPKV_CUH_
