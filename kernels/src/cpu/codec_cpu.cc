// CPU CodecOps: tiles of rows of one head, spread over the backend's pool. Each tile is
// converted to f32, multiplied by the head's encode/decode matrix through Eigen's GEMM (built
// for the running CPU's widest ISA, gemm_kernels.h) and (de)quantized while it is still in
// cache; decode writes only V'.
#include <Eigen/Core>
#include <Eigen/Eigenvalues>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_format.h"
#include "codec_cpu_internal.h"
#include "cpu_ops.h"
#include "gemm_kernels.h"
#include "kvcomp/codecs/hq.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace {

constexpr uint64_t kTileRows = 64;

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using RowMatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// n elements of `dtype` at `src` (element offset `at`) into f32.
void ToF32(const void* src, DType dtype, uint64_t at, uint64_t n, float* out) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, static_cast<const float*>(src) + at, n * sizeof(float));
      break;
    case DType::kF16: {
      const auto* h = static_cast<const uint16_t*>(src) + at;
      for (uint64_t i = 0; i < n; ++i) out[i] = HalfToFloat(h[i]);
      break;
    }
    case DType::kBF16: {
      const auto* h = static_cast<const uint16_t*>(src) + at;
      for (uint64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(h[i]);
      break;
    }
    default:
      std::fill(out, out + n, 0.0f);
  }
}

void FromF32(const float* in, uint64_t n, void* dst, DType dtype, uint64_t at) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(static_cast<float*>(dst) + at, in, n * sizeof(float));
      break;
    case DType::kF16: {
      auto* h = static_cast<uint16_t*>(dst) + at;
      for (uint64_t i = 0; i < n; ++i) h[i] = FloatToHalf(in[i]);
      break;
    }
    case DType::kBF16: {
      auto* h = static_cast<uint16_t*>(dst) + at;
      for (uint64_t i = 0; i < n; ++i) h[i] = FloatToBf16(in[i]);
      break;
    }
    default:
      break;
  }
}

absl::Status CheckInputDType(DType dtype, absl::string_view what) {
  if (!IsInputDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("codec: %s dtype %s is not f32, f16 or bf16", what, DTypeName(dtype)));
  }
  return absl::OkStatus();
}

// One unit of parallel work: rows [begin, end) of head `head` (relative to the call).
struct Tile {
  uint64_t head, begin, end;
};

std::vector<Tile> MakeTiles(const RowSpan& rows) {
  std::vector<Tile> tiles;
  for (uint64_t h = 0; h < rows.num_heads(); ++h) {
    for (uint64_t b = rows.row_offsets[h]; b < rows.row_offsets[h + 1]; b += kTileRows) {
      tiles.push_back({h, b, std::min(b + kTileRows, rows.row_offsets[h + 1])});
    }
  }
  return tiles;
}

class CpuCodecOps final : public CodecOps {
 public:
  explicit CpuCodecOps(CpuContext* context) : context_(context) {}

  absl::Status EncodeValues(const Projection& projection, const ValueCodecParams& params,
                            const RowSpan& rows, const void* values, DType dtype, void* latent,
                            uint16_t* scales) override {
    KVCOMP_RETURN_IF_ERROR(CheckValueCall(projection, params, rows, dtype));
    if (rows.total_rows() == 0) return absl::OkStatus();
    KVCOMP_RETURN_IF_ERROR(CheckValueBuffers(values, latent, scales, params));
    EncodeSpan(projection, params, rows, values, dtype, latent, scales, nullptr, nullptr);
    return absl::OkStatus();
  }

  absl::Status EncodeHq(uint32_t bits, uint64_t rows, uint32_t head_dim, const void* in,
                        DType dtype, void* out) override {
    return hq::EncodeRows(in, dtype, rows, head_dim, bits, static_cast<uint8_t*>(out));
  }

  absl::Status DecodeHq(uint32_t bits, uint64_t rows, uint32_t head_dim, const void* in,
                        void* out, DType out_dtype) override {
    return hq::DecodeRows(static_cast<const uint8_t*>(in), rows, head_dim, bits, out, out_dtype);
  }

  // The calibrated basis codec: the library's rows, head by head, on every hardware thread.
  absl::Status EncodePq(const pq::Basis& basis, uint64_t /*fingerprint*/,
                        absl::Span<const uint64_t> row_offsets, const void* in, DType dtype,
                        void* out) override {
    KVCOMP_RETURN_IF_ERROR(codec_internal::CheckPqCall(basis, row_offsets, dtype));
    const uint64_t in_row = DTypeBytes(dtype, basis.head_dim), rec = basis.RecordBytes();
    return ForEachPqHead(row_offsets, in, out, [&](uint64_t h, uint64_t row, uint64_t n,
                                                   const uint8_t* src, uint8_t* dst) {
      return pq::EncodeRows(basis, h, src + row * in_row, dtype, n, dst + row * rec,
                            /*threads=*/0);
    });
  }

  absl::Status DecodePq(const pq::Basis& basis, uint64_t /*fingerprint*/,
                        absl::Span<const uint64_t> row_offsets, const void* in, void* out,
                        DType out_dtype) override {
    KVCOMP_RETURN_IF_ERROR(codec_internal::CheckPqCall(basis, row_offsets, out_dtype));
    const uint64_t out_row = DTypeBytes(out_dtype, basis.head_dim), rec = basis.RecordBytes();
    return ForEachPqHead(row_offsets, in, out, [&](uint64_t h, uint64_t row, uint64_t n,
                                                   const uint8_t* src, uint8_t* dst) {
      return pq::DecodeRows(basis, h, src + row * rec, n, dst + row * out_row, out_dtype,
                            /*threads=*/0);
    });
  }

  // Calls `rows(head, first row, rows, in, out)` for every head of `row_offsets` with rows;
  // an error names its head.
  template <typename Rows>
  static absl::Status ForEachPqHead(absl::Span<const uint64_t> row_offsets, const void* in,
                                    void* out, Rows rows) {
    if (row_offsets.back() == 0) return absl::OkStatus();
    if (in == nullptr || out == nullptr) return absl::InvalidArgumentError("pq codec: null buffer");
    const auto* src = static_cast<const uint8_t*>(in);
    auto* dst = static_cast<uint8_t*>(out);
    for (uint64_t h = 0; h + 1 < row_offsets.size(); ++h) {
      const uint64_t n = row_offsets[h + 1] - row_offsets[h];
      if (n == 0) continue;
      KVCOMP_RETURN_IF_ERROR(
          Annotate(rows(h, row_offsets[h], n, src, dst), absl::StrFormat("pq head %u", h)));
    }
    return absl::OkStatus();
  }

  absl::Status EncodeValueLayers(const Projection& projection, const ValueCodecParams& params,
                                 absl::Span<const uint32_t> layer_ranks,
                                 absl::Span<const uint64_t> row_offsets, const void* values,
                                 DType dtype, void* latent, uint16_t* scales, float* energy,
                                 float* lost) override {
    KVCOMP_ASSIGN_OR_RETURN(
        const std::vector<kvsplice_internal::LayerRows> layers,
        codec_internal::PlanLayers(projection, params, layer_ranks, row_offsets, dtype));
    if (row_offsets.back() == 0) return absl::OkStatus();
    KVCOMP_RETURN_IF_ERROR(CheckValueBuffers(values, latent, scales, params));
    if ((energy == nullptr) != (lost == nullptr)) {
      return absl::InvalidArgumentError("codec: energy and lost come together");
    }
    const uint64_t row_bytes = DTypeBytes(dtype, projection.head_dim);
    for (const kvsplice_internal::LayerRows& L : layers) {
      if (L.offsets.back() == 0) continue;
      RowSpan rows;
      rows.first_head = L.first_head;
      rows.row_offsets = L.offsets;
      EncodeSpan(projection, L.params, rows,
                 static_cast<const uint8_t*>(values) + L.first_row * row_bytes, dtype,
                 static_cast<uint8_t*>(latent) + L.latent_byte,
                 L.params.Groups() ? scales + L.scale_elem : nullptr,
                 energy ? energy + L.first_row : nullptr, lost ? lost + L.first_row : nullptr);
    }
    return absl::OkStatus();
  }

  // Per tile, the chains of codec_internal::ProjectRows (the reference the other backends
  // follow bit for bit).
  absl::Status ValueResiduals(const Projection& projection, uint32_t rank, const RowSpan& rows,
                              const void* values, DType dtype, float* energy,
                              float* lost) override {
    ValueCodecParams params;
    params.codec = ValueCodec::kOrthogonal;
    params.rank = rank;
    KVCOMP_RETURN_IF_ERROR(CheckValueCall(projection, params, rows, dtype));
    if (rows.total_rows() == 0) return absl::OkStatus();
    if (values == nullptr || energy == nullptr || lost == nullptr) {
      return absl::InvalidArgumentError("codec: null buffer");
    }
    ValuePlan plan;
    PlanValues(projection, params, rows, &plan);
    const uint32_t d = projection.head_dim;
    context_->ParallelFor(plan.tiles.size(), [&](size_t i) {
      const Tile& t = plan.tiles[i];
      thread_local std::vector<float> v, z;
      const uint64_t m = t.end - t.begin;
      v.resize(m * d);
      z.resize(m * rank);
      ToF32(values, dtype, t.begin * d, m * d, v.data());
      codec_internal::ProjectRows(v.data(), m, d, plan.enc[t.head].data(), rank, z.data(),
                                  energy + t.begin, lost + t.begin);
    });
    return absl::OkStatus();
  }

  absl::Status DecodeValues(const Projection& projection, const ValueCodecParams& params,
                            const RowSpan& rows, const void* latent, const uint16_t* scales,
                            void* out, DType out_dtype) override {
    KVCOMP_RETURN_IF_ERROR(CheckValueCall(projection, params, rows, out_dtype));
    if (rows.total_rows() == 0) return absl::OkStatus();
    KVCOMP_RETURN_IF_ERROR(CheckValueBuffers(latent, out, scales, params));
    ValuePlan plan;
    PlanValues(projection, params, rows, &plan);
    const std::vector<std::vector<float>>& dec = plan.dec;
    const std::vector<Tile>& tiles = plan.tiles;
    const uint32_t d = projection.head_dim;
    const uint64_t lb = params.LatentBytes(), groups = params.Groups();
    context_->ParallelFor(tiles.size(), [&](size_t i) {
      const Tile& t = tiles[i];
      thread_local std::vector<float> z, o;
      const uint64_t m = t.end - t.begin;
      z.resize(m * params.rank);
      o.resize(m * d);
      codec_internal::DecodeRowsF32(static_cast<const uint8_t*>(latent) + t.begin * lb,
                                    groups ? scales + t.begin * groups : nullptr, m, d,
                                    dec[t.head].data(), params, z.data(), o.data());
      FromF32(o.data(), m * d, out, out_dtype, t.begin * d);
    });
    return absl::OkStatus();
  }

  absl::Status EncodeKeys(KeyCodec codec, const RowSpan& rows, uint32_t head_dim,
                          const void* keys, DType dtype, void* out, float* key_scales) override {
    KVCOMP_RETURN_IF_ERROR(CheckKeyCall(codec, rows, head_dim, dtype));
    const uint64_t d = head_dim, n = rows.total_rows();
    if (codec == KeyCodec::kInt4) return EncodeKeysInt4(rows, d, keys, dtype, out, key_scales);
    if (codec == KeyCodec::kInt8) {
      if (key_scales == nullptr) return absl::InvalidArgumentError("codec: null key_scales");
      context_->ParallelFor(rows.num_heads(), [&](size_t h) {
        thread_local std::vector<float> v;
        v.resize(d);
        float* sc = key_scales + h * d;
        std::fill(sc, sc + d, 0.0f);
        for (uint64_t i = rows.row_offsets[h]; i < rows.row_offsets[h + 1]; ++i) {
          ToF32(keys, dtype, i * d, d, v.data());
          for (uint64_t c = 0; c < d; ++c) sc[c] = std::fmax(sc[c], std::fabs(v[c]));
        }
        for (uint64_t c = 0; c < d; ++c) sc[c] /= 127.0f;
      });
    }
    if (n == 0) return absl::OkStatus();
    if (keys == nullptr || out == nullptr) return absl::InvalidArgumentError("codec: null buffer");
    const std::vector<Tile> tiles = MakeTiles(rows);
    context_->ParallelFor(tiles.size(), [&](size_t i) {
      const Tile& t = tiles[i];
      const uint64_t m = t.end - t.begin;
      switch (codec) {
        case KeyCodec::kRaw: {
          const size_t eb = DTypeBytes(dtype, 1);
          std::memcpy(static_cast<uint8_t*>(out) + t.begin * d * eb,
                      static_cast<const uint8_t*>(keys) + t.begin * d * eb, m * d * eb);
          break;
        }
        case KeyCodec::kFp16: {
          thread_local std::vector<float> v;
          v.resize(m * d);
          ToF32(keys, dtype, t.begin * d, m * d, v.data());
          FromF32(v.data(), m * d, out, DType::kF16, t.begin * d);
          break;
        }
        case KeyCodec::kInt4:
          break;  // EncodeKeysInt4
        case KeyCodec::kHq4:  // refused by CheckKeyCall (kvcomp/codecs/hq.h encodes them)
        case KeyCodec::kHq3:
        case KeyCodec::kPq:  // refused too (kvcomp/codecs/pq.h)
          break;
        case KeyCodec::kInt8: {
          thread_local std::vector<float> v;
          v.resize(d);
          const float* sc = key_scales + t.head * d;
          auto* q = static_cast<int8_t*>(out);
          for (uint64_t r = t.begin; r < t.end; ++r) {
            ToF32(keys, dtype, r * d, d, v.data());
            for (uint64_t c = 0; c < d; ++c) {
              q[r * d + c] = static_cast<int8_t>(codec_internal::QuantizeOne(v[c], sc[c], 127));
            }
          }
          break;
        }
      }
    });
    return absl::OkStatus();
  }

  absl::Status DecodeKeys(KeyCodec codec, const RowSpan& rows, uint32_t head_dim,
                          const void* encoded, DType raw_dtype, const float* key_scales,
                          void* out, DType out_dtype) override {
    KVCOMP_RETURN_IF_ERROR(CheckKeyCall(codec, rows, head_dim, raw_dtype));
    KVCOMP_RETURN_IF_ERROR(CheckInputDType(out_dtype, "output"));
    const uint64_t d = head_dim, n = rows.total_rows();
    if (n == 0) return absl::OkStatus();
    if (encoded == nullptr || out == nullptr ||
        ((codec == KeyCodec::kInt8 || codec == KeyCodec::kInt4) && !key_scales)) {
      return absl::InvalidArgumentError("codec: null buffer");
    }
    const std::vector<Tile> tiles = MakeTiles(rows);
    const std::vector<uint64_t> scale_at = KeyScaleStarts(codec, rows, d);
    context_->ParallelFor(tiles.size(), [&](size_t i) {
      const Tile& t = tiles[i];
      const uint64_t m = t.end - t.begin;
      thread_local std::vector<float> v;
      v.resize(m * d);
      switch (codec) {
        case KeyCodec::kRaw:
          ToF32(encoded, raw_dtype, t.begin * d, m * d, v.data());
          break;
        case KeyCodec::kFp16:
          ToF32(encoded, DType::kF16, t.begin * d, m * d, v.data());
          break;
        case KeyCodec::kInt8: {
          const auto* q = static_cast<const int8_t*>(encoded);
          const float* sc = key_scales + t.head * d;
          for (uint64_t r = 0; r < m; ++r) {
            for (uint64_t c = 0; c < d; ++c) {
              v[r * d + c] = static_cast<float>(q[(t.begin + r) * d + c]) * sc[c];
            }
          }
          break;
        }
        case KeyCodec::kInt4: {
          const auto* q = static_cast<const uint8_t*>(encoded);
          const uint64_t nb = (d + 1) / 2, head0 = rows.row_offsets[t.head];
          for (uint64_t r = 0; r < m; ++r) {
            const uint64_t row = t.begin + r;
            const float* sc = key_scales + scale_at[t.head] + (row - head0) / kKeyInt4GroupRows * d;
            for (uint64_t c = 0; c < d; ++c) {
              const uint8_t byte = q[row * nb + c / 2];
              const int x = codec_internal::Int4Value(c % 2 == 0 ? byte & 15u : byte >> 4);
              v[r * d + c] = static_cast<float>(x) * sc[c];
            }
          }
          break;
        }
        case KeyCodec::kHq4:  // refused by CheckKeyCall
        case KeyCodec::kHq3:
        case KeyCodec::kPq:
          break;
      }
      FromF32(v.data(), m * d, out, out_dtype, t.begin * d);
    });
    return absl::OkStatus();
  }

  absl::Status AccumulateSecondMoment(const HeadsView& values, absl::Span<double> gram) override {
    if (values.space != MemorySpace::kHost) {
      return absl::InvalidArgumentError("codec: the CPU backend reads host memory only");
    }
    KVCOMP_RETURN_IF_ERROR(CheckInputDType(values.dtype, "value"));
    const uint64_t d = values.head_dim;
    if (gram.size() != uint64_t{values.num_heads} * d * d) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "codec: gram holds %u doubles, %u heads of dim %u need %u", gram.size(),
          values.num_heads, d, uint64_t{values.num_heads} * d * d));
    }
    if (values.num_tokens > 0 && values.data == nullptr) {
      return absl::InvalidArgumentError("codec: null values");
    }
    context_->ParallelFor(values.num_heads, [&](size_t h) {
      constexpr uint64_t kRows = 256;
      std::vector<float> v(kRows * d);
      RowMat acc = RowMat::Zero(d, d);
      Eigen::Map<RowMatD> g(gram.data() + h * d * d, d, d);
      for (uint64_t t0 = 0; t0 < values.num_tokens; t0 += kRows) {
        const uint64_t m = std::min(kRows, values.num_tokens - t0);
        for (uint64_t t = 0; t < m; ++t) {
          ToF32(values.data, values.dtype, values.offset(h, t0 + t), d, v.data() + t * d);
        }
        acc.setZero();  // this block's v^T v, the ISA's dense product, summed in double
        cpu::Gemm().add_at_b(v.data(), v.data(), acc.data(), m, d, d);
        g += acc.cast<double>();
      }
    });
    return absl::OkStatus();
  }

  absl::Status EigenDecompose(uint32_t dim, uint64_t batch, absl::Span<const double> gram,
                              absl::Span<double> eigenvalues,
                              absl::Span<double> eigenvectors) override {
    KVCOMP_RETURN_IF_ERROR(codec_internal::CheckEigenArgs(dim, batch, gram.size(),
                                                          eigenvalues.size(), eigenvectors.size()));
    const uint64_t dd = uint64_t{dim} * dim;
    std::vector<int> failed(batch, 0);
    context_->ParallelFor(batch, [&](size_t b) {
      Eigen::Map<const RowMatD> g(gram.data() + b * dd, dim, dim);
      Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(g);
      if (solver.info() != Eigen::Success) {
        failed[b] = 1;
        return;
      }
      // Eigen sorts ascending; kvcomp wants descending, eigenvectors as rows.
      for (uint32_t j = 0; j < dim; ++j) {
        const uint32_t src = dim - 1 - j;
        eigenvalues[b * dim + j] = solver.eigenvalues()(src);
        for (uint32_t k = 0; k < dim; ++k) {
          eigenvectors[b * dd + uint64_t{j} * dim + k] = solver.eigenvectors()(k, src);
        }
      }
    });
    for (uint64_t b = 0; b < batch; ++b) {
      if (failed[b]) {
        return absl::InternalError(
            absl::StrFormat("codec: eigendecomposition of matrix %u did not converge", b));
      }
    }
    return absl::OkStatus();
  }

 private:
  absl::Status CheckValueCall(const Projection& projection, const ValueCodecParams& params,
                              const RowSpan& rows, DType dtype) {
    KVCOMP_RETURN_IF_ERROR(params.ValidateFor(projection));
    KVCOMP_RETURN_IF_ERROR(rows.Validate(projection.num_heads()));
    return CheckInputDType(dtype, "value");
  }

  // First key scale of each head of `rows` (KeyScaleGroups(codec, rows) x d per head).
  static std::vector<uint64_t> KeyScaleStarts(KeyCodec codec, const RowSpan& rows, uint64_t d) {
    std::vector<uint64_t> at(rows.num_heads() + 1, 0);
    for (uint64_t h = 0; h < rows.num_heads(); ++h) {
      at[h + 1] =
          at[h] + KeyScaleGroups(codec, rows.row_offsets[h + 1] - rows.row_offsets[h]) * d;
    }
    return at;
  }

  // int4 keys: per (head, group of kKeyInt4GroupRows rows) the channel scales max |k| / 7, then
  // two quantized channels per byte. One unit of work per group.
  absl::Status EncodeKeysInt4(const RowSpan& rows, uint64_t d, const void* keys, DType dtype,
                              void* out, float* key_scales) {
    const uint64_t n = rows.total_rows();
    if (n == 0) return absl::OkStatus();
    if (keys == nullptr || out == nullptr || key_scales == nullptr) {
      return absl::InvalidArgumentError("codec: null buffer");
    }
    const std::vector<uint64_t> scale_at = KeyScaleStarts(KeyCodec::kInt4, rows, d);
    struct Group {
      uint64_t begin, end;
      float* scales;
    };
    std::vector<Group> groups;
    for (uint64_t h = 0; h < rows.num_heads(); ++h) {
      float* sc = key_scales + scale_at[h];
      for (uint64_t b = rows.row_offsets[h]; b < rows.row_offsets[h + 1];
           b += kKeyInt4GroupRows, sc += d) {
        groups.push_back({b, std::min(b + kKeyInt4GroupRows, rows.row_offsets[h + 1]), sc});
      }
    }
    const uint64_t nb = (d + 1) / 2;
    context_->ParallelFor(groups.size(), [&](size_t i) {
      const Group& g = groups[i];
      thread_local std::vector<float> v;
      v.resize((g.end - g.begin) * d);
      ToF32(keys, dtype, g.begin * d, (g.end - g.begin) * d, v.data());
      std::fill(g.scales, g.scales + d, 0.0f);
      for (uint64_t r = 0; r < g.end - g.begin; ++r) {
        for (uint64_t c = 0; c < d; ++c) {
          g.scales[c] = std::fmax(g.scales[c], std::fabs(v[r * d + c]));
        }
      }
      for (uint64_t c = 0; c < d; ++c) g.scales[c] /= 7.0f;
      auto* q = static_cast<uint8_t*>(out);
      for (uint64_t r = 0; r < g.end - g.begin; ++r) {
        uint8_t* row = q + (g.begin + r) * nb;
        for (uint64_t b = 0; b < nb; ++b) {
          const uint64_t c0 = 2 * b, c1 = 2 * b + 1;
          const int lo = codec_internal::QuantizeOne(v[r * d + c0], g.scales[c0], 7);
          const int hi = c1 < d ? codec_internal::QuantizeOne(v[r * d + c1], g.scales[c1], 7) : 0;
          row[b] = static_cast<uint8_t>((lo & 15) | ((hi & 15) << 4));
        }
      }
    });
    return absl::OkStatus();
  }

  absl::Status CheckKeyCall(KeyCodec codec, const RowSpan& rows, uint32_t head_dim, DType dtype) {
    if (HqBits(codec) != 0) {
      return absl::InvalidArgumentError(
          "codec: the hq key codecs are encoded by kvcomp/codecs/hq.h, not by CodecOps");
    }
    if (IsPq(codec)) {
      return absl::InvalidArgumentError(
          "codec: the pq key codec is encoded by kvcomp/codecs/pq.h (EncodeKept), not by "
          "CodecOps");
    }
    if (static_cast<uint8_t>(codec) > static_cast<uint8_t>(KeyCodec::kInt4)) {
      return absl::InvalidArgumentError("codec: unknown key codec");
    }
    if (head_dim == 0) return absl::InvalidArgumentError("codec: head_dim 0");
    KVCOMP_RETURN_IF_ERROR(rows.Validate(~uint64_t{0}));
    return CheckInputDType(dtype, "key");
  }

  // EncodeValues over checked arguments, with the outlier measure when energy/lost are given.
  void EncodeSpan(const Projection& projection, const ValueCodecParams& params,
                  const RowSpan& rows, const void* values, DType dtype, void* latent,
                  uint16_t* scales, float* energy, float* lost) {
    ValuePlan plan;
    PlanValues(projection, params, rows, &plan);
    const uint32_t d = projection.head_dim;
    const uint64_t lb = params.LatentBytes(), groups = params.Groups();
    const bool gamma = params.UsesGamma();
    context_->ParallelFor(plan.tiles.size(), [&](size_t i) {
      const Tile& t = plan.tiles[i];
      thread_local std::vector<float> v, z;
      const uint64_t m = t.end - t.begin;
      v.resize(m * d);
      z.resize(m * params.rank);
      ToF32(values, dtype, t.begin * d, m * d, v.data());
      codec_internal::EncodeRowsF32(
          v.data(), m, d, plan.enc[t.head].data(),
          gamma ? projection.head_gamma(rows.first_head + t.head) : nullptr, params, z.data(),
          static_cast<uint8_t*>(latent) + t.begin * lb,
          groups ? scales + t.begin * groups : nullptr, energy ? energy + t.begin : nullptr,
          lost ? lost + t.begin : nullptr);
    });
  }

  // What encoding and decoding values both need: each head's projection matrices and the tiles.
  struct ValuePlan {
    std::vector<std::vector<float>> enc, dec;
    std::vector<Tile> tiles;
  };
  void PlanValues(const Projection& projection, const ValueCodecParams& params,
                  const RowSpan& rows, ValuePlan* plan) {
    HeadMatricesFor(projection, params, rows, &plan->enc, &plan->dec);
    plan->tiles = MakeTiles(rows);
  }
  // The input, the output and (for quantized latents) the scales must all be given.
  static absl::Status CheckValueBuffers(const void* in, const void* out, const uint16_t* scales,
                                        const ValueCodecParams& params) {
    if (in == nullptr || out == nullptr || (params.Groups() > 0 && scales == nullptr)) {
      return absl::InvalidArgumentError("codec: null buffer");
    }
    return absl::OkStatus();
  }

  void HeadMatricesFor(const Projection& projection, const ValueCodecParams& params,
                       const RowSpan& rows, std::vector<std::vector<float>>* enc,
                       std::vector<std::vector<float>>* dec) {
    enc->resize(rows.num_heads());
    dec->resize(rows.num_heads());
    context_->ParallelFor(rows.num_heads(), [&](size_t h) {
      codec_internal::HeadMatrices(projection, rows.first_head + h, params, &(*enc)[h],
                                   &(*dec)[h]);
    });
  }

  CpuContext* context_;
};

}  // namespace

std::unique_ptr<CodecOps> NewCpuCodecOps(CpuContext* context) {
  return std::make_unique<CpuCodecOps>(context);
}

}  // namespace kvcomp
