// The Hadamard codec ("hq"): a fixed randomized Walsh-Hadamard rotation of each row (one token of
// one kv head, head_dim d elements) followed by asymmetric scalar quantization at b bits per
// element with one f16 minimum and one f16 step per row. The rotation spreads a row's energy
// evenly over its coordinates, so a per-row grid fits it without per-channel scales.
//
// Arithmetic (docs/format.md, "The Hadamard codec", is the byte-level specification; the CUDA
// twin follows it operation for operation, so the codes are bit-identical):
//   encode  u_i = s_i x_i                      (s_i = +-1: bit i of kHqSigns, 1 = negative)
//           u   = H u  (in place, f32, butterflies h = 1, 2, 4, ..., d/2; u_j, u_{j+h} <-
//                 u_j + u_{j+h}, u_j - u_{j+h})
//           y_i = u_i * c                      (c = f32 nearest 1/sqrt(d))
//           lo  = the largest f16 <= min_i y_i; step = the smallest f16 >= (max_i y_i - lo) / q
//                 (q = 2^b - 1; f32 subtraction and division), 0 when the row is constant;
//                 min and max order -0 below +0 (independent of the visiting order)
//           code_i = clamp(round_half_even((y_i - lo) / step), 0, q), 0 when step is 0
//   decode  y_i = fma(code_i, step, lo); u = H y; x_i = s_i (u_i * c)
// Each of these is a single IEEE f32 operation (no fused multiply-add except the decoder's fma;
// hq.cc is built with -ffp-contract=off), so the records and the decoded values do not depend on
// the machine: the CUDA twin (kernels/src/cuda/hq_cuda.cu, CodecOps::EncodeHq / DecodeHq) gives
// the same bits. A row whose rotation holds a NaN (overflow) is InvalidArgument. The decoded row
// is within 0.5 * step * sqrt(d) (L2, up to f32 rounding) of the input: the rotation is
// orthonormal.
//
// Row record, RowBytes(b, d) = 4 + d * b / 8 bytes: u16 LE f16 lo, u16 LE f16 step, then the d
// codes as a little-endian bit stream (code i in bits [b i, b i + b), bit k of the stream is bit
// k % 8 of byte k / 8).
//
// Head dimensions: a power of two in [8, 256]. Non-finite inputs and rows whose range does not
// fit f16 are InvalidArgument; decoding checks each record's lo and step (finite, step >= 0).
#ifndef KVCOMP_CODECS_HQ_H_
#define KVCOMP_CODECS_HQ_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kvcomp/core/dtype.h"

namespace kvcomp {
namespace hq {

inline constexpr uint32_t kMinHeadDim = 8;
inline constexpr uint32_t kMaxHeadDim = 256;
// The rotation's signs: bit i of word i / 64 set means s_i = -1. Fixed forever (stored caches
// depend on it).
inline constexpr uint64_t kHqSigns[4] = {0x9e3779b97f4a7c15ull, 0xbf58476d1ce4e5b9ull,
                                         0x94d049bb133111ebull, 0x2545f4914f6cdd1dull};

// -1.0f or 1.0f for element i.
inline float Sign(uint32_t i) {
  return ((kHqSigns[(i >> 6) & 3] >> (i & 63)) & 1u) ? -1.0f : 1.0f;
}

// OK when d is a power of two in [kMinHeadDim, kMaxHeadDim], else InvalidArgument.
absl::Status CheckHeadDim(uint32_t d);
// OK when bits is 2, 3 or 4 (the widths the format defines codecs for).
absl::Status CheckBits(uint32_t bits);
// Bytes of one row record.
inline uint64_t RowBytes(uint32_t bits, uint32_t d) { return 4 + uint64_t{d} * bits / 8; }

// The f32 constant c of the rotation for head dimension d.
float Normalizer(uint32_t d);
// In place, the unnormalized Walsh-Hadamard transform of u[0, d) in the butterfly order above.
void Hadamard(float* u, uint32_t d);

// One row: x[0, d) f32 into RowBytes(bits, d) bytes at out. d and bits must pass the checks.
absl::Status EncodeRow(const float* x, uint32_t d, uint32_t bits, uint8_t* out);
// The inverse into out[0, d). InvalidArgument for a record with a non-finite or negative step or
// a non-finite lo.
absl::Status DecodeRow(const uint8_t* in, uint32_t d, uint32_t bits, float* out);
// OK when the record's lo and step are a valid pair (what DecodeRow checks).
absl::Status CheckRecord(const uint8_t* in);

// `rows` rows of `dtype` (f32, f16, bf16) at src into rows * RowBytes(bits, d) bytes at out.
absl::Status EncodeRows(const void* src, DType dtype, uint64_t rows, uint32_t d, uint32_t bits,
                        uint8_t* out);
// The inverse into rows * d elements of `dtype` at dst.
absl::Status DecodeRows(const uint8_t* in, uint64_t rows, uint32_t d, uint32_t bits, void* dst,
                        DType dtype);

}  // namespace hq
}  // namespace kvcomp

#endif  // KVCOMP_CODECS_HQ_H_
