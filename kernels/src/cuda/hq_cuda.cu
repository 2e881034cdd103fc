// The Hadamard codec's CUDA twin (hq_cuda.h). The CPU reference is codecs/src/hq.cc; each step
// below names the line of EncodeRow / DecodeRow it reproduces. Only the _rn intrinsics do
// arithmetic (never contracted into fused multiply-adds), the extremes use the reference's order
// with -0 below +0 (so the reduction tree gives the same bits), and half conversions are IEEE
// round-to-nearest-even like core's FloatToHalf.
#include "hq_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_format.h"
#include "cuda_status.h"
#include "kvcomp/codecs/hq.h"

namespace kvcomp {
namespace hq_cuda {
namespace {

constexpr unsigned kThreads = 256;  // 8 warps per block
constexpr unsigned kFull = 0xffffffffu;
constexpr float kHalfMax = 65504.0f;

__constant__ unsigned long long kSigns[4] = {hq::kHqSigns[0], hq::kHqSigns[1], hq::kHqSigns[2],
                                             hq::kHqSigns[3]};

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void FromFloat(float v, float* p) { *p = v; }
__device__ __forceinline__ void FromFloat(float v, __half* p) { *p = __float2half_rn(v); }
__device__ __forceinline__ void FromFloat(float v, __nv_bfloat16* p) {
  *p = __float2bfloat16_rn(v);
}

__device__ __forceinline__ float HalfBitsToFloat(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}
__device__ __forceinline__ uint16_t FloatToHalfBits(float v) {
  return __half_as_ushort(__float2half_rn(v));
}
// hq.cc's NextUp / NextDown / HalfAtMost / HalfAtLeast.
__device__ __forceinline__ uint16_t NextUp(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x0001;
  return (h & 0x8000u) ? static_cast<uint16_t>(h - 1) : static_cast<uint16_t>(h + 1);
}
__device__ __forceinline__ uint16_t NextDown(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x8001;
  return (h & 0x8000u) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);
}
__device__ __forceinline__ uint16_t HalfAtMost(float v) {
  uint16_t h = FloatToHalfBits(v);
  if (HalfBitsToFloat(h) > v) h = NextDown(h);
  return h;
}
__device__ __forceinline__ uint16_t HalfAtLeast(float v) {
  uint16_t h = FloatToHalfBits(v);
  if (HalfBitsToFloat(h) < v) h = NextUp(h);
  return h;
}
// hq.cc's MinOf / MaxOf: -0 below +0, NaN never chosen over a number.
__device__ __forceinline__ float MinOf(float a, float b) {
  return (b < a || (b == a && signbit(b))) ? b : a;
}
__device__ __forceinline__ float MaxOf(float a, float b) {
  return (b > a || (b == a && !signbit(b))) ? b : a;
}

// Bits i * E .. i * E + E - 1 of the sign constant (element l * E + k is bit k).
template <int E>
__device__ __forceinline__ uint32_t LaneSigns(uint32_t first) {
  uint32_t s = 0;
#pragma unroll
  for (int k = 0; k < E; ++k) {
    const uint32_t i = first + k;
    if ((kSigns[(i >> 6) & 3] >> (i & 63)) & 1ull) s |= 1u << k;
  }
  return s;
}

// The unnormalized transform of one row held as E consecutive elements by each of L lanes
// (lane l: elements l E .. l E + E - 1): butterflies h = 1 .. E/2 in registers, then h = E m
// for m = 1 .. L/2 across lanes (lane l pairs with l ^ m, the lower index keeps the sum, the
// upper the lower minus the upper), in increasing h as Hadamard() runs them.
template <int E>
__device__ __forceinline__ void Transform(float (&v)[E], uint32_t l, uint32_t lanes) {
#pragma unroll
  for (int h = 1; h < E; h <<= 1) {
#pragma unroll
    for (int k = 0; k < E; ++k) {
      if ((k & h) == 0) {
        const float a = v[k], b = v[k + h];
        v[k] = __fadd_rn(a, b);
        v[k + h] = __fsub_rn(a, b);
      }
    }
  }
  for (uint32_t m = 1; m < lanes; m <<= 1) {
    const bool upper = (l & m) != 0;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const float o = __shfl_xor_sync(kFull, v[k], m);
      v[k] = upper ? __fsub_rn(o, v[k]) : __fadd_rn(v[k], o);
    }
  }
}

// ORs `nbits` (<= 32) bits of `value` into the little-endian bit stream of `words` at bit p.
__device__ __forceinline__ void OrBits(uint32_t* words, uint32_t p, uint32_t value,
                                       uint32_t nbits) {
  const uint32_t w = p >> 5, sh = p & 31;
  const uint64_t v = static_cast<uint64_t>(value) << sh;
  if (static_cast<uint32_t>(v) != 0) atomicOr(&words[w], static_cast<uint32_t>(v));
  if (sh + nbits > 32 && (v >> 32) != 0) atomicOr(&words[w + 1], static_cast<uint32_t>(v >> 32));
}

// Block-wide copy of `bytes` bytes (4-byte words when both ends allow).
__device__ __forceinline__ void CopyBytes(uint8_t* dst, const uint8_t* src, uint32_t bytes) {
  if ((reinterpret_cast<uintptr_t>(dst) & 3) == 0 && (reinterpret_cast<uintptr_t>(src) & 3) == 0 &&
      (bytes & 3) == 0) {
    auto* d4 = reinterpret_cast<uint32_t*>(dst);
    const auto* s4 = reinterpret_cast<const uint32_t*>(src);
    for (uint32_t i = threadIdx.x; i < bytes / 4; i += blockDim.x) d4[i] = s4[i];
  } else {
    for (uint32_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
  }
}

// Rows per block: 8 warps, 32 / L rows per warp.
__host__ __device__ __forceinline__ uint32_t RowsPerBlock(uint32_t d, int e) {
  return (kThreads / 32) * (32 / (d / static_cast<uint32_t>(e)));
}

template <int E, typename T>
__global__ void __launch_bounds__(kThreads)
    EncodeKernel(const T* __restrict__ src, uint64_t rows, uint32_t d, uint32_t bits, float c,
                 uint8_t* __restrict__ out, unsigned long long* error) {
  extern __shared__ uint32_t stage[];  // the block's records, packed as in `out`
  const uint32_t lanes = d / E;        // 8, 16 or 32
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t l = lane % lanes;
  const uint32_t rpb = RowsPerBlock(d, E);
  const uint32_t rib = warp * (32 / lanes) + lane / lanes;  // row in block
  const uint32_t rb = 4 + d * bits / 8;
  const uint32_t words = (rpb * rb + 3) / 4;
  const uint32_t signs = LaneSigns<E>(l * E);
  const float qmax = static_cast<float>((1u << bits) - 1);
  const uint32_t nbits = E * bits;
  for (uint64_t base = uint64_t{blockIdx.x} * rpb; base < rows; base += uint64_t{gridDim.x} * rpb) {
    for (uint32_t i = threadIdx.x; i < words; i += kThreads) stage[i] = 0;
    __syncthreads();
    const uint64_t r = base + rib;
    const bool valid = r < rows;
    float v[E];
    uint32_t bad = ~0u;  // first non-finite element of the lane
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const float x = valid ? ToFloat(src[r * d + l * E + k]) : 0.0f;
      if (!isfinite(x) && bad == ~0u) bad = l * E + k;
      v[k] = __fmul_rn(((signs >> k) & 1u) ? -1.0f : 1.0f, x);  // y[i] = Sign(i) * x[i]
    }
    Transform<E>(v, l, lanes);                                   // Hadamard(y, d)
    float mn = INFINITY, mx = -INFINITY;
    uint32_t nan = 0;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      v[k] = __fmul_rn(v[k], c);  // y[i] = y[i] * c
      nan |= isnan(v[k]) ? 1u : 0u;
      mn = MinOf(mn, v[k]);
      mx = MaxOf(mx, v[k]);
    }
    for (uint32_t m = lanes / 2; m > 0; m >>= 1) {
      mn = MinOf(mn, __shfl_xor_sync(kFull, mn, m));
      mx = MaxOf(mx, __shfl_xor_sync(kFull, mx, m));
      nan |= __shfl_xor_sync(kFull, nan, m);
      bad = min(bad, __shfl_xor_sync(kFull, bad, m));
    }
    uint64_t err = kNoError;
    uint16_t lo_h = 0, step_h = 0;
    float lo = 0.0f, step = 0.0f;
    if (bad != ~0u) {
      err = r << 16 | bad;
    } else if (nan != 0 || !(mn >= -kHalfMax) || !(mx <= kHalfMax)) {
      err = r << 16 | 1u << 9;
    } else {
      lo_h = HalfAtMost(mn);
      lo = HalfBitsToFloat(lo_h);
      const float s = __fdiv_rn(__fsub_rn(mx, lo), qmax);  // (mx - lo) / qmax
      if (!(s <= kHalfMax)) {
        err = r << 16 | 2u << 9;
      } else {
        step_h = s > 0.0f ? HalfAtLeast(s) : uint16_t{0};
        step = HalfBitsToFloat(step_h);
      }
    }
    if (valid && err != kNoError) {
      if (l == 0) atomicMin(error, static_cast<unsigned long long>(err));
    } else if (valid) {
      uint32_t codes = 0;
#pragma unroll
      for (int k = 0; k < E; ++k) {
        uint32_t q = 0;
        if (step > 0.0f) {
          // nearbyint((y[i] - lo) / step)
          const float t = rintf(__fdiv_rn(__fsub_rn(v[k], lo), step));
          q = t <= 0.0f ? 0u : t >= qmax ? static_cast<uint32_t>(qmax) : static_cast<uint32_t>(t);
        }
        codes |= q << (k * bits);
      }
      const uint32_t row_bit = rib * rb * 8;
      if (l == 0) OrBits(stage, row_bit, uint32_t{lo_h} | uint32_t{step_h} << 16, 32);
      OrBits(stage, row_bit + 32 + l * nbits, codes, nbits);
    }
    __syncthreads();
    const uint64_t n = min(uint64_t{rpb}, rows - base);
    CopyBytes(out + base * rb, reinterpret_cast<const uint8_t*>(stage),
              static_cast<uint32_t>(n * rb));
    __syncthreads();
  }
}

template <int E, typename T>
__global__ void __launch_bounds__(kThreads)
    DecodeKernel(const uint8_t* __restrict__ in, uint64_t rows, uint32_t d, uint32_t bits,
                 float c, T* __restrict__ dst, unsigned long long* error) {
  extern __shared__ uint32_t stage[];
  const uint32_t lanes = d / E;
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t l = lane % lanes;
  const uint32_t rpb = RowsPerBlock(d, E);
  const uint32_t rib = warp * (32 / lanes) + lane / lanes;
  const uint32_t rb = 4 + d * bits / 8;
  const uint32_t signs = LaneSigns<E>(l * E);
  const uint32_t nbits = E * bits, mask = (1u << bits) - 1;
  const auto* bytes = reinterpret_cast<const uint8_t*>(stage);
  for (uint64_t base = uint64_t{blockIdx.x} * rpb; base < rows; base += uint64_t{gridDim.x} * rpb) {
    const uint64_t n = min(uint64_t{rpb}, rows - base);
    CopyBytes(reinterpret_cast<uint8_t*>(stage), in + base * rb, static_cast<uint32_t>(n * rb));
    __syncthreads();
    const uint64_t r = base + rib;
    const bool valid = r < rows;
    const uint8_t* rec = bytes + rib * rb;
    uint16_t lo_h = 0, step_h = 0;
    uint64_t word = 0;
    if (valid) {
      lo_h = static_cast<uint16_t>(rec[0] | rec[1] << 8);
      step_h = static_cast<uint16_t>(rec[2] | rec[3] << 8);
      const uint32_t p = 32 + l * nbits;  // the lane's first code bit in the record
      const uint32_t first = p >> 3, last = (p + nbits - 1) >> 3;
      for (uint32_t b = first; b <= last; ++b) word |= uint64_t{rec[b]} << (8 * (b - first));
      word >>= p & 7;
    }
    __syncthreads();  // the stage is refilled next iteration
    // CheckRecord: finite halves, step >= +0.
    const bool ok = (lo_h & 0x7c00u) != 0x7c00u && (step_h & 0x7c00u) != 0x7c00u &&
                    (step_h & 0x8000u) == 0;
    if (valid && !ok && l == 0) {
      atomicMin(error, static_cast<unsigned long long>(r << 32 | uint64_t{lo_h} << 16 | step_h));
    }
    const float lo = ok ? HalfBitsToFloat(lo_h) : 0.0f;
    const float step = ok ? HalfBitsToFloat(step_h) : 0.0f;
    float v[E];
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const uint32_t q = static_cast<uint32_t>(word >> (k * bits)) & mask;
      v[k] = __fmaf_rn(static_cast<float>(q), step, lo);  // fma(q, step, lo)
    }
    Transform<E>(v, l, lanes);  // Hadamard(out, d)
    if (valid && ok) {
#pragma unroll
      for (int k = 0; k < E; ++k) {
        // Sign(i) * (out[i] * c)
        const float x = __fmul_rn(((signs >> k) & 1u) ? -1.0f : 1.0f, __fmul_rn(v[k], c));
        FromFloat(x, dst + r * d + l * E + k);
      }
    }
  }
}

int ElemsPerLane(uint32_t d) { return d >= 256 ? 8 : d >= 128 ? 4 : d >= 64 ? 2 : 1; }

unsigned Blocks(uint64_t rows, uint32_t d, int max_blocks) {
  const uint64_t rpb = RowsPerBlock(d, ElemsPerLane(d));
  const uint64_t need = (rows + rpb - 1) / rpb;
  return static_cast<unsigned>(std::max<uint64_t>(1, std::min<uint64_t>(need, max_blocks)));
}

size_t StageBytes(uint32_t d, uint32_t bits) {
  const uint64_t rb = hq::RowBytes(bits, d);
  return (RowsPerBlock(d, ElemsPerLane(d)) * rb + 3) / 4 * 4;
}

template <typename T>
void Encode(cudaStream_t stream, unsigned g, size_t smem, const void* src, uint64_t rows,
            uint32_t d, uint32_t bits, float c, uint8_t* out, unsigned long long* error) {
  const T* s = static_cast<const T*>(src);
  switch (ElemsPerLane(d)) {
    case 8:
      EncodeKernel<8, T><<<g, kThreads, smem, stream>>>(s, rows, d, bits, c, out, error);
      break;
    case 4:
      EncodeKernel<4, T><<<g, kThreads, smem, stream>>>(s, rows, d, bits, c, out, error);
      break;
    case 2:
      EncodeKernel<2, T><<<g, kThreads, smem, stream>>>(s, rows, d, bits, c, out, error);
      break;
    default:
      EncodeKernel<1, T><<<g, kThreads, smem, stream>>>(s, rows, d, bits, c, out, error);
  }
}

template <typename T>
void Decode(cudaStream_t stream, unsigned g, size_t smem, const uint8_t* in, uint64_t rows,
            uint32_t d, uint32_t bits, float c, void* dst, unsigned long long* error) {
  T* o = static_cast<T*>(dst);
  switch (ElemsPerLane(d)) {
    case 8:
      DecodeKernel<8, T><<<g, kThreads, smem, stream>>>(in, rows, d, bits, c, o, error);
      break;
    case 4:
      DecodeKernel<4, T><<<g, kThreads, smem, stream>>>(in, rows, d, bits, c, o, error);
      break;
    case 2:
      DecodeKernel<2, T><<<g, kThreads, smem, stream>>>(in, rows, d, bits, c, o, error);
      break;
    default:
      DecodeKernel<1, T><<<g, kThreads, smem, stream>>>(in, rows, d, bits, c, o, error);
  }
}

}  // namespace

absl::Status LaunchEncode(cudaStream_t stream, int max_blocks, const void* src, DType dtype,
                          uint64_t rows, uint32_t d, uint32_t bits, float c, uint8_t* out,
                          unsigned long long* error) {
  if (rows == 0) return absl::OkStatus();
  const unsigned g = Blocks(rows, d, max_blocks);
  const size_t smem = StageBytes(d, bits);
  switch (dtype) {
    case DType::kF32:
      Encode<float>(stream, g, smem, src, rows, d, bits, c, out, error);
      break;
    case DType::kF16:
      Encode<__half>(stream, g, smem, src, rows, d, bits, c, out, error);
      break;
    case DType::kBF16:
      Encode<__nv_bfloat16>(stream, g, smem, src, rows, d, bits, c, out, error);
      break;
    default:
      return absl::InvalidArgumentError("hq codec (CUDA): input dtype is not f32, f16 or bf16");
  }
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchDecode(cudaStream_t stream, int max_blocks, const uint8_t* in, uint64_t rows,
                          uint32_t d, uint32_t bits, float c, void* dst, DType dtype,
                          unsigned long long* error) {
  if (rows == 0) return absl::OkStatus();
  const unsigned g = Blocks(rows, d, max_blocks);
  const size_t smem = StageBytes(d, bits);
  switch (dtype) {
    case DType::kF32:
      Decode<float>(stream, g, smem, in, rows, d, bits, c, dst, error);
      break;
    case DType::kF16:
      Decode<__half>(stream, g, smem, in, rows, d, bits, c, dst, error);
      break;
    case DType::kBF16:
      Decode<__nv_bfloat16>(stream, g, smem, in, rows, d, bits, c, dst, error);
      break;
    default:
      return absl::InvalidArgumentError("hq codec (CUDA): output dtype is not f32, f16 or bf16");
  }
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status EncodeError(uint64_t key) {
  if (key == kNoError) return absl::OkStatus();
  const uint64_t row = key >> 16;
  switch ((key >> 9) & 0x7f) {
    case 0:
      return absl::InvalidArgumentError(absl::StrFormat(
          "hq codec: element %u of the row is not finite (row %u)", key & 0x1ff, row));
    case 1:
      return absl::InvalidArgumentError(absl::StrFormat(
          "hq codec: the rotated row leaves the f16 range (|value| > 65504) (row %u)", row));
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("hq codec: the row's range leaves the f16 range (row %u)", row));
  }
}

absl::Status DecodeError(uint64_t key) {
  if (key == kNoError) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "hq codec: row record with minimum 0x%04x and step 0x%04x (need finite halves, step >= "
      "+0) (row %u)",
      (key >> 16) & 0xffff, key & 0xffff, key >> 32));
}

}  // namespace hq_cuda
}  // namespace kvcomp
