// CodecOps: the operations of Engine III (KVSplice) behind kvcomp::Backend: encoding and
// decoding of the kept keys and values, and the two numeric steps of calibration.
//
// Rows are ragged per head, as in CompressedCache: head h (counted from `first_head` of the
// projection) owns rows [row_offsets[h], row_offsets[h + 1]) of every per-row array, and
// row_offsets (size heads + 1, row_offsets[0] == 0) is ALWAYS host memory. Every other pointer is
// in the backend's memory space (host for CPU, device for CUDA); a pointer from the other space
// is InvalidArgument where the backend can tell.
//
// Value encoding (rank r, group size g, G = ceil(r / g) groups per row, gamma_j of projection):
//   z_j = (v . p_j) / gamma_j            (gamma_j = 1 when gamma_aware is off or codec is f16;
//                                         v . p_j a chain of f32 fused multiply-adds over the
//                                         channels in order, the same bits on every backend)
//   orthogonal:      latent f16 z_j, 2 r bytes per row, no scales
//   orthogonal_int8: per group, s = f16 scale >= max|z| / 127, q = round(z / s) in [-127, 127]
//   orthogonal_int4: per group, s = f16 scale >= max|z| / 7,   q = round(z / s) in [-7, 7],
//                    two per byte, element 2i in the low nibble (two's complement)
// Decoding writes V' = sum_j (q_j s) gamma_j p_j in one pass (dequantize and expand fused, no
// intermediate array), in the requested dtype.
// Keys: raw (copied in the input dtype), fp16, int8 with one f32 scale per (head, channel),
// scale = max over the head's rows of |k| / 127 (0 when the head has no rows), or int4 with one
// f32 scale per (head, group of kKeyInt4GroupRows rows, channel), scale = max over the group's
// rows of |k| / 7, q = round(k / scale) in [-7, 7], two per byte (channel 2i in the low nibble,
// two's complement); a head's scales are its groups in order, d each, heads in order
// (KeyScaleGroups(codec, rows) x d per head).
//
// Ops are not thread-safe (one Backend per thread); they may run many threads internally.
#ifndef KVCOMP_KERNELS_CODEC_OPS_H_
#define KVCOMP_KERNELS_CODEC_OPS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvcomp/codecs/pq.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/kernels/projection.h"
#include "kvcomp/kernels/tensor.h"

namespace kvcomp {

struct ValueCodecParams {
  ValueCodec codec = ValueCodec::kOrthogonalInt8;  // not kRaw
  uint32_t rank = 0;         // 1..projection.rows; even for int4
  uint32_t group_size = 32;  // latent elements per scale, 1..256 (quantized codecs)
  bool gamma_aware = true;   // divide by the projection's gamma before quantizing (int8/int4)

  // Bytes per row of latent, f16 scales per row.
  uint64_t LatentBytes() const;
  uint64_t Groups() const;
  // True when gamma is applied (quantized codec and gamma_aware).
  bool UsesGamma() const;
  // InvalidArgument unless the params fit `projection` (rank <= rows, int4 rank even, ...).
  absl::Status ValidateFor(const Projection& projection) const;
};

// The heads of one call: heads [first_head, first_head + row_offsets.size() - 1) of the
// projection, rows per head from row_offsets (host).
struct RowSpan {
  uint64_t first_head = 0;
  absl::Span<const uint64_t> row_offsets;
  uint64_t num_heads() const { return row_offsets.empty() ? 0 : row_offsets.size() - 1; }
  uint64_t total_rows() const { return row_offsets.empty() ? 0 : row_offsets.back(); }
  // InvalidArgument unless offsets start at 0, never decrease and heads fit `max_heads`.
  absl::Status Validate(uint64_t max_heads) const;
};

class CodecOps {
 public:
  virtual ~CodecOps() = default;

  // --- values ---
  // values: [total_rows][head_dim] of `dtype` (f32, f16, bf16), dense. latent: total_rows *
  // params.LatentBytes() bytes; scales: total_rows * params.Groups() f16 (nullptr when 0).
  virtual absl::Status EncodeValues(const Projection& projection, const ValueCodecParams& params,
                                    const RowSpan& rows, const void* values, DType dtype,
                                    void* latent, uint16_t* scales) = 0;
  // The inverse: out is [total_rows][head_dim] of `out_dtype` (f32, f16, bf16).
  virtual absl::Status DecodeValues(const Projection& projection, const ValueCodecParams& params,
                                    const RowSpan& rows, const void* latent,
                                    const uint16_t* scales, void* out, DType out_dtype) = 0;

  // The values of a whole cache in one call (a put's one pass): rows of every head of the
  // projection (row_offsets: num_layers * num_kv_heads + 1 entries, host), layer l at rank
  // layer_ranks[l] (1..params.rank, even for int4; params.rank the largest), its latents and
  // scales stored layer after layer (layer rows x that rank's LatentBytes / Groups), as a
  // CompressedCache with per-layer ranks keeps them. energy and lost (one f32 per row, both or
  // neither) receive ValueResiduals' measure at each row's layer rank.
  // The arithmetic (codec_internal::ProjectRows in cpu/codec_cpu_internal.h): each latent is a
  // chain of fused multiply-adds over the channels in order, divided by gamma, then quantized,
  // so every backend writes the same bytes for the same input; EncodeValues and ValueResiduals
  // follow it too.
  virtual absl::Status EncodeValueLayers(const Projection& projection,
                                         const ValueCodecParams& params,
                                         absl::Span<const uint32_t> layer_ranks,
                                         absl::Span<const uint64_t> row_offsets,
                                         const void* values, DType dtype, void* latent,
                                         uint16_t* scales, float* energy, float* lost) = 0;

  // What the projection's first `rank` rows miss of each value row (KVSplice's outlier rule):
  // energy[i] = ||v_i||^2 and lost[i] = max(0, ||v_i||^2 - ||P_r v_i||^2), f32, for every row
  // of `rows` (values as in EncodeValues). rank in 1..projection.rows.
  virtual absl::Status ValueResiduals(const Projection& projection, uint32_t rank,
                                      const RowSpan& rows, const void* values, DType dtype,
                                      float* energy, float* lost) = 0;

  // --- keys ---
  // keys: [total_rows][head_dim] of `dtype`. out: total_rows * head_dim elements of the codec's
  // type (dtype for raw, f16, int8; int4: total_rows * ceil(head_dim / 2) bytes). key_scales:
  // sum over heads of KeyScaleGroups(codec, rows) * head_dim f32 for int8 and int4, else unused.
  virtual absl::Status EncodeKeys(KeyCodec codec, const RowSpan& rows, uint32_t head_dim,
                                  const void* keys, DType dtype, void* out,
                                  float* key_scales) = 0;
  // The inverse into [total_rows][head_dim] of out_dtype. `raw_dtype` is the dtype of raw keys.
  virtual absl::Status DecodeKeys(KeyCodec codec, const RowSpan& rows, uint32_t head_dim,
                                  const void* encoded, DType raw_dtype, const float* key_scales,
                                  void* out, DType out_dtype) = 0;

  // --- the Hadamard codec (kvcomp/codecs/hq.h, docs/format.md) ---
  // `rows` dense rows of head_dim elements of `dtype` (f32, f16, bf16) into rows records of
  // hq::RowBytes(bits, head_dim) bytes (bits 4: hq4, 3: hq3; 2 is defined too), head_dim a power
  // of two in [8, 256]. Every backend writes the CPU reference's bytes (hq::EncodeRows), and
  // returns its error for the lowest failing row (a non-finite element, a row out of f16 range).
  virtual absl::Status EncodeHq(uint32_t bits, uint64_t rows, uint32_t head_dim, const void* in,
                                DType dtype, void* out) = 0;
  // The inverse into rows x head_dim elements of out_dtype: hq::DecodeRows's values, bit for bit
  // (every step one IEEE operation, the same on every backend); a record with a non-finite or
  // negative step or a non-finite minimum is InvalidArgument naming the lowest such row.
  virtual absl::Status DecodeHq(uint32_t bits, uint64_t rows, uint32_t head_dim, const void* in,
                                void* out, DType out_dtype) = 0;

  // --- the calibrated basis codec (kvcomp/codecs/pq.h, docs/format.md) ---
  // Every head of `basis`: head h's rows are [row_offsets[h], row_offsets[h + 1]) (row_offsets
  // HOST, basis.num_heads() + 1 entries, from 0) of `in`, dense rows of head_dim elements of
  // `dtype` (f32, f16, bf16), into as many records of basis.RecordBytes() at `out`.
  // `fingerprint` is basis.Fingerprint() (a Calibration's key_fingerprint / value_fingerprint;
  // 0: computed here): a device backend uploads a basis once per fingerprint and keeps it.
  // Every backend writes pq::EncodeRows' bytes and returns its error (annotated with the head)
  // for the lowest failing row: a non-finite element, a projection that overflows.
  virtual absl::Status EncodePq(const pq::Basis& basis, uint64_t fingerprint,
                                absl::Span<const uint64_t> row_offsets, const void* in,
                                DType dtype, void* out) = 0;
  // The inverse into rows x head_dim elements of out_dtype: pq::DecodeRows' values bit for bit
  // (each f32 rounded to out_dtype to nearest even); a record with nonzero bits after
  // bits_total is InvalidArgument naming the lowest such row.
  virtual absl::Status DecodePq(const pq::Basis& basis, uint64_t fingerprint,
                                absl::Span<const uint64_t> row_offsets, const void* in,
                                void* out, DType out_dtype) = 0;

  // --- calibration ---
  // Adds sum_t v_t v_t^T of every head of `values` to gram (HOST, f64,
  // [values.num_heads][head_dim][head_dim] row-major).
  virtual absl::Status AccumulateSecondMoment(const HeadsView& values,
                                              absl::Span<double> gram) = 0;
  // For each of `batch` symmetric dim x dim matrices in gram (HOST, f64): eigenvalues in
  // descending order (batch x dim) and the matching unit eigenvectors as ROWS (batch x dim x dim),
  // both host.
  virtual absl::Status EigenDecompose(uint32_t dim, uint64_t batch, absl::Span<const double> gram,
                                      absl::Span<double> eigenvalues,
                                      absl::Span<double> eigenvectors) = 0;
};

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_CODEC_OPS_H_
