// The calibrated basis codec ("pq", KVTC-style decorrelation): for every (layer, kv head) of a
// model and one tensor (keys or values), a basis fitted once on calibration rows: the mean, the
// eigenvectors of the covariance (components by falling variance), each component's deviation
// and an integer width 0..8 per component from reverse water-filling of the variances (the
// widths of a head sum to the same bits_total). A row is centred, projected on the basis, each
// component divided by its deviation and coded on the Lloyd-Max codebook of N(0, 1) at its
// width; a zero-width component decodes to the mean. The record holds the codes only (no
// per-row scale): RecordBytes() = ceil(bits_total / 8).
//
// Arithmetic (docs/format.md, "The calibrated basis codec", is the byte-level specification; the
// Python mirror bench/quality/codecs_ref.py pq_engine_* gives the same bytes), every step one
// IEEE f32 operation with round-to-nearest-even (pq.cc is built with -ffp-contract=off):
//   encode  t_j = x_j - mean_j
//           z_c = B[c][0] t_0, then z_c = z_c + B[c][j] t_j for j = 1 .. d-1 (width_c > 0 only)
//           u_c = z_c * inv_scale_c
//           code_c = the number of boundaries k of width_c with boundary_k < u_c, where
//                    boundary_k = (centroid_k + centroid_{k+1}) * 0.5 (f32)
//   decode  v_c = centroid[code_c] * scale_c (width_c > 0)
//           a_j = the sum over c with width_c > 0, in increasing c, of v_c * B[c][j] (the first
//                 product, then one addition per further component); y_j = mean_j + a_j
//                 (y_j = mean_j when no component has a width)
// Record: the codes of the components with a width, in increasing c, as a little-endian bit
// stream (component c in bits [o_c, o_c + width_c), o_c the sum of the earlier widths; bit k is
// bit k % 8 of byte k / 8); the bits after bits_total are zero.
//
// The engine's key and value codec "pq" (KeyCodec::kPq / ValueCodec::kPq, cache format 1.5)
// encodes through this library; a model's keys' and values' bases travel together as one
// Calibration, whose version the caches name (kvcomp/kernels/kvsplice.h; kvcompd keeps them
// per tenant and model beside KVSplice's projections, kvcomp/codecs/projection_store.h).
#ifndef KVCOMP_CODECS_PQ_H_
#define KVCOMP_CODECS_PQ_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvcomp/core/dtype.h"

namespace kvcomp {
namespace pq {

inline constexpr uint32_t kMaxWidth = 8;
inline constexpr uint32_t kMaxHeadDim = 512;
inline constexpr uint8_t kBasisVersion = 1;

// The Lloyd-Max centroids of N(0, 1) at `width` (1..8), ascending, 2^width of them (f32).
absl::Span<const float> Centroids(uint32_t width);
// The 2^width - 1 decision boundaries between them: (c_k + c_{k+1}) * 0.5f.
absl::Span<const float> Boundaries(uint32_t width);
// The expected squared error of the unit Gaussian at `width` (0: 1).
double GaussianDistortion(uint32_t width);

// One tensor's calibration for every (layer, kv head); head index h = layer * num_kv_heads +
// kv_head.
struct Basis {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t bits_total = 0;      // sum of the widths of every head, 1 .. 8 * head_dim
  std::vector<float> mean;      // [heads][d]
  std::vector<float> scale;     // [heads][d] deviation of component c (> 0 where width > 0)
  std::vector<float> inv_scale;  // [heads][d] 1 / scale in f32 (finite where width > 0)
  std::vector<uint8_t> widths;  // [heads][d] 0 .. kMaxWidth
  std::vector<float> basis;     // [heads][d][d]: row c = component c

  uint64_t num_heads() const { return uint64_t{num_layers} * num_kv_heads; }
  uint64_t RecordBytes() const { return (uint64_t{bits_total} + 7) / 8; }
  // Sizes against the shape fields, widths <= 8 summing to bits_total in every head, every
  // number finite, scale > 0 and inv_scale finite where the width is > 0. InvalidArgument.
  absl::Status Validate() const;
  // A 64-bit fingerprint of the content (FNV-1a of the serialized payload), never 0.
  uint64_t Fingerprint() const;
  // Little-endian bytes (docs/format.md: "KVPQ" magic, version 1, shape, fingerprint, payload).
  std::string Serialize() const;
  // Serialize()'s output back. DataLoss for a wrong fingerprint or truncation; InvalidArgument
  // for another magic or version, nonzero reserved bytes, or content Validate() refuses.
  static absl::StatusOr<Basis> Parse(absl::string_view bytes);
};

// Fits a basis on calibration rows: rows[h][n][d] f32 (n rows per head, heads = num_layers x
// num_kv_heads, n >= 2), widths for bits_total bits per row. Mean and covariance in f64, the
// eigenvectors by cyclic Jacobi (each with its largest-magnitude entry positive), components by
// falling eigenvalue, scale = sqrt(eigenvalue) floored at 1e-6 of the head's largest (and at the
// smallest normal f32), widths by greedy reverse water-filling (the next bit to the component
// whose expected squared error variance x GaussianDistortion(width) it lowers most; ties to the
// lowest c). InvalidArgument for bad shapes or non-finite rows.
absl::StatusOr<Basis> Fit(absl::Span<const float> rows, uint64_t n, uint32_t num_layers,
                          uint32_t num_kv_heads, uint32_t head_dim, uint32_t bits_total);

// `rows` rows x[rows][d] (f32) of head `head` into rows * RecordBytes() bytes at out.
// InvalidArgument for a head out of range or a non-finite element.
absl::Status EncodeRows(const Basis& basis, uint64_t head, const float* x, uint64_t rows,
                        uint8_t* out);
// The inverse into out[rows][d]. InvalidArgument for a record whose bits after bits_total are
// not zero or a head out of range.
absl::Status DecodeRows(const Basis& basis, uint64_t head, const uint8_t* in, uint64_t rows,
                        float* out);

// The same over rows of a cache's dtype (f32, f16 or bf16; each element converted to f32
// exactly), on up to `threads` threads (0: the machine's hardware threads, at most 32) in
// blocks of rows: the records and decoded values do not depend on the thread count. Decoding
// rounds each decoded f32 to the output dtype (round-to-nearest-even).
absl::Status EncodeRows(const Basis& basis, uint64_t head, const void* src, DType dtype,
                        uint64_t rows, uint8_t* out, int threads = 1);
absl::Status DecodeRows(const Basis& basis, uint64_t head, const uint8_t* in, uint64_t rows,
                        void* dst, DType dtype, int threads = 1);

// A model's pq calibration: the keys' and the values' basis (the same layers, kv heads and
// head_dim; each with its own bits per row), named by one version that the caches encoded with
// it record (the cache format's calibration version; the header names each basis' fingerprint
// too). A value type; const access from many threads is fine.
struct Calibration {
  std::string model_id;  // the model the rows came from (informational; may be empty)
  Basis keys;
  Basis values;
  uint64_t version = 0;  // set by Seal(): FNV-1a 64 of the two fingerprints (never 0)
  uint64_t key_fingerprint = 0;    // keys.Fingerprint(), set by Seal()
  uint64_t value_fingerprint = 0;  // values.Fingerprint(), set by Seal()

  // Bits per element of each tensor's rows (bits_total / head_dim, rounded down).
  uint32_t key_bits() const { return keys.head_dim == 0 ? 0 : keys.bits_total / keys.head_dim; }
  uint32_t value_bits() const {
    return values.head_dim == 0 ? 0 : values.bits_total / values.head_dim;
  }
  // Both bases valid and of one shape. InvalidArgument.
  absl::Status Validate() const;
  // Validates, then sets the fingerprints and the version from the content.
  absl::Status Seal();
  // Little-endian bytes: "KVPC", version 1, three zero bytes, the calibration version (u64),
  // then per tensor (keys, values) its Basis::Serialize() bytes preceded by their length (u64).
  std::string Serialize() const;
  // Serialize()'s output back, sealed: DataLoss for truncation, a basis whose fingerprint fails
  // or a version that is not the content's; InvalidArgument for another magic or version.
  static absl::StatusOr<Calibration> Parse(absl::string_view bytes);
};

// Fits both bases (Fit) on the same rows' keys and values: keys and values [heads][n][d] f32,
// key_bits and value_bits per element (1..8; bits_total = bits x head_dim), sealed.
absl::StatusOr<Calibration> FitCalibration(absl::Span<const float> keys,
                                           absl::Span<const float> values, uint64_t n,
                                           uint32_t num_layers, uint32_t num_kv_heads,
                                           uint32_t head_dim, uint32_t key_bits,
                                           uint32_t value_bits);

}  // namespace pq
}  // namespace kvcomp

#endif  // KVCOMP_CODECS_PQ_H_
