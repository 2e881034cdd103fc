// Pieces of kvsplice.cc that the device codec stage (pipeline_stages.cc) shares: the value
// codec's plan (projection check, layer ranks, parameters), the split of a cache with per-layer
// ranks into layers, and the KVSplice outlier rule's per-head row budget.
#ifndef KVCOMP_KERNELS_SRC_CPU_KVSPLICE_INTERNAL_H_
#define KVCOMP_KERNELS_SRC_CPU_KVSPLICE_INTERNAL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/projection.h"

namespace kvcomp {
namespace kvsplice_internal {

// InvalidArgument unless the projection's layers, kv heads and head_dim are the layout's.
absl::Status CheckProjectionLayout(const Projection& p, const KvLayout& layout);

// How a policy's KVSplice value codec encodes a cache of a layout: each layer's rank
// (ChooseLayerRanks), whether they are all equal, and the codec parameters at the largest.
struct ValuePlan {
  std::vector<uint32_t> ranks;
  bool uniform = true;
  ValueCodecParams params;  // params.rank is the largest layer rank
};
// FailedPrecondition without a projection; InvalidArgument when it does not fit the layout (or
// from ChooseLayerRanks). `policy.value_codec` must not be raw.
absl::StatusOr<ValuePlan> PlanValueCodec(const CompressionPolicy& policy,
                                         const Projection* projection, const KvLayout& layout);

// One layer of a cache whose layers have different latent ranks: its heads as a RowSpan (row
// offsets rebased to 0), its first row, and where its latents and scales start.
struct LayerRows {
  std::vector<uint64_t> offsets;
  uint64_t first_head = 0;
  uint64_t first_row = 0;
  uint64_t latent_byte = 0;
  uint64_t scale_elem = 0;
  ValueCodecParams params;
  RowSpan span() const {
    RowSpan r;
    r.first_head = first_head;
    r.row_offsets = offsets;
    return r;
  }
};

// Splits `offsets` (prefix sums of kept per head) into layers with params.rank = ranks[layer].
std::vector<LayerRows> SplitLayers(const std::vector<uint64_t>& offsets, uint32_t kv_heads,
                                   const ValueCodecParams& base,
                                   const std::vector<uint32_t>& ranks);

// KVSplice outliers: per head, the kept rows whose residual energy off the projection (at the
// layer's rank), lost = ||v - P^T P v||^2, exceeds max(kOutlierFloor x the head's median
// energy ||v||^2, value_outlier_factor x the head's median lost), the worst first (ties by lower
// row), at most OutlierCap(kept, value_raw_fraction) of them. Medians are the element of rank
// n / 2 in ascending order.
inline constexpr float kOutlierFloor = 0.01f;
inline uint64_t OutlierCap(uint64_t kept, double fraction) {
  return fraction > 0.0 ? static_cast<uint64_t>(static_cast<double>(kept) * fraction) : 0;
}

}  // namespace kvsplice_internal
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CPU_KVSPLICE_INTERNAL_H_
