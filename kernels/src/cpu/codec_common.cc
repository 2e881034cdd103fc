// Backend-independent parts of the codec: parameter checks and the per-row reference arithmetic.
#include <algorithm>
#include <cmath>

#include <vector>

#include "absl/strings/str_format.h"
#include "codec_cpu_internal.h"
#include "gemm_kernels.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/codec_ops.h"

namespace kvcomp {

uint64_t ValueCodecParams::LatentBytes() const {
  switch (codec) {
    case ValueCodec::kRaw:
    case ValueCodec::kHq4:  // not a projection codec (kvcomp/codecs/hq.h)
    case ValueCodec::kHq3:
    case ValueCodec::kPq:  // nor is pq (kvcomp/codecs/pq.h)
      return 0;
    case ValueCodec::kOrthogonal:
      return 2ull * rank;
    case ValueCodec::kOrthogonalInt8:
      return rank;
    case ValueCodec::kOrthogonalInt4:
      return (rank + 1ull) / 2;
  }
  return 0;
}

uint64_t ValueCodecParams::Groups() const {
  if (codec != ValueCodec::kOrthogonalInt8 && codec != ValueCodec::kOrthogonalInt4) return 0;
  return group_size == 0 ? 0 : (uint64_t{rank} + group_size - 1) / group_size;
}

bool ValueCodecParams::UsesGamma() const { return gamma_aware && Groups() > 0; }

absl::Status ValueCodecParams::ValidateFor(const Projection& projection) const {
  if (!IsProjectionCodec(codec)) {
    return absl::InvalidArgumentError("codec: value codec must be orthogonal, _int8 or _int4");
  }
  if (rank == 0 || rank > projection.rows) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "codec: rank %u outside [1, %u] (the projection keeps %u rows per head)", rank,
        projection.rows, projection.rows));
  }
  if (codec == ValueCodec::kOrthogonalInt4 && rank % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat("codec: int4 needs an even rank, got %u",
                                                      rank));
  }
  const bool quantized = codec == ValueCodec::kOrthogonalInt8 || codec == ValueCodec::kOrthogonalInt4;
  if (quantized && (group_size == 0 || group_size > 256)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("codec: group_size %u outside [1, 256]", group_size));
  }
  if (projection.version == 0) {
    return absl::InvalidArgumentError("codec: the projection is not sealed (version 0)");
  }
  return absl::OkStatus();
}

absl::Status RowSpan::Validate(uint64_t max_heads) const {
  if (row_offsets.empty() || row_offsets[0] != 0) {
    return absl::InvalidArgumentError("codec: row_offsets must hold heads + 1 entries from 0");
  }
  for (size_t i = 1; i < row_offsets.size(); ++i) {
    if (row_offsets[i] < row_offsets[i - 1]) {
      return absl::InvalidArgumentError("codec: row_offsets decrease");
    }
  }
  if (first_head > max_heads || num_heads() > max_heads - first_head) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "codec: heads [%u, %u) beyond the projection's %u", first_head, first_head + num_heads(),
        max_heads));
  }
  return absl::OkStatus();
}

namespace codec_internal {

void QuantizeRow(const float* z, const ValueCodecParams& p, uint8_t* out, uint16_t* scales) {
  const uint32_t r = p.rank;
  if (p.codec == ValueCodec::kOrthogonal) {
    auto* h = reinterpret_cast<uint16_t*>(out);
    for (uint32_t j = 0; j < r; ++j) h[j] = LatentHalf(z[j]);
    return;
  }
  const int qmax = QMax(p.codec);
  const uint32_t gs = p.group_size;
  const uint64_t groups = p.Groups();
  if (p.codec == ValueCodec::kOrthogonalInt4) std::fill(out, out + p.LatentBytes(), 0);
  for (uint64_t g = 0; g < groups; ++g) {
    const uint32_t lo = static_cast<uint32_t>(g * gs);
    const uint32_t hi = std::min(r, lo + gs);
    float m = 0.0f;
    for (uint32_t j = lo; j < hi; ++j) m = std::fmax(m, std::fabs(z[j]));
    const uint16_t sh = GroupScaleHalf(m, qmax);
    scales[g] = sh;
    const float s = HalfToFloat(sh);
    for (uint32_t j = lo; j < hi; ++j) {
      const int q = QuantizeOne(z[j], s, qmax);
      if (p.codec == ValueCodec::kOrthogonalInt8) {
        out[j] = static_cast<uint8_t>(static_cast<int8_t>(q));
      } else {
        const uint8_t nib = static_cast<uint8_t>(q) & 15u;
        out[j / 2] |= (j % 2 == 0) ? nib : static_cast<uint8_t>(nib << 4);
      }
    }
  }
}

void DequantizeRow(const uint8_t* in, const uint16_t* scales, const ValueCodecParams& p,
                   float* z) {
  const uint32_t r = p.rank;
  if (p.codec == ValueCodec::kOrthogonal) {
    const auto* h = reinterpret_cast<const uint16_t*>(in);
    for (uint32_t j = 0; j < r; ++j) z[j] = HalfToFloat(h[j]);
    return;
  }
  const uint32_t gs = p.group_size;
  for (uint32_t j = 0; j < r; ++j) {
    const float s = HalfToFloat(scales[j / gs]);
    int q;
    if (p.codec == ValueCodec::kOrthogonalInt8) {
      q = static_cast<int8_t>(in[j]);
    } else {
      q = Int4Value(j % 2 == 0 ? (in[j / 2] & 15u) : (in[j / 2] >> 4));
    }
    z[j] = static_cast<float>(q) * s;
  }
}

absl::Status CheckEigenArgs(uint32_t dim, uint64_t batch, size_t gram, size_t eigenvalues,
                            size_t eigenvectors) {
  const uint64_t dd = uint64_t{dim} * dim;
  if (dim == 0 || gram != batch * dd || eigenvalues != batch * dim || eigenvectors != batch * dd) {
    return absl::InvalidArgumentError("codec: EigenDecompose buffer sizes do not match");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<kvsplice_internal::LayerRows>> PlanLayers(
    const Projection& projection, const ValueCodecParams& params,
    absl::Span<const uint32_t> layer_ranks, absl::Span<const uint64_t> row_offsets,
    DType dtype) {
  KVCOMP_RETURN_IF_ERROR(params.ValidateFor(projection));
  if (!IsInputDType(dtype)) {
    return absl::InvalidArgumentError("codec: value dtype must be f32, f16 or bf16");
  }
  if (layer_ranks.size() != projection.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "codec: %u layer ranks for a projection of %u layers", layer_ranks.size(),
        projection.num_layers));
  }
  for (uint32_t r : layer_ranks) {
    ValueCodecParams lp = params;
    lp.rank = r;
    if (r > params.rank) {
      return absl::InvalidArgumentError(
          absl::StrFormat("codec: layer rank %u above the call's rank %u", r, params.rank));
    }
    KVCOMP_RETURN_IF_ERROR(lp.ValidateFor(projection));
  }
  RowSpan all;
  all.row_offsets = row_offsets;
  KVCOMP_RETURN_IF_ERROR(all.Validate(projection.num_heads()));
  if (all.num_heads() != projection.num_heads()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "codec: row offsets of %u heads, the projection has %u", all.num_heads(),
        projection.num_heads()));
  }
  const std::vector<uint64_t> offsets(row_offsets.begin(), row_offsets.end());
  const std::vector<uint32_t> ranks(layer_ranks.begin(), layer_ranks.end());
  return kvsplice_internal::SplitLayers(offsets, projection.num_kv_heads, params, ranks);
}

void HeadMatrices(const Projection& projection, uint64_t head, const ValueCodecParams& p,
                  std::vector<float>* basis_t, std::vector<float>* dec) {
  const uint32_t d = projection.head_dim, r = p.rank;
  const float* basis = projection.head_basis(head);
  const float* gamma = projection.head_gamma(head);
  const bool use_gamma = p.UsesGamma();
  basis_t->resize(uint64_t{r} * d);
  dec->resize(uint64_t{r} * d);
  for (uint32_t j = 0; j < r; ++j) {
    const float g = use_gamma ? gamma[j] : 1.0f;
    for (uint32_t k = 0; k < d; ++k) {
      const float b = basis[uint64_t{j} * d + k];
      (*basis_t)[uint64_t{k} * r + j] = b;
      (*dec)[uint64_t{j} * d + k] = b * g;
    }
  }
}

// The chains run in the widest build the CPU takes (gemm_kernels.h: chain_a_b,
// chain_row_squares); fused multiply-adds are exactly rounded, so the build does not change a bit.
void ProjectRows(const float* v, uint64_t n, uint32_t d, const float* basis_t, uint32_t r,
                 float* p, float* energy, float* lost) {
  if (n == 0) return;
  const cpu::GemmKernels& g = cpu::Gemm();
  g.chain_a_b(v, basis_t, p, n, d, r);
  if (energy == nullptr && lost == nullptr) return;
  std::vector<float> e(n), pp(n);
  g.chain_row_squares(v, e.data(), n, d);
  g.chain_row_squares(p, pp.data(), n, r);
  for (uint64_t i = 0; i < n; ++i) {
    if (energy != nullptr) energy[i] = e[i];
    if (lost != nullptr) {
      const float l = e[i] - pp[i];
      lost[i] = l > 0.0f ? l : 0.0f;
    }
  }
}

void EncodeRowsF32(const float* v, uint64_t n, uint32_t d, const float* basis_t,
                   const float* gamma, const ValueCodecParams& p, float* z, uint8_t* latent,
                   uint16_t* scales, float* energy, float* lost) {
  if (n == 0) return;
  const uint32_t r = p.rank;
  ProjectRows(v, n, d, basis_t, r, z, energy, lost);
  const uint64_t lb = p.LatentBytes(), groups = p.Groups();
  for (uint64_t i = 0; i < n; ++i) {
    float* zi = z + i * r;
    if (gamma != nullptr) {
      for (uint32_t j = 0; j < r; ++j) zi[j] = zi[j] / gamma[j];
    }
    QuantizeRow(zi, p, latent + i * lb, groups ? scales + i * groups : nullptr);
  }
}

void DecodeRowsF32(const uint8_t* latent, const uint16_t* scales, uint64_t n, uint32_t d,
                   const float* dec, const ValueCodecParams& p, float* z, float* out) {
  if (n == 0) return;
  const uint32_t r = p.rank;
  const uint64_t lb = p.LatentBytes(), groups = p.Groups();
  for (uint64_t i = 0; i < n; ++i) {
    DequantizeRow(latent + i * lb, groups ? scales + i * groups : nullptr, p, z + i * r);
  }
  std::fill(out, out + n * d, 0.0f);
  cpu::Gemm().add_a_b(z, dec, out, n, r, d);  // out [n x d] = z [n x r] dec [r x d]
}

absl::Status CheckPqCall(const pq::Basis& basis, absl::Span<const uint64_t> row_offsets,
                         DType dtype) {
  if (!IsInputDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pq codec: dtype %s is not f32, f16 or bf16", DTypeName(dtype)));
  }
  const uint64_t heads = basis.num_heads(), d = basis.head_dim;
  if (heads == 0 || d == 0 || d > pq::kMaxHeadDim || basis.bits_total == 0 ||
      basis.bits_total > pq::kMaxWidth * d || basis.mean.size() != heads * d ||
      basis.scale.size() != heads * d || basis.inv_scale.size() != heads * d ||
      basis.widths.size() != heads * d || basis.basis.size() != heads * d * d) {
    return absl::InvalidArgumentError("pq codec: the basis' arrays do not match its shape");
  }
  if (row_offsets.size() != heads + 1 || row_offsets[0] != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "pq codec: %u row offsets for a basis of %u heads (want heads + 1, from 0)",
        row_offsets.size(), heads));
  }
  for (uint64_t h = 0; h < heads; ++h) {
    if (row_offsets[h + 1] < row_offsets[h]) {
      return absl::InvalidArgumentError(
          absl::StrFormat("pq codec: row offsets decrease at head %u", h));
    }
  }
  return absl::OkStatus();
}

}  // namespace codec_internal
}  // namespace kvcomp
