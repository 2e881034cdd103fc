// KVSplice on whole compressed caches: encode the kept keys and
// values of a CompressedCache as its policy says, and decode an encoded cache back to dense kept
// keys and values. Host-memory caches; the Backend's CodecOps does the arithmetic (the CUDA
// backend stages host buffers through device memory itself).
//
// Projection rules: the value codecs need the projection the cache was (or will be) encoded
// with. Encoding records projection->version in the cache; decoding checks the cache's version
// against the projection given (or looks it up in a ProjectionStore) and returns NotFound when it
// is missing or different: never values decoded through the wrong basis.
#ifndef KVCOMP_KERNELS_KVSPLICE_H_
#define KVCOMP_KERNELS_KVSPLICE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/codecs/pq.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/projection.h"

namespace kvcomp {

// The latent rank a policy gets with a projection: policy.rank when set; else the auto-tuner's
// largest per-layer rank recorded in the projection; else DefaultRank(codec, head_dim); rounded
// up to even for int4. FailedPrecondition when it exceeds the projection's rows.
absl::StatusOr<uint32_t> ChooseRank(const CompressionPolicy& policy, const Projection& projection);

// One latent rank per layer: the auto-tuner's per-layer ranks recorded in the projection (int4:
// rounded up to even) when policy.rank is 0 and every layer was tuned; else ChooseRank's rank for
// every layer. EncodeKept stores differing ranks in CompressedCache::layer_rank (format section
// 12), so a layer the tuner found easy really takes fewer bytes.
absl::StatusOr<std::vector<uint32_t>> ChooseLayerRanks(const CompressionPolicy& policy,
                                                       const Projection& projection);

// Encodes the raw kept tokens of `cache` (keys and values in layout.dtype, key_codec and
// value_codec raw, as the pipeline's selection leaves them) with policy.key_codec,
// policy.value_codec, rank, group_size and gamma_aware. `projection` is required for the value
// codecs (FailedPrecondition when null) and must match the layout (layers, kv heads, head_dim).
// `pq` is required for the pq codecs (FailedPrecondition when null, naming the calibration
// call), fitted at policy.key_bits / value_bits for the codec's tensor (FailedPrecondition
// otherwise) and of the layout's shape (InvalidArgument); they run through the backend's
// CodecOps::EncodePq (the library's bytes, kvcomp/codecs/pq.h, on every backend).
absl::Status EncodeKept(Backend& backend, const CompressionPolicy& policy,
                        const Projection* projection, CompressedCache* cache,
                        const pq::Calibration* pq = nullptr);

// OK when `pq` can encode `policy`'s pq codecs for caches of `layout` on `backend` (the checks
// EncodeKept makes first); OK for a policy without pq codecs.
absl::Status CheckPqCodecs(const Backend& backend, const CompressionPolicy& policy,
                           const pq::Calibration* pq, const KvLayout& layout);

// The kept tokens decoded: head h's rows are [offsets[h], offsets[h + 1]) of `keys` and `values`
// ([total_kept][head_dim] of `dtype`), at sequence positions `positions` (same rows).
struct DecodedKept {
  KvLayout layout;
  DType dtype = DType::kF32;
  std::vector<uint64_t> offsets;
  std::vector<uint32_t> positions;
  std::vector<uint8_t> keys;
  std::vector<uint8_t> values;
};

// Decodes keys and values of `cache` into `dtype` (f32, f16 or bf16). `projection` may be null
// when the values are raw; otherwise its version must be cache.projection_version (NotFound).
// The pq codecs need `pq`, the calibration the cache names (its version and bases'
// fingerprints; NotFound for none or another), decoded by the backend's CodecOps::DecodePq.
absl::StatusOr<DecodedKept> DecodeKept(Backend& backend, const CompressedCache& cache,
                                       const Projection* projection, DType dtype = DType::kF32,
                                       const pq::Calibration* pq = nullptr);
// The same, taking the projection from `store` under `model_id` (NotFound when missing).
absl::StatusOr<DecodedKept> DecodeKept(Backend& backend, const CompressedCache& cache,
                                       ProjectionStore& store, absl::string_view model_id,
                                       DType dtype = DType::kF32);

// The same into `keys` and `values` (total_kept x head_dim elements of `dtype` each, rows in the
// cache's order: layer, head, kept token), memory of the backend's space: device memory for a
// CUDA backend, so nothing decoded crosses to the host (the encoded arrays go up on the
// backend's stream; the call returns once the rows are written). Errors as DecodeKept.
absl::Status DecodeKeptInto(Backend& backend, const CompressedCache& cache,
                            const Projection* projection, DType dtype, void* keys, void* values,
                            const pq::Calibration* pq = nullptr);

// `cache` with its kept tokens decoded to raw codecs in its layout's dtype (positions, kept
// counts and moments as they were): what a consumer that reads raw rows takes, e.g. a decoded
// get or attention over a codec it has no kernel for. `projection` and `pq` as for DecodeKept.
absl::StatusOr<CompressedCache> DecodeToRawCodecs(Backend& backend, const CompressedCache& cache,
                                                  const Projection* projection,
                                                  const pq::Calibration* pq = nullptr);

// The codec parameters a cache was encoded with (its header fields; rank is the largest layer's
// when the cache has per-layer ranks).
ValueCodecParams CacheValueParams(const CompressedCache& cache);

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_KVSPLICE_H_
