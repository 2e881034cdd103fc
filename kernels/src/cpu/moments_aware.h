// Moment-aware eviction (docs/moment_aware.md): the MomentKV summary steers which tokens are
// evicted. The pipeline calls these when policy.moment_aware is set, in place of its plain
// score -> select -> compact (whole sequence) or between score and select (block-wise).
#ifndef KVCOMP_KERNELS_SRC_CPU_MOMENTS_AWARE_H_
#define KVCOMP_KERNELS_SRC_CPU_MOMENTS_AWARE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/scoring_ops.h"

namespace kvcomp {
namespace moments_internal {

// Weight of the distance percentile in the combined score (docs/moment_aware.md).
inline constexpr double kMomentAwareBeta = 0.5;

// Tokens a chunk of the summary mean's sum (MomentAwareRescore): each chunk's provisionally
// evicted keys are summed in token order from +0, the chunks added in order. Fixed by the rule,
// not by a launch shape, so the CPU and the device sum the same f64 values in the same order.
inline constexpr uint64_t kMomentAwareMeanChunk = 256;

// Rewrites `scores` ([keys.num_heads, keys.num_tokens], host) in place by the rule: per head, a
// provisional eviction (top kept_per_head of the scores, protected tokens kept, ties by lower
// index), the summary mean mu of the prior evicted keys (prior_count/prior_key_sum per head, or
// null) plus the provisionally evicted ones (summed in f64 chunk by chunk, see
// kMomentAwareMeanChunk), then
//   score'_i = (1 - beta) * pct(score_i) + beta * pct(f32(||k_i - mu||))
// with pct the rank in [0, 1] (ties by lower index) and the distance summed in f64 in channel
// order, then rounded to f32. Heads with no token to evict keep their
// scores. keys: host. InvalidArgument on bad shapes.
absl::Status MomentAwareRescore(const HeadsView& keys, const SelectParams& select,
                                const TokenPositions& positions, const uint64_t* prior_count,
                                const float* prior_key_sum, float* scores);

// MomentAwareRescore without prior moments for keys and scores in device memory, on the
// CUDA stream `stream` with workspaces from `allocator` (positions.data, when set, in device
// memory too). No host wait. FailedPrecondition in a build without CUDA.
absl::Status MomentAwareRescoreOnDevice(void* stream, Allocator& allocator, const HeadsView& keys,
                                        const SelectParams& select,
                                        const TokenPositions& positions, float* scores);

// Score (args.score) -> MomentAwareRescore -> Select -> Compact on `backend`, with the same
// outputs as ScoreSelectCompact(args) (args.scores, when set, receives the combined scores).
// Device backends rescore on the device (MomentAwareRescoreOnDevice).
absl::Status MomentAwareScoreSelectCompact(Backend& backend, const ScoreSelectCompactArgs& args);

}  // namespace moments_internal
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CPU_MOMENTS_AWARE_H_
