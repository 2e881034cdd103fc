// CUDA twin of LatentAttentionCpu (latent_attention.h), two launches:
//   partial  one CTA per (token range of a kv head, block of up to kRows query rows): logits of
//            a tile of keys, an online softmax per row, and the softmax-weighted sum of the
//            tile's dequantized latents (rank numbers per token; outlier rows count in the
//            softmax, not in the sum); writes (max, sum, latent sum) per row.
//   combine  one CTA per (query row, kv head): merges the ranges, applies the expand matrix
//            once, adds the outlier rows with their raw values and the virtual token.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "latent_attention.h"

namespace kvcomp {
namespace decode {
namespace {

constexpr int kThreads = 128;
constexpr int kTile = 32;  // keys per tile (one warp's lanes in the softmax)
constexpr int kRows = 16;  // query rows per partial CTA
constexpr int kMaxAcc = kRows * 256 / kThreads;

struct Args {
  const void* q;
  int q_dtype;
  uint64_t q_head_stride, q_token_stride;
  uint32_t nq, group;  // queries per q head, q heads per kv head
  const void* keys;
  int kv_dtype;
  const uint64_t* offsets;
  uint32_t d, r, gs, groups, lb;
  int codec;  // 0 f16 latent, 1 int8, 2 int4
  const uint8_t* latent;
  const uint16_t* scales;
  const float* expand;
  uint64_t num_raw;
  const uint64_t* raw_rows;
  const void* raw_values;
  const uint64_t* count;
  const float* key_sum;
  const float* value_sum;
  const float* vk_sum;
  float t;
  uint32_t rows;    // query rows per kv head (group * nq)
  uint32_t splits;  // token ranges per kv head
  uint64_t split_tokens;
  float* part;  // [hk][splits][rows][2 + r]: max, sum, latent sum
  float* out;
};

__device__ __forceinline__ float Load(const void* p, int dtype, uint64_t i) {
  if (dtype == 0) return static_cast<const float*>(p)[i];
  if (dtype == 1) return __half2float(static_cast<const __half*>(p)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}

__device__ __forceinline__ float Dequant(const Args& a, uint64_t row, uint32_t j) {
  const uint8_t* in = a.latent + row * a.lb;
  if (a.codec == 0) return __half2float(reinterpret_cast<const __half*>(in)[j]);
  const float s = __half2float(__ushort_as_half(a.scales[row * a.groups + j / a.gs]));
  int q;
  if (a.codec == 1) {
    q = static_cast<int8_t>(in[j]);
  } else {
    const uint32_t nib = (j % 2 == 0) ? (in[j / 2] & 15u) : (in[j / 2] >> 4);
    q = static_cast<int>((nib ^ 8u) & 15u) - 8;
  }
  return static_cast<float>(q) * s;
}

// True when `row` is an outlier row (raw_rows ascending).
__device__ __forceinline__ bool IsRaw(const Args& a, uint64_t row) {
  uint64_t lo = 0, hi = a.num_raw;
  while (lo < hi) {
    const uint64_t mid = (lo + hi) / 2;
    if (a.raw_rows[mid] < row) lo = mid + 1; else hi = mid;
  }
  return lo < a.num_raw && a.raw_rows[lo] == row;
}

__device__ __forceinline__ const void* QueryRow(const Args& a, uint32_t h, uint32_t row,
                                                uint64_t* base) {
  const uint32_t g = h * a.group + row / a.nq, i = row % a.nq;
  *base = uint64_t{g} * a.q_head_stride + uint64_t{i} * a.q_token_stride;
  return a.q;
}

__global__ void __launch_bounds__(kThreads) PartialKernel(Args a) {
  extern __shared__ float smem[];
  const uint32_t d = a.d, r = a.r, dp = d + 1;
  const uint32_t h = blockIdx.y, s = blockIdx.x, row0 = blockIdx.z * kRows;
  const uint32_t nrows = min(kRows, a.rows - row0);
  float* qs = smem;                   // [kRows][d], scaled by t
  float* ks = qs + kRows * d;         // [kTile][d + 1]
  float* zs = ks + kTile * dp;        // [kTile][r]
  float* ps = zs + kTile * r;         // [kRows][kTile]
  float* ms = ps + kRows * kTile;     // [kRows] running max
  float* ls = ms + kRows;             // [kRows] running sum
  float* cs = ls + kRows;             // [kRows] rescale of this tile
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  for (uint32_t x = tid; x < nrows * d; x += kThreads) {
    uint64_t base;
    const void* qp = QueryRow(a, h, row0 + x / d, &base);
    qs[x] = a.t * Load(qp, a.q_dtype, base + x % d);
  }
  if (tid < kRows) {
    ms[tid] = -INFINITY;
    ls[tid] = 0.0f;
  }
  float acc[kMaxAcc];
#pragma unroll
  for (int k = 0; k < kMaxAcc; ++k) acc[k] = 0.0f;
  const uint64_t hb = a.offsets[h], he = a.offsets[h + 1];
  const uint64_t b = min(he, hb + uint64_t{s} * a.split_tokens);
  const uint64_t e = min(he, b + a.split_tokens);
  __syncthreads();

  for (uint64_t t0 = b; t0 < e; t0 += kTile) {
    const uint32_t m = static_cast<uint32_t>(e - t0 < kTile ? e - t0 : kTile);
    for (uint32_t x = tid; x < m * d; x += kThreads) {
      ks[(x / d) * dp + x % d] = Load(a.keys, a.kv_dtype, t0 * d + x);
    }
    for (uint32_t x = tid; x < kTile * r; x += kThreads) {
      const uint32_t tt = x / r, j = x % r;
      zs[x] = tt < m ? Dequant(a, t0 + tt, j) : 0.0f;
    }
    __syncthreads();
    if (a.num_raw > 0 && tid < static_cast<int>(m) && IsRaw(a, t0 + tid)) {
      for (uint32_t j = 0; j < r; ++j) zs[tid * r + j] = 0.0f;
    }
    for (uint32_t x = tid; x < nrows * kTile; x += kThreads) {
      const uint32_t row = x / kTile, tt = x % kTile;
      float v = -INFINITY;
      if (tt < m) {
        const float* qr = qs + row * d;
        const float* kr = ks + tt * dp;
        float s0 = 0.0f, s1 = 0.0f;
        for (uint32_t c = 0; c < d; c += 2) {
          s0 = fmaf(qr[c], kr[c], s0);
          s1 = fmaf(qr[c + 1], kr[c + 1], s1);
        }
        v = s0 + s1;
      }
      ps[x] = v;
    }
    __syncthreads();
    for (uint32_t row = warp; row < nrows; row += kThreads / 32) {
      const float v = ps[row * kTile + lane];
      float mx = v;
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float old = ms[row];
      mx = fmaxf(mx, old);
      const float w = v == -INFINITY ? 0.0f : __expf(v - mx);
      float sum = w;
      for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      ps[row * kTile + lane] = w;
      __syncwarp();
      if (lane == 0) {
        const float c = old == -INFINITY ? 0.0f : __expf(old - mx);
        cs[row] = c;
        ls[row] = ls[row] * c + sum;
        ms[row] = mx;
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kMaxAcc; ++k) {
      const uint32_t x = tid + k * kThreads;
      if (x < nrows * r) {
        const uint32_t row = x / r, j = x % r;
        const float* pr = ps + row * kTile;
        float v = acc[k] * cs[row];
        for (uint32_t tt = 0; tt < m; ++tt) v = fmaf(pr[tt], zs[tt * r + j], v);
        acc[k] = v;
      }
    }
    __syncthreads();
  }
  const uint32_t stride = 2 + r;
  float* part = a.part + ((uint64_t{h} * a.splits + s) * a.rows + row0) * stride;
  for (uint32_t row = tid; row < nrows; row += kThreads) {
    part[row * stride] = ms[row];
    part[row * stride + 1] = ls[row];
  }
#pragma unroll
  for (int k = 0; k < kMaxAcc; ++k) {
    const uint32_t x = tid + k * kThreads;
    if (x < nrows * r) part[(x / r) * stride + 2 + x % r] = acc[k];
  }
}

// Sum over the CTA; every thread gets the result. `red` holds kThreads / 32 floats.
__device__ float BlockSum(float v, float* red) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float s = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) s += red[w];
  return s;
}

__device__ float BlockMax(float v, float* red) {
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float s = -INFINITY;
  for (int w = 0; w < kThreads / 32; ++w) s = fmaxf(s, red[w]);
  return s;
}

__global__ void __launch_bounds__(kThreads) CombineKernel(Args a) {
  extern __shared__ float smem[];
  const uint32_t d = a.d, r = a.r, row = blockIdx.x, h = blockIdx.y;
  float* qs = smem;       // [d], unscaled
  float* zc = qs + d;     // [r]
  float* os = zc + r;     // [d]
  float* red = os + d;    // [kThreads / 32]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  uint64_t base;
  const void* qp = QueryRow(a, h, row, &base);
  for (uint32_t c = tid; c < d; c += kThreads) qs[c] = Load(qp, a.q_dtype, base + c);
  __syncthreads();
  const uint32_t stride = 2 + r;
  const float* part = a.part + (uint64_t{h} * a.splits * a.rows + row) * stride;
  const uint64_t split_stride = uint64_t{a.rows} * stride;

  float mx = -INFINITY;
  for (uint32_t s = tid; s < a.splits; s += kThreads) mx = fmaxf(mx, part[s * split_stride]);
  const uint64_t n = a.count != nullptr ? a.count[h] : 0;
  float lv = -INFINITY;
  if (n > 0) {
    float v = 0.0f;
    for (uint32_t c = tid; c < d; c += kThreads) v += qs[c] * a.key_sum[uint64_t{h} * d + c];
    lv = a.t * BlockSum(v, red) / static_cast<float>(n) + logf(static_cast<float>(n));
    mx = fmaxf(mx, lv);
  }
  const float M = BlockMax(mx, red);
  float l = 0.0f;
  for (uint32_t s = tid; s < a.splits; s += kThreads) {
    const float pm = part[s * split_stride];
    if (pm != -INFINITY) l += part[s * split_stride + 1] * __expf(pm - M);
  }
  float L = BlockSum(l, red);
  for (uint32_t j = tid; j < r; j += kThreads) {
    float v = 0.0f;
    for (uint32_t s = 0; s < a.splits; ++s) {
      const float pm = part[s * split_stride];
      if (pm != -INFINITY) v = fmaf(__expf(pm - M), part[s * split_stride + 2 + j], v);
    }
    zc[j] = v;
  }
  __syncthreads();
  const float* E = a.expand + uint64_t{h} * r * d;
  for (uint32_t c = tid; c < d; c += kThreads) {
    float v = 0.0f;
    for (uint32_t j = 0; j < r; ++j) v = fmaf(zc[j], E[uint64_t{j} * d + c], v);
    os[c] = v;
  }
  if (n > 0) {
    // v_E = mu_v + t C q, C q = S q / n - mu_v (mu_k . q); one warp per output channel.
    const float inv = 1.0f / static_cast<float>(n);
    const float wv = __expf(lv - M);
    float kq = 0.0f;
    for (uint32_t c = tid; c < d; c += kThreads) kq += qs[c] * a.key_sum[uint64_t{h} * d + c];
    kq = BlockSum(kq, red) * inv;
    const float* S = a.vk_sum + uint64_t{h} * d * d;
    for (uint32_t c = warp; c < d; c += kThreads / 32) {
      float v = 0.0f;
      for (uint32_t j = lane; j < d; j += 32) v = fmaf(S[uint64_t{c} * d + j], qs[j], v);
      for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) {
        const float mu = a.value_sum[uint64_t{h} * d + c] * inv;
        os[c] += wv * (mu + a.t * (v * inv - mu * kq));
      }
    }
    L += wv;
    __syncthreads();
  }
  if (a.num_raw > 0) {
    const uint64_t hb = a.offsets[h], he = a.offsets[h + 1];
    uint64_t lo = 0, hi = a.num_raw;
    while (lo < hi) {
      const uint64_t mid = (lo + hi) / 2;
      if (a.raw_rows[mid] < hb) lo = mid + 1; else hi = mid;
    }
    for (uint64_t i = lo; i < a.num_raw && a.raw_rows[i] < he; ++i) {
      const uint64_t kr = a.raw_rows[i];
      float v = 0.0f;
      for (uint32_t c = tid; c < d; c += kThreads) v += qs[c] * Load(a.keys, a.kv_dtype, kr * d + c);
      const float w = __expf(a.t * BlockSum(v, red) - M);
      for (uint32_t c = tid; c < d; c += kThreads) {
        os[c] += w * Load(a.raw_values, a.kv_dtype, i * d + c);
      }
    }
  }
  __syncthreads();
  const uint32_t g = h * a.group + row / a.nq, qi = row % a.nq;
  float* o = a.out + (uint64_t{g} * a.nq + qi) * d;
  const float inv_l = L > 0.0f ? 1.0f / L : 0.0f;
  for (uint32_t c = tid; c < d; c += kThreads) o[c] = os[c] * inv_l;
}

int DtypeCode(DType t) { return t == DType::kF32 ? 0 : t == DType::kF16 ? 1 : 2; }

struct Plan {
  uint32_t rows, splits, row_blocks;
  uint64_t split_tokens;
};

Plan MakePlan(const LatentAttentionArgs& a) {
  Plan p;
  p.rows = (a.queries.num_heads / a.num_kv_heads) * static_cast<uint32_t>(a.queries.num_tokens);
  p.row_blocks = (p.rows + kRows - 1) / kRows;
  uint64_t max_n = 0;
  for (uint32_t h = 0; h < a.num_kv_heads; ++h) {
    max_n = std::max(max_n, a.host_offsets[h + 1] - a.host_offsets[h]);
  }
  static const int sms = [] {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n > 0 ? n : 100;
  }();
  // About four CTAs per multiprocessor, at least two tiles per range.
  const uint64_t want = std::max<uint64_t>(1, (4ull * sms) / (uint64_t{a.num_kv_heads} * p.row_blocks));
  const uint64_t most = std::max<uint64_t>(1, (max_n + 2 * kTile - 1) / (2 * kTile));
  p.splits = static_cast<uint32_t>(std::min(want, most));
  p.split_tokens = std::max<uint64_t>(1, (max_n + p.splits - 1) / p.splits);
  p.split_tokens = (p.split_tokens + kTile - 1) / kTile * kTile;
  return p;
}

}  // namespace

uint64_t LatentAttentionWorkspaceBytes(const LatentAttentionArgs& a) {
  if (a.num_kv_heads == 0 || a.queries.num_tokens == 0) return 0;
  const Plan p = MakePlan(a);
  return uint64_t{a.num_kv_heads} * p.splits * p.rows * (2 + a.value.rank) * sizeof(float);
}

absl::Status LatentAttentionCuda(void* stream, const LatentAttentionArgs& la, void* workspace) {
  const HeadsView& q = la.queries;
  const uint32_t hk = la.num_kv_heads, d = la.head_dim, r = la.value.rank;
  if (hk == 0 || q.num_heads % hk != 0 || q.head_dim != d || la.out == nullptr ||
      la.host_offsets.size() != uint64_t{hk} + 1 || la.expand == nullptr || d % 2 != 0 ||
      d > 256 || r == 0 || r > 256) {
    return absl::InvalidArgumentError("latent attention: arguments do not fit the layout");
  }
  if (q.num_tokens == 0) return absl::OkStatus();
  const Plan p = MakePlan(la);
  Args a{};
  a.q = q.data;
  a.q_dtype = DtypeCode(q.dtype);
  a.q_head_stride = q.head_stride;
  a.q_token_stride = q.token_stride;
  a.nq = static_cast<uint32_t>(q.num_tokens);
  a.group = q.num_heads / hk;
  a.keys = la.keys;
  a.kv_dtype = DtypeCode(la.key_dtype);
  a.offsets = la.offsets;
  a.d = d;
  a.r = r;
  a.gs = la.value.group_size;
  a.groups = static_cast<uint32_t>(la.value.Groups());
  a.lb = static_cast<uint32_t>(la.value.LatentBytes());
  a.codec = la.value.codec == ValueCodec::kOrthogonal       ? 0
            : la.value.codec == ValueCodec::kOrthogonalInt8 ? 1
                                                            : 2;
  a.latent = static_cast<const uint8_t*>(la.latent);
  a.scales = la.scales;
  a.expand = la.expand;
  a.num_raw = la.num_raw_rows;
  a.raw_rows = la.raw_rows;
  a.raw_values = la.raw_values;
  if (la.correct && la.moments.count != nullptr) {
    a.count = la.moments.count;
    a.key_sum = la.moments.key_sum;
    a.value_sum = la.moments.value_sum;
    a.vk_sum = la.moments.vk_sum;
  }
  a.t = la.scale > 0.0f ? la.scale : 1.0f / std::sqrt(static_cast<float>(d));
  a.rows = p.rows;
  a.splits = p.splits;
  a.split_tokens = p.split_tokens;
  a.part = static_cast<float*>(workspace);
  a.out = la.out;
  const auto s = static_cast<cudaStream_t>(stream);
  const size_t smem1 =
      sizeof(float) * (kRows * d + kTile * (d + 1) + kTile * r + kRows * kTile + 3 * kRows);
  cudaError_t err = cudaFuncSetAttribute(PartialKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem1));
  if (err == cudaSuccess) {
    PartialKernel<<<dim3(p.splits, hk, p.row_blocks), kThreads, smem1, s>>>(a);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) {
    const size_t smem2 = sizeof(float) * (2 * d + r + kThreads / 32);
    CombineKernel<<<dim3(p.rows, hk), kThreads, smem2, s>>>(a);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("decode: latent attention: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace decode
}  // namespace kvcomp
