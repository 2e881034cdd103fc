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

// The one-launch varlen batch (ScoringOps::ScoreSelectCompactVarlen) enqueued without the error
// readback; a batch the one-launch path does not take runs request by request and synchronises.
absl::Status EnqueueScoreSelectCompactVarlen(CudaContext* ctx,
                                             const ScoreSelectCompactVarlenArgs& args);

// KeySums of a [H, n, D] key view in device memory (16-byte aligned rows), for chunks
// [chunk_begin, chunk_end) of kKeySumChunkTokens tokens: `sums` and/or `unit_sums` (each
// [H, ceil(n / kKeySumChunkTokens), D] f32, either may be null) on `stream`. A key row with
// NaN/Inf is reported to *bad_key (atomicMin of head * n + token; the caller sets it to ~0).
// Every chunk's rows must be in place before (stream order). The scorer, given these, reaches
// the same scores as when it sums the keys itself.
absl::Status EnqueueKeySums(cudaStream_t stream, const HeadsView& keys, uint64_t chunk_begin,
                            uint64_t chunk_end, float* sums, float* unit_sums,
                            unsigned long long* bad_key);

}  // namespace cuda
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_SCORING_CUDA_H_
