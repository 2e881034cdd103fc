// The CPU reference of the KVSplice codec (kvcomp/kernels/codec_ops.h), per head and per row,
// shared by the CPU CodecOps, the calibration auto-tuner and the tests. The CUDA kernels follow
// the same arithmetic (f16 scale rounded up, round-half-even, clamp before conversion).
#ifndef KVCOMP_KERNELS_SRC_CPU_CODEC_CPU_INTERNAL_H_
#define KVCOMP_KERNELS_SRC_CPU_CODEC_CPU_INTERNAL_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/projection.h"
#include "kvsplice_internal.h"

namespace kvcomp {
namespace codec_internal {

// Largest magnitude of a quantized latent: 127 (int8) or 7 (int4).
inline int QMax(ValueCodec codec) { return codec == ValueCodec::kOrthogonalInt4 ? 7 : 127; }

// The f16 group scale: the smallest half >= max_abs / qmax (so |z| / scale <= qmax), 0 for a
// zero (or NaN) group, the largest finite half when it would overflow.
inline uint16_t GroupScaleHalf(float max_abs, int qmax) {
  const float s = max_abs / static_cast<float>(qmax);
  if (!(s > 0.0f)) return 0;
  if (s >= 65504.0f) return 0x7bff;
  uint16_t h = FloatToHalf(s);
  if (HalfToFloat(h) < s) ++h;  // positive finite halves are ordered like their bits
  return h;
}

// round(z / scale) clamped to [-qmax, qmax] (NaN becomes -qmax: fmaxf drops the NaN).
inline int QuantizeOne(float z, float scale, int qmax) {
  if (scale == 0.0f) return 0;
  const float q = std::fmin(std::fmax(z / scale, -static_cast<float>(qmax)),
                            static_cast<float>(qmax));
  return static_cast<int>(std::nearbyint(q));
}

// f16 of a latent, saturating at the largest finite half.
inline uint16_t LatentHalf(float z) {
  const float c = std::fmin(std::fmax(z, -65504.0f), 65504.0f);
  return FloatToHalf(c);
}

// Sign-extends a 4-bit two's complement nibble.
inline int Int4Value(uint8_t nibble) { return static_cast<int>((nibble ^ 8u) & 15u) - 8; }

// Encodes one row's latent z[0, rank) into `out` (params.LatentBytes()) and `scales`
// (params.Groups()).
void QuantizeRow(const float* z, const ValueCodecParams& params, uint8_t* out, uint16_t* scales);
// Dequantizes one row into z[0, rank).
void DequantizeRow(const uint8_t* in, const uint16_t* scales, const ValueCodecParams& params,
                   float* z);

// EncodeValueLayers' arguments checked (InvalidArgument) and cut into layers (row offsets
// rebased per layer, latent and scale starts, each layer's params at its rank).
absl::StatusOr<std::vector<kvsplice_internal::LayerRows>> PlanLayers(
    const Projection& projection, const ValueCodecParams& params,
    absl::Span<const uint32_t> layer_ranks, absl::Span<const uint64_t> row_offsets, DType dtype);

// EigenDecompose's buffer checks, the same on every backend (InvalidArgument).
absl::Status CheckEigenArgs(uint32_t dim, uint64_t batch, size_t gram, size_t eigenvalues,
                            size_t eigenvectors);

// The matrices of head `head` (absolute index in the projection) at params.rank:
// basis_t = P_r^T (head_dim x rank, row-major: the encoder's operand, no gamma) and
// dec = diag(gamma) P_r (rank x head_dim; gamma = 1 unless UsesGamma).
void HeadMatrices(const Projection& projection, uint64_t head, const ValueCodecParams& params,
                  std::vector<float>* basis_t, std::vector<float>* dec);

// The KVSplice encoder's arithmetic, the same bits on every CPU build and on CUDA
// (codec_kernels.cuh: FusedEncodeKernel), for n rows v [n x head_dim] of f32:
//   p[i][j]   = chain of fused multiply-adds over k = 0 .. head_dim - 1 in order, from +0, of
//               v[i][k] * basis_t[k][j]                   (the projection, f32)
//   energy[i] = the same chain of v[i][k]^2;  proj = the same chain over j < rank of p[i][j]^2
//   lost[i]   = max(+0, energy[i] - proj)                 (the outlier measure)
//   z[i][j]   = p[i][j] / gamma[j] (IEEE division) when gamma is given, else p[i][j]
// then QuantizeRow(z). `energy` and `lost` may be null (not computed).
void ProjectRows(const float* v, uint64_t n, uint32_t head_dim, const float* basis_t,
                 uint32_t rank, float* p, float* energy, float* lost);

// n rows of one head, f32 in: ProjectRows, the division by gamma (nullptr: none) and
// QuantizeRow. `z` a scratch of n * rank floats; energy/lost as in ProjectRows.
void EncodeRowsF32(const float* v, uint64_t n, uint32_t head_dim, const float* basis_t,
                   const float* gamma, const ValueCodecParams& params, float* z, uint8_t* latent,
                   uint16_t* scales, float* energy = nullptr, float* lost = nullptr);
void DecodeRowsF32(const uint8_t* latent, const uint16_t* scales, uint64_t n, uint32_t head_dim,
                   const float* dec, const ValueCodecParams& params, float* z, float* out);

// The pq codec ops' arguments: a valid basis shape (the basis' own Validate() is not rerun
// here), row_offsets of basis.num_heads() + 1 entries from 0, never decreasing, a dtype of f32,
// f16 or bf16. InvalidArgument.
absl::Status CheckPqCall(const pq::Basis& basis, absl::Span<const uint64_t> row_offsets,
                         DType dtype);

}  // namespace codec_internal
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CPU_CODEC_CPU_INTERNAL_H_
