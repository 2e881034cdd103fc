// The pipeline's extension stages, one function each (pipeline_stages.cc), so the moments
// and codec owners change one function, not the pipeline.
#ifndef KVCOMP_KERNELS_SRC_PIPELINE_STAGES_H_
#define KVCOMP_KERNELS_SRC_PIPELINE_STAGES_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/pipeline.h"
#include "kvcomp/kernels/projection.h"
#include "kvcomp/kernels/tensor.h"

namespace kvcomp {
namespace pipeline_internal {

// What one layer evicted: head h's evicted token indices into keys/values are
// evicted[offsets[h] .. offsets[h+1]) (host memory, ascending). keys/values are in the backend's
// space.
struct LayerEviction {
  uint32_t layer = 0;
  HeadsView keys;
  HeadsView values;
  std::vector<uint64_t> offsets;  // num_heads + 1
  std::vector<uint32_t> evicted;
};

// True when the moment stage can run on `backend` (MomentOps present).
bool MomentsAvailable(Backend& backend);
// Whether a cache compressed under `policy` stores moment summaries: the policy asks for them,
// the backend has the moment stage, and some token can be evicted. A policy that keeps every
// token (ratio 0 with no token budget, or kept_per_head >= num_tokens) stores none: its
// summaries would be all zero and cost 8 + 4 d (d + 2) bytes per kv head (more than the cache
// itself for short chunks). num_tokens 0 means not known yet (block-wise compression): only the
// policy is read.
bool StoresMoments(Backend& backend, const CompressionPolicy& policy, uint64_t kept_per_head,
                   uint64_t num_tokens);
// Adds the moments of `eviction` to cache->moment_* of its layer's heads (cache->has_moments and
// the arrays already shaped by Reset).
absl::Status MomentStage(Backend& backend, const LayerEviction& eviction, CompressedCache* cache);

// OK when the policy's codecs can run (raw always can); FailedPrecondition when a value codec
// has no projection (or one with too few rows for the policy's rank).
// The pq codecs: FailedPrecondition without a calibration or at other bits (CheckPqCodecs).
absl::Status CodecsAvailable(Backend& backend, const CompressionPolicy& policy,
                             const Projection* projection, const pq::Calibration* pq,
                             const KvLayout& layout);
// Encodes the raw kept keys and values of `cache` as the policy says (no-op for raw codecs),
// through kvsplice.h's EncodeKept.
absl::Status CodecStage(Backend& backend, const CompressionPolicy& policy,
                        const Projection* projection, CompressedCache* cache,
                        const pq::Calibration* pq = nullptr);

// The codec stage of a device compression: encodes the raw kept keys and values of `cache`
// (device arrays, as CompressOnDevice leaves them) into its device arrays as the policy says
// (no-op for raw codecs); `pq` for the pq codecs (CodecOps::EncodePq over every head at once).
absl::Status DeviceCodecStage(Backend& backend, const CompressionPolicy& policy,
                              const Projection* projection, DeviceCompressedCache* cache,
                              TransferBytes* transfers, const pq::Calibration* pq = nullptr);

}  // namespace pipeline_internal
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_PIPELINE_STAGES_H_
