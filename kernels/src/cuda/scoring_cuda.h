// Internal entry points of the CUDA ScoringOps below the op interface, for the benchmarks: the
// same work as ScoringOps::ScoreSelectCompact, enqueued on the context's stream without the
// closing data-error readback (which synchronises the host with the stream). Arguments are
// validated as the op does.
#ifndef KVCOMP_KERNELS_SRC_CUDA_SCORING_CUDA_H_
#define KVCOMP_KERNELS_SRC_CUDA_SCORING_CUDA_H_

#include "absl/status/status.h"
#include "cuda_ops.h"
#include "kvcomp/kernels/scoring_ops.h"

namespace kvcomp {
namespace cuda {

// Enqueues score + select + compact of one layer on ctx->stream. Workspace comes from
// ctx->allocator and is released stream-ordered before returning. Data errors (NaN/Inf keys) are
// not reported: use ScoringOps for that.
absl::Status EnqueueScoreSelectCompact(CudaContext* ctx, const ScoreSelectCompactArgs& args);

}  // namespace cuda
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_SCORING_CUDA_H_
