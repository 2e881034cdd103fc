// The compression pipeline: the engine's entry points for the daemon, the SDKs and Python. Given
// one sequence's KV cache and a CompressionPolicy it runs, per layer, score -> budget -> select
// -> compact (ScoringOps), then the extension stages:
//   moments: when policy.moments, the MomentKV summary of each head's evicted tokens,
//     through backend.moments(); until that stage is implemented the cache has has_moments=false.
//   codecs : when policy.key_codec/value_codec are not raw, the kept tokens are encoded
//     through backend.codec(); until that stage is implemented such a policy is Unimplemented.
// The stages live in kernels/src/pipeline_stages.cc (one function each).
//
// Thread-safety: the functions are reentrant; a Backend is used by one thread at a time, so give
// each concurrent caller its own Backend. Views may be in host memory or the backend's space
// (the pipeline copies host inputs to a device backend itself).
#ifndef KVCOMP_KERNELS_PIPELINE_H_
#define KVCOMP_KERNELS_PIPELINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/projection.h"
#include "kvcomp/kernels/tensor.h"

namespace kvcomp {

// One sequence's KV cache as the engine reads it. Not owning.
struct KvCacheView {
  KvLayout layout;          // layers, kv heads, q heads, head_dim, dtype
  uint64_t num_tokens = 0;  // tokens of the sequence, >= 1
  // Per layer: [num_kv_heads, num_tokens, head_dim] views of layout.dtype, all in one space.
  std::vector<HeadsView> keys;
  std::vector<HeadsView> values;
  // snapkv only: per layer the last window's queries [num_q_heads, w, head_dim]; else empty.
  std::vector<HeadsView> queries;

  // OK, or InvalidArgument naming the first inconsistency (layer count, shapes, dtypes, K/V
  // mismatch, spaces, empty sequence, unsupported head_dim/dtype).
  absl::Status Validate() const;
};

// The tokens a (layer, kv head) evicts, handed to an EvictionHook. Not owning; valid during the
// call only. Rows index `keys`/`values`, which are host memory for the block-wise compressor and
// the backend's space for Compress.
struct EvictedTokens {
  uint32_t layer = 0;
  uint32_t kv_head = 0;
  HeadsView keys;    // the source the rows index (one layer, all heads; use row kv_head)
  HeadsView values;  // same shape as keys
  absl::Span<const uint32_t> rows;       // host, ascending token indices into keys/values
  absl::Span<const uint32_t> positions;  // host, their absolute positions in the sequence
};
// Receives evicted tokens (moment accumulation, tests, custom consumers). A non-OK status stops
// the compression and is returned by it.
using EvictionHook = std::function<absl::Status(const EvictedTokens&)>;

struct CompressOptions {
  // Called once per (layer, kv head) with the tokens it evicted (after selection, before the
  // moment stage). Optional; default none.
  EvictionHook on_evict;
  // The calibrated KVSplice projection of the model (kvcomp/kernels/calibration.h),
  // needed when policy.value_codec is not none (FailedPrecondition without it); its layers, kv
  // heads and head_dim must be the cache's. The cache records its version. Default none.
  std::shared_ptr<const Projection> projection;
};

// Compresses a whole sequence at once. InvalidArgument for bad input (see KvCacheView::Validate,
// CompressionPolicy::Validate, NaN/Inf keys, a budget of zero, snapkv without queries).
// Unimplemented for codecs not yet available. policy.block_size is ignored here (BlockCompressor).
absl::StatusOr<CompressedCache> Compress(Backend& backend, const KvCacheView& cache,
                                         const CompressionPolicy& policy,
                                         const CompressOptions& options = {});

// Scores of one layer's keys ([num_heads, num_tokens] f32, host), as the policy's scorer gives
// them (no protection applied). `queries` for snapkv.
absl::StatusOr<std::vector<float>> ScoreLayer(Backend& backend, const HeadsView& keys,
                                              const CompressionPolicy& policy, uint32_t layer = 0,
                                              const HeadsView& queries = {});

struct BlockCompressorOptions {
  // Tokens per head the working set is evicted down to after each block. 0 = from the policy:
  // policy.token_budget, else policy.KeptPerHead(expected_tokens). One of them must be set.
  uint64_t budget = 0;
  // Expected sequence length, used only to turn policy.ratio into a budget. Default 0.
  uint64_t expected_tokens = 0;
  // Receives every token evicted from the working set (after each block and at Finish).
  EvictionHook on_evict;
  // As CompressOptions::projection. Default none.
  std::shared_ptr<const Projection> projection;
};

// Block-wise compression for streaming prefill (KeyDiff): blocks of at most
// policy.block_size tokens arrive in order per layer; after each block the layer's working set
// is scored and evicted down to the budget. Memory: at most budget + block_size tokens per head
// (AdaKV: per layer on average, heads may hold more than others). The working set is host memory;
// block inputs may be host or backend memory. Scores are recomputed over the working set each
// time (keydiff/manifold means over the working set; windowed_manifold windows over its rows).
// snapkv is not supported (its queries exist only at the end) and is InvalidArgument.
//
// Not thread-safe. Owns its working set; the Backend must outlive it.
class BlockCompressor {
 public:
  static absl::StatusOr<std::unique_ptr<BlockCompressor>> Create(
      Backend& backend, const KvLayout& layout, const CompressionPolicy& policy,
      BlockCompressorOptions options = {});
  virtual ~BlockCompressor() = default;

  // Appends the next block of `layer`: keys/values [num_kv_heads, b, head_dim] of layout.dtype,
  // 1 <= b <= block_size. InvalidArgument for bad shapes or NaN/Inf keys (the block is then
  // dropped and the compressor stays usable).
  virtual absl::Status Append(uint32_t layer, const HeadsView& keys, const HeadsView& values) = 0;
  // Evicts what still exceeds the budget and returns the cache. Every layer must have seen the
  // same number of tokens (>= 1). The compressor is spent afterwards.
  virtual absl::StatusOr<CompressedCache> Finish() = 0;

  virtual uint64_t budget() const = 0;
  virtual uint64_t tokens_seen(uint32_t layer) const = 0;
  // The most tokens any head of any layer held at once (the memory bound tests check).
  virtual uint64_t peak_tokens_per_head() const = 0;
};

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_PIPELINE_H_
