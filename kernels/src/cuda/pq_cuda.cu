// The calibrated basis codec's CUDA twin (pq_cuda.h). The CPU reference is codecs/src/pq.cc
// (EncodeRows / DecodeRows); every arithmetic step below is its one IEEE f32 operation, by the
// round-to-nearest intrinsics (never contracted into fused multiply-adds), in its order: the
// projection's sum over the channels from channel 0 up, the decode's sum over the components with
// a width from the lowest up, so records and decoded values are the reference's bits.
#include "pq_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_format.h"
#include "cuda_status.h"

namespace kvcomp {
namespace pq_cuda {
namespace {

constexpr uint32_t kGroupRows = 8;  // rows a block codes together (each thread sums them at once)
constexpr uint32_t kCentroidFloats = 510;
constexpr uint32_t kBoundaryFloats = 502;

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void FromFloat(float v, float* p) { *p = v; }
__device__ __forceinline__ void FromFloat(float v, __half* p) { *p = __float2half_rn(v); }
__device__ __forceinline__ void FromFloat(float v, __nv_bfloat16* p) {
  *p = __float2bfloat16_rn(v);
}

// std::lower_bound's index over the ascending bd[0, n): the number of boundaries below u.
__device__ __forceinline__ uint32_t LowerBound(const float* bd, uint32_t n, float u) {
  uint32_t lo = 0;
  while (n > 0) {
    const uint32_t half = n >> 1;
    if (bd[lo + half] < u) {
      lo += half + 1;
      n -= half + 1;
    } else {
      n = half;
    }
  }
  return lo;
}

__host__ __device__ __forceinline__ uint32_t RecordWords(uint32_t record_bytes) {
  return (record_bytes + 3) / 4;
}

template <typename T>
__global__ void EncodeKernel(DeviceBasisView v, const uint64_t* __restrict__ offsets,
                             const T* __restrict__ src, uint8_t* __restrict__ out,
                             unsigned long long* error) {
  extern __shared__ float smem[];
  const uint32_t d = v.d, tid = threadIdx.x, rec = v.record_bytes, rw = RecordWords(rec);
  float* bounds = smem;                    // kBoundaryFloats
  float* t = smem + kBoundaryFloats;       // [kGroupRows][d]: x - mean
  uint32_t* words = reinterpret_cast<uint32_t*>(t + kGroupRows * d);  // [kGroupRows][rw]
  for (uint32_t i = tid; i < kBoundaryFloats; i += blockDim.x) {
    bounds[i] = v.tables[kCentroidFloats + i];
  }
  const uint64_t h = blockIdx.x;
  const uint64_t first = offsets[h], n = offsets[h + 1] - first;
  const float* mean = v.mean + h * d;
  const float* col = v.bt + h * d * d + tid;  // bt[j][tid] at col[j * d]
  uint32_t w = 0, off = 0;
  float inv = 0.0f;
  if (tid < d) {
    const uint32_t x = v.wo[h * d + tid];
    w = x & 0xffu;
    off = x >> 8;
    inv = v.inv_scale[h * d + tid];
  }
  for (uint64_t base = uint64_t{blockIdx.y} * kGroupRows; base < n;
       base += uint64_t{gridDim.y} * kGroupRows) {
    const uint32_t rows = static_cast<uint32_t>(min(uint64_t{kGroupRows}, n - base));
    __syncthreads();  // the previous group's reads are done (and the boundaries loaded)
    for (uint32_t i = tid; i < kGroupRows * d; i += blockDim.x) {
      const uint32_t r = i / d, j = i - r * d;
      float x = 0.0f;
      if (r < rows) {
        const uint64_t row = first + base + r;
        x = ToFloat(src[row * d + j]);
        if (!isfinite(x)) atomicMin(error, static_cast<unsigned long long>((row << 16) | j));
        x = __fsub_rn(x, mean[j]);  // t_j = x_j - mean_j
      }
      t[i] = x;
    }
    for (uint32_t i = tid; i < kGroupRows * rw; i += blockDim.x) words[i] = 0;
    __syncthreads();
    if (tid < d && w > 0) {
      float acc[kGroupRows];
      const float b0 = col[0];
#pragma unroll
      for (uint32_t r = 0; r < kGroupRows; ++r) acc[r] = __fmul_rn(b0, t[r * d]);
      for (uint32_t j = 1; j < d; ++j) {
        const float bj = col[uint64_t{j} * d];
#pragma unroll
        for (uint32_t r = 0; r < kGroupRows; ++r) {
          acc[r] = __fadd_rn(acc[r], __fmul_rn(bj, t[r * d + j]));
        }
      }
      const float* bd = bounds + (1u << w) - w - 1;
      const uint32_t nb = (1u << w) - 1, s = off & 31u;
#pragma unroll
      for (uint32_t r = 0; r < kGroupRows; ++r) {
        if (r >= rows) break;
        const float u = __fmul_rn(acc[r], inv);
        if (isnan(u)) {
          atomicMin(error, static_cast<unsigned long long>(((first + base + r) << 16) | (1u << 12)));
        }
        const uint32_t code = LowerBound(bd, nb, u);
        uint32_t* wr = words + r * rw + (off >> 5);
        atomicOr(wr, code << s);
        if (s + w > 32) atomicOr(wr + 1, code >> (32 - s));
      }
    }
    __syncthreads();
    for (uint32_t i = tid; i < rows * rec; i += blockDim.x) {
      const uint32_t r = i / rec, k = i - r * rec;
      out[(first + base + r) * rec + k] =
          static_cast<uint8_t>(words[r * rw + (k >> 2)] >> (8 * (k & 3)));
    }
  }
}

template <typename T>
__global__ void DecodeKernel(DeviceBasisView v, const uint64_t* __restrict__ offsets,
                             const uint8_t* __restrict__ in, T* __restrict__ dst,
                             unsigned long long* error) {
  extern __shared__ float smem[];
  const uint32_t d = v.d, tid = threadIdx.x, rec = v.record_bytes, rw = RecordWords(rec);
  float* cent = smem;                       // kCentroidFloats
  float* vals = smem + kCentroidFloats;     // [kGroupRows][d]: centroid x scale per component
  uint32_t* comps = reinterpret_cast<uint32_t*>(vals + kGroupRows * d);  // [d]
  uint32_t* words = comps + d;                                           // [kGroupRows][rw]
  const uint64_t h = blockIdx.x;
  for (uint32_t i = tid; i < kCentroidFloats; i += blockDim.x) cent[i] = v.tables[i];
  for (uint32_t i = tid; i < d; i += blockDim.x) comps[i] = v.comps[h * d + i];
  const uint64_t first = offsets[h], n = offsets[h + 1] - first;
  const uint32_t nc = v.ncomp[h], pad = v.bits_total & 7u;
  uint32_t w = 0, off = 0;
  float sc = 0.0f, mean = 0.0f;
  if (tid < d) {
    const uint32_t x = v.wo[h * d + tid];
    w = x & 0xffu;
    off = x >> 8;
    sc = v.scale[h * d + tid];
    mean = v.mean[h * d + tid];
  }
  const float* bcol = v.b + h * d * d + tid;  // basis[c][tid] at bcol[c * d]
  for (uint64_t base = uint64_t{blockIdx.y} * kGroupRows; base < n;
       base += uint64_t{gridDim.y} * kGroupRows) {
    const uint32_t rows = static_cast<uint32_t>(min(uint64_t{kGroupRows}, n - base));
    __syncthreads();  // the previous group's reads are done (and the tables loaded)
    for (uint32_t i = tid; i < kGroupRows * rw; i += blockDim.x) {
      const uint32_t r = i / rw, k = i - r * rw;
      uint32_t word = 0;
      if (r < rows) {
        const uint8_t* p = in + (first + base + r) * rec;
        for (uint32_t b = 0; b < 4; ++b) {
          const uint32_t at = 4 * k + b;
          if (at < rec) word |= uint32_t{p[at]} << (8 * b);
        }
      }
      words[i] = word;
    }
    if (pad != 0 && tid < rows) {
      const uint64_t row = first + base + tid;
      if ((in[row * rec + rec - 1] >> pad) != 0) {
        atomicMin(error, static_cast<unsigned long long>(row));
      }
    }
    __syncthreads();
    if (tid < d && w > 0) {
      const uint32_t s = off & 31u, mask = (1u << w) - 1;
      const float* cw = cent + (1u << w) - 2;
      for (uint32_t r = 0; r < rows; ++r) {
        const uint32_t* wr = words + r * rw + (off >> 5);
        uint32_t bits = wr[0] >> s;
        if (s + w > 32) bits |= wr[1] << (32 - s);
        vals[r * d + tid] = __fmul_rn(cw[bits & mask], sc);  // v_c = centroid x scale_c
      }
    }
    __syncthreads();
    if (tid < d) {
      float acc[kGroupRows];
      if (nc > 0) {
        const uint32_t c0 = comps[0];
        const float b0 = bcol[uint64_t{c0} * d];
#pragma unroll
        for (uint32_t r = 0; r < kGroupRows; ++r) acc[r] = __fmul_rn(vals[r * d + c0], b0);
        for (uint32_t k = 1; k < nc; ++k) {
          const uint32_t c = comps[k];
          const float bc = bcol[uint64_t{c} * d];
#pragma unroll
          for (uint32_t r = 0; r < kGroupRows; ++r) {
            acc[r] = __fadd_rn(acc[r], __fmul_rn(vals[r * d + c], bc));
          }
        }
      }
#pragma unroll
      for (uint32_t r = 0; r < kGroupRows; ++r) {
        if (r >= rows) break;
        const float y = nc > 0 ? __fadd_rn(mean, acc[r]) : mean;  // y_j = mean_j + a_j
        FromFloat(y, dst + (first + base + r) * d + tid);
      }
    }
  }
}

uint64_t Align(uint64_t x) { return (x + 255) / 256 * 256; }

uint32_t Threads(uint32_t d) { return std::max(64u, (d + 31) / 32 * 32); }

dim3 Grid(const DeviceBasisView& v, uint64_t max_rows) {
  const uint64_t groups = std::max<uint64_t>(1, (max_rows + kGroupRows - 1) / kGroupRows);
  // About 8 blocks a head beyond the first: enough to fill the card at a put's 256 heads, each
  // block going through its head's row groups in strides.
  const uint64_t y = std::min<uint64_t>({groups, 65535, std::max<uint64_t>(8, 4096 / v.heads)});
  return dim3(v.heads, static_cast<unsigned>(y));
}

size_t EncodeSmem(const DeviceBasisView& v) {
  return 4 * (kBoundaryFloats + kGroupRows * v.d + kGroupRows * RecordWords(v.record_bytes));
}
size_t DecodeSmem(const DeviceBasisView& v) {
  return 4 * (kCentroidFloats + kGroupRows * v.d + v.d + kGroupRows * RecordWords(v.record_bytes));
}

// The head of global row `row` and the row within it.
void HeadOf(uint64_t row, absl::Span<const uint64_t> offsets, uint64_t* head, uint64_t* within) {
  const auto it = std::upper_bound(offsets.begin(), offsets.end(), row);
  const uint64_t h = it == offsets.begin() ? 0 : static_cast<uint64_t>(it - offsets.begin()) - 1;
  *head = h;
  *within = row - offsets[std::min<uint64_t>(h, offsets.size() - 1)];
}

}  // namespace

Layout LayoutOf(const pq::Basis& basis) {
  const uint64_t heads = basis.num_heads(), d = basis.head_dim;
  Layout l;
  uint64_t at = 0;
  auto take = [&](uint64_t bytes) {
    const uint64_t here = at;
    at = Align(at + bytes);
    return here;
  };
  l.mean = take(4 * heads * d);
  l.scale = take(4 * heads * d);
  l.inv_scale = take(4 * heads * d);
  l.wo = take(4 * heads * d);
  l.comps = take(4 * heads * d);
  l.ncomp = take(4 * heads);
  l.bt = take(4 * heads * d * d);
  l.b = take(4 * heads * d * d);
  l.tables = take(4 * kTableFloats);
  l.bytes = at;
  return l;
}

std::vector<uint8_t> HostImage(const pq::Basis& basis, const Layout& l) {
  const uint64_t heads = basis.num_heads(), d = basis.head_dim;
  std::vector<uint8_t> img(l.bytes, 0);
  std::memcpy(img.data() + l.mean, basis.mean.data(), 4 * heads * d);
  std::memcpy(img.data() + l.scale, basis.scale.data(), 4 * heads * d);
  std::memcpy(img.data() + l.inv_scale, basis.inv_scale.data(), 4 * heads * d);
  std::memcpy(img.data() + l.b, basis.basis.data(), 4 * heads * d * d);
  auto* wo = reinterpret_cast<uint32_t*>(img.data() + l.wo);
  auto* comps = reinterpret_cast<uint32_t*>(img.data() + l.comps);
  auto* ncomp = reinterpret_cast<uint32_t*>(img.data() + l.ncomp);
  auto* bt = reinterpret_cast<float*>(img.data() + l.bt);
  for (uint64_t h = 0; h < heads; ++h) {
    uint32_t bit = 0, k = 0;
    for (uint64_t c = 0; c < d; ++c) {
      const uint32_t w = basis.widths[h * d + c];
      wo[h * d + c] = w | (bit << 8);
      bit += w;
      if (w > 0) comps[h * d + k++] = static_cast<uint32_t>(c);
    }
    ncomp[h] = k;
    const float* B = basis.basis.data() + h * d * d;
    for (uint64_t c = 0; c < d; ++c)
      for (uint64_t j = 0; j < d; ++j) bt[h * d * d + j * d + c] = B[c * d + j];
  }
  auto* tables = reinterpret_cast<float*>(img.data() + l.tables);
  for (uint32_t w = 1; w <= pq::kMaxWidth; ++w) {
    const absl::Span<const float> c = pq::Centroids(w), b = pq::Boundaries(w);
    std::copy(c.begin(), c.end(), tables + (1u << w) - 2);
    std::copy(b.begin(), b.end(), tables + kCentroidFloats + (1u << w) - w - 1);
  }
  return img;
}

DeviceBasisView ViewOf(const pq::Basis& basis, const Layout& l, const void* device) {
  const auto* p = static_cast<const uint8_t*>(device);
  DeviceBasisView v;
  v.mean = reinterpret_cast<const float*>(p + l.mean);
  v.scale = reinterpret_cast<const float*>(p + l.scale);
  v.inv_scale = reinterpret_cast<const float*>(p + l.inv_scale);
  v.wo = reinterpret_cast<const uint32_t*>(p + l.wo);
  v.comps = reinterpret_cast<const uint32_t*>(p + l.comps);
  v.ncomp = reinterpret_cast<const uint32_t*>(p + l.ncomp);
  v.bt = reinterpret_cast<const float*>(p + l.bt);
  v.b = reinterpret_cast<const float*>(p + l.b);
  v.tables = reinterpret_cast<const float*>(p + l.tables);
  v.heads = static_cast<uint32_t>(basis.num_heads());
  v.d = basis.head_dim;
  v.bits_total = basis.bits_total;
  v.record_bytes = static_cast<uint32_t>(basis.RecordBytes());
  return v;
}

absl::Status LaunchEncode(cudaStream_t stream, const DeviceBasisView& v, const uint64_t* offsets,
                          uint64_t max_rows, const void* src, DType dtype, uint8_t* out,
                          unsigned long long* error) {
  if (max_rows == 0) return absl::OkStatus();
  const dim3 g = Grid(v, max_rows);
  const unsigned t = Threads(v.d);
  const size_t smem = EncodeSmem(v);
  switch (dtype) {
    case DType::kF32:
      EncodeKernel<float><<<g, t, smem, stream>>>(v, offsets, static_cast<const float*>(src),
                                                  out, error);
      break;
    case DType::kF16:
      EncodeKernel<__half><<<g, t, smem, stream>>>(v, offsets, static_cast<const __half*>(src),
                                                   out, error);
      break;
    case DType::kBF16:
      EncodeKernel<__nv_bfloat16><<<g, t, smem, stream>>>(
          v, offsets, static_cast<const __nv_bfloat16*>(src), out, error);
      break;
    default:
      return absl::InvalidArgumentError("pq codec (CUDA): input dtype is not f32, f16 or bf16");
  }
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchDecode(cudaStream_t stream, const DeviceBasisView& v, const uint64_t* offsets,
                          uint64_t max_rows, const uint8_t* in, void* dst, DType dtype,
                          unsigned long long* error) {
  if (max_rows == 0) return absl::OkStatus();
  const dim3 g = Grid(v, max_rows);
  const unsigned t = Threads(v.d);
  const size_t smem = DecodeSmem(v);
  switch (dtype) {
    case DType::kF32:
      DecodeKernel<float><<<g, t, smem, stream>>>(v, offsets, in, static_cast<float*>(dst),
                                                  error);
      break;
    case DType::kF16:
      DecodeKernel<__half><<<g, t, smem, stream>>>(v, offsets, in, static_cast<__half*>(dst),
                                                   error);
      break;
    case DType::kBF16:
      DecodeKernel<__nv_bfloat16><<<g, t, smem, stream>>>(
          v, offsets, in, static_cast<__nv_bfloat16*>(dst), error);
      break;
    default:
      return absl::InvalidArgumentError("pq codec (CUDA): output dtype is not f32, f16 or bf16");
  }
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status EncodeError(uint64_t key, absl::Span<const uint64_t> offsets) {
  if (key == kNoError) return absl::OkStatus();
  uint64_t head = 0, row = 0;
  HeadOf(key >> 16, offsets, &head, &row);
  if (((key >> 12) & 0xf) == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "pq head %u: pq codec: row %u element %u is not finite", head, row, key & 0xfff));
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("pq head %u: pq codec: row %u overflows in the projection", head, row));
}

absl::Status DecodeError(uint64_t key, absl::Span<const uint64_t> offsets) {
  if (key == kNoError) return absl::OkStatus();
  uint64_t head = 0, row = 0;
  HeadOf(key, offsets, &head, &row);
  return absl::InvalidArgumentError(absl::StrFormat(
      "pq head %u: pq codec: record %u has nonzero padding bits", head, row));
}

}  // namespace pq_cuda
}  // namespace kvcomp
