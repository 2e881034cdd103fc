// ScoringOps: the operations of Engine I behind kvcomp::Backend: score every token of
// one layer, choose the kept tokens under a budget, and gather (compact) their keys and values.
//
// One call works on ONE layer: a HeadsView of [num_heads, num_tokens, head_dim]. AdaKV budgets
// are shared across the heads of that view.
//
// Host contract (FlashInfer/CUTLASS style), the same for every backend:
//  - Every call validates its arguments first and returns InvalidArgument (nothing written) for
//    dtype other than f16/bf16/f32, head_dim other than 64/128/256, zero heads or tokens, null
//    buffers, mismatched K/V shapes, memory in the wrong space, a budget of zero, bad scorer
//    parameters. CheckScoreArgs/CheckSelectArgs/CheckCompactArgs below are that validation;
//    backends call them so the messages are identical.
//  - Data check: Score (and ScoreSelectCompact) returns InvalidArgument when a key is NaN or
//    Inf (or its squared norm overflows float32); ScoreSelectCompact and CheckFinite refuse
//    values the same way. The rule for K and V alike: every element finite and every row's
//    (one head, one token) squared L2 norm at most FLT_MAX (about 3.4e38), so any finite f16 or
//    bf16-range value below ~1e19 / sqrt(head_dim) passes. Messages: "keys: NaN or Inf (or a
//    squared norm beyond float32) at head H, token T" ("values: ..." for values). The outputs
//    are then unspecified.
//  - All pointers (views, scores, counts, indices, outputs) are in the backend's memory space.
//    Outputs are written into caller buffers; workspace comes from the backend's Allocator.
//  - The CUDA backend orders every op on its stream; the host may read results after
//    Backend::Synchronize() or Backend::CopyToHost(). A data error found on the device is
//    reported by the call that found it (which synchronizes for that purpose), unless the caller
//    defers the check (ScoreSelectCompactArgs::deferred_check).
//  - Not thread-safe: one ScoringOps (one Backend) per thread or stream.
//
// Selection rule (exact, so backends agree): a token's effective score is +inf when it is
// protected, else its score. A head keeps the tokens of highest effective score; ties are
// broken by lower token index first (AdaKV's layer-wide stage: by lower head, then lower token
// index). Kept indices are written in ascending order. Scores are finite after Score succeeds.
#ifndef KVCOMP_KERNELS_SCORING_OPS_H_
#define KVCOMP_KERNELS_SCORING_OPS_H_

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/kernels/tensor.h"

#if defined(__CUDACC__)
#define KVCOMP_HOST_DEVICE __host__ __device__
#else
#define KVCOMP_HOST_DEVICE
#endif

namespace kvcomp {

// Score assigned by the streaming scorer to the n_sink first positions (above any position).
inline constexpr float kStreamingSinkScore = 3.0e38f;
// Norm floor of keydiff's cosine (as torch's cosine_similarity eps).
inline constexpr float kKeyDiffEps = 1e-8f;

// Absolute positions of a view's tokens. Whole-sequence calls use the default (token i is at
// position offset + i); block-wise working sets, whose tokens are no longer contiguous, pass
// `data`. Used by streaming and random scores and by protection.
struct TokenPositions {
  // [num_heads, num_tokens] u32, backend memory space, ascending per head; nullptr = identity.
  const uint32_t* data = nullptr;
  // Position of token 0 when data is nullptr. Default 0.
  uint64_t offset = 0;
  // Tokens of the whole sequence so far (positions >= sequence_length - n_recent are "recent");
  // 0 = offset + num_tokens. Default 0.
  uint64_t sequence_length = 0;

  uint64_t position(const uint32_t* row, uint64_t token) const {
    return data != nullptr ? row[token] : offset + token;
  }
};

// Tokens per chunk of KeySums.
inline constexpr uint32_t kKeySumChunkTokens = 256;

// The keys' sums of one layer, accumulated while its blocks arrived (DeviceKv on the device,
// kvcompd's put assembler on the host), so that the mean-based scorers read the keys once:
// manifold and keydiff always, windowed_manifold when its window is a multiple of
// kKeySumChunkTokens or covers the whole view. Both backends use them and reach the same scores
// as without them (the same per-chunk sums in the same order): on the host when the sums were
// made by SumKeysOnHost, on the device when made by DeviceKv.
struct KeySums {
  // [num_heads, ceil(num_tokens / kKeySumChunkTokens), head_dim] f32 in the backend's memory
  // space: per chunk of kKeySumChunkTokens tokens (the last one short), the sum of the keys
  // (`sums`) and of k / max(||k||, kKeyDiffEps) (`unit_sums`, keydiff). Either may be null
  // (that scorer then computes its mean).
  const float* sums = nullptr;
  const float* unit_sums = nullptr;
  // Tokens they cover; must equal the keys' num_tokens when a sum is given.
  uint64_t num_tokens = 0;
};

// Host keys [H, n, D]: the KeySums of chunks [chunk_begin, chunk_end) of every head, written at
// their places in `sums` and `unit_sums` ([H, ceil(n / kKeySumChunkTokens), D] f32 each; either
// may be null), summed exactly as the CPU scorers sum the keys themselves, so that a CPU scorer
// given them returns the same bits. On the calling thread; no data check (the scorer checks).
// InvalidArgument for a view the scorers refuse or a chunk range beyond the keys.
absl::Status SumKeysOnHost(const HeadsView& keys, uint64_t chunk_begin, uint64_t chunk_end,
                           float* sums, float* unit_sums);

// Scorer parameters, a plain struct built on the host (ScoreParamsFromPolicy).
struct ScoreParams {
  Scorer scorer = Scorer::kManifold;
  // windowed_manifold: tokens per window, >= 1; window w covers token indices [w*W, (w+1)*W) of
  // the view (the last one may be short). Default 4096.
  uint32_t window = 4096;
  // streaming: number of first positions kept whatever happens. Default 4.
  uint32_t n_sink = 4;
  // random: seed, and a stream id mixed into it (the pipeline passes the layer). Default 0, 0.
  uint64_t seed = 0;
  uint64_t stream = 0;
  // snapkv: the observation window's queries, [num_q_heads, w, head_dim], same dtype, head_dim
  // and space as the keys, num_q_heads a multiple of the keys' num_heads (GQA: q head j belongs
  // to kv head j / group), 1 <= w <= num_tokens; they are the queries of the LAST w tokens.
  // Unused by other scorers.
  HeadsView queries;
  // snapkv: width of the average pooling over tokens (odd, zero padded, divided by the width).
  // Default 5.
  uint32_t snapkv_pool = 5;
  // Optional: the keys' sums from the data path (KeySums). Default none.
  KeySums key_sums;
};

// Budget parameters, a plain struct built on the host (SelectParamsFromPolicy).
struct SelectParams {
  // Tokens kept per head (uniform), >= 1; clamped to num_tokens. Under AdaKV the layer keeps
  // num_heads * kept_per_head tokens in all. 0 is InvalidArgument ("budget of zero").
  uint64_t kept_per_head = 0;
  HeadBudget head_budget = HeadBudget::kUniform;
  // AdaKV: each head first keeps its top int(kept_per_head * alpha_safeguard). Default 0.20.
  double alpha_safeguard = 0.20;
  // Protection: positions < n_sink and >= sequence_length - n_recent score +inf. Default on, 4, 0.
  bool protect = true;
  uint32_t n_sink = 4;
  uint32_t n_recent = 0;
};

// Where selection writes the kept tokens: ragged per head, head h's indices at
// [sum(counts[0..h)), +counts[h]), ascending token indices into the view.
struct KeptIndices {
  uint32_t* counts = nullptr;   // [num_heads]
  uint32_t* indices = nullptr;  // capacity KeptCapacity(num_heads, num_tokens, kept_per_head)
};

// The most kept tokens a layer can produce: num_heads * min(kept_per_head, num_tokens).
inline uint64_t KeptCapacity(uint32_t num_heads, uint64_t num_tokens, uint64_t kept_per_head) {
  return uint64_t{num_heads} * (kept_per_head < num_tokens ? kept_per_head : num_tokens);
}

// The data check of ScoreSelectCompact, as found on the device: each field is the first bad
// row (head * rows + token, lowest first) or kNone. A caller that defers the check initialises
// the record to Clean() (all kNone) or lets the op overwrite it.
struct DeferredCheck {
  static constexpr uint64_t kNone = ~uint64_t{0};
  uint64_t bad_key = kNone;    // a key row with NaN/Inf or a squared norm beyond float32
  uint64_t bad_query = kNone;  // the same for snapkv queries
  uint64_t bad_score = kNone;  // a non-finite score given to the selection
  uint64_t bad_value = kNone;  // a value row with NaN/Inf or a squared norm beyond float32
};

// The status the op returns for `check` (the data-check messages above): `num_tokens` of the
// layer, `query_tokens` of the snapkv window (0 without).
absl::Status DeferredCheckStatus(const DeferredCheck& check, uint64_t num_tokens,
                                 uint64_t query_tokens);

// All of one layer's work in one call (ScoreSelectCompact).
//
// Batching short requests: requests of one length, dtype and head_dim may be given as one view of
// requests x heads heads (head_stride steps from one request's heads to the next). Under a
// uniform budget every head is selected on its own, so the kept sets, rows and counts are those
// of one call per request, head h of request r at view head r * heads + h; the CUDA backend then
// runs each kernel once for all of them. Not for AdaKV (its budget is shared by the heads of the
// view, so requests would take from each other) nor for the random scorer (its scores depend on
// the head index).
struct ScoreSelectCompactArgs {
  HeadsView keys;    // [H, n, d]
  HeadsView values;  // same shape and dtype as keys
  ScoreParams score;
  SelectParams select;
  TokenPositions positions;
  float* scores = nullptr;  // optional output [H, n] f32, dense; nullptr = not wanted
  KeptIndices kept;         // output
  // Outputs: the kept keys and values, ragged [total kept, head_dim], dense rows in the input
  // dtype, head h's rows from sum(counts[0..h)). Capacity KeptCapacity(...) rows each.
  void* keys_out = nullptr;
  void* values_out = nullptr;
  // false: score and select only (counts and indices); keys_out and values_out are unused and
  // the values are not read, so not checked. For a caller that compacts in a pass of its own and
  // checks the values there (MomentOps::CompactAndAccumulateDeferred: a device compression
  // that keeps moments copies the kept rows and sums the evicted ones in one pass).
  bool compact = true;
  // Optional, device backends: a DeferredCheck in device memory. When set, the data check does
  // not hold the host: the op writes its findings there in stream order and returns once the work
  // is enqueued (argument errors are still returned at once). The caller reads the record after
  // the stream synchronises and turns it into the op's status with DeferredCheckStatus. Host
  // backends check at once and leave the record as it is.
  DeferredCheck* deferred_check = nullptr;
  // Optional: rewrites the scores in place after the scoring pass and before the selection
  // reads them (the moment-aware rescoring), given the op's [H, n] scores in the backend's memory
  // space; on a device backend it enqueues its work on the op's stream (native_stream()). An
  // error it returns is the op's. The scores the selection sees are then the hook's, and the
  // streaming scorer's shortcut that selects without scores is not taken.
  std::function<absl::Status(float* scores)> rescore;
};

// Many requests of different lengths in one call (a varlen layout, as FlashAttention's
// cu_seqlens): request r is tokens [cu_seqlens[r], cu_seqlens[r + 1]) of every head of one
// [H, total, d] view, and is compressed as if it were its own ScoreSelectCompact call (positions
// from 0, its own means, windows and protection) under its own uniform budget.
struct ScoreSelectCompactVarlenArgs {
  HeadsView keys;    // [H, cu_seqlens[requests], d]
  HeadsView values;  // same shape and dtype
  // Host memory, requests + 1 entries: cu_seqlens[0] = 0, strictly ascending.
  const uint64_t* cu_seqlens = nullptr;
  uint32_t requests = 0;
  ScoreParams score;  // any scorer but snapkv; key_sums unused
  // Protection and n_sink / n_recent, shared by the requests; head_budget must be uniform;
  // kept_per_head is ignored (below).
  SelectParams select;
  // Host memory, `requests` entries >= 1: request r keeps min(kept_per_head[r], its length)
  // tokens per head.
  const uint64_t* kept_per_head = nullptr;
  // Optional output: scores, request r's [H, n_r] dense at H * cu_seqlens[r].
  float* scores = nullptr;
  // Outputs in request-major order: counts [requests * H] (request r's head h at r * H + h),
  // indices and the kept K and V rows ragged in that order (capacity: the sum of the counts).
  KeptIndices kept;
  void* keys_out = nullptr;
  void* values_out = nullptr;
};

class ScoringOps {
 public:
  virtual ~ScoringOps() = default;

  // scores[h * n + i] = score of token i of head h (f32, dense [H, n]); higher = keep.
  virtual absl::Status Score(const HeadsView& keys, const ScoreParams& params,
                             const TokenPositions& positions, float* scores) = 0;

  // Chooses the kept tokens of every head from `scores` ([num_heads, num_tokens], dense) under
  // `params`, writing counts and ascending indices (see the selection rule above).
  virtual absl::Status Select(const float* scores, uint32_t num_heads, uint64_t num_tokens,
                              const SelectParams& params, const TokenPositions& positions,
                              KeptIndices out) = 0;

  // Gathers rows indices[...] of keys and values per head into the ragged outputs (dtype kept).
  // `counts` and `indices` as written by Select; every index must be < num_tokens
  // (InvalidArgument otherwise on the CPU; the CUDA backend may trust Select's output).
  virtual absl::Status Compact(const HeadsView& keys, const HeadsView& values,
                               const uint32_t* counts, const uint32_t* indices, void* keys_out,
                               void* values_out) = 0;

  // Score + Select + Compact in as few passes as the backend can; same results as the three
  // calls in sequence.
  virtual absl::Status ScoreSelectCompact(const ScoreSelectCompactArgs& args) = 0;

  // ScoreSelectCompact of every request of a varlen batch. This default runs one
  // ScoreSelectCompact per request on a view of its tokens (the reference); the CUDA backend
  // runs batches of requests of up to 8192 tokens in one launch of each kernel for the whole
  // batch (windowed_manifold when its window covers every request; otherwise request by
  // request). Errors name the request ("request r: ...").
  virtual absl::Status ScoreSelectCompactVarlen(const ScoreSelectCompactVarlenArgs& args);

  // Workspace ScoreSelectCompact will take from the allocator for these shapes (bytes).
  virtual uint64_t WorkspaceBytes(const ScoreSelectCompactArgs& args) const = 0;

  // The data check of Score on any view (values of a block, ...): InvalidArgument
  // "<what>: NaN or Inf (or a squared norm beyond float32) at head H, token T" for the first bad
  // row (lowest head, then token), or for a bad view (CheckHeadsView).
  virtual absl::Status CheckFinite(const HeadsView& view, const char* what) = 0;
};

// --- Argument validation shared by every backend (InvalidArgument with a clear message) ---
absl::Status CheckHeadsView(const HeadsView& view, MemorySpace space, const char* what);
absl::Status CheckScoreArgs(const HeadsView& keys, const ScoreParams& params,
                            const TokenPositions& positions, MemorySpace space);
absl::Status CheckSelectArgs(uint32_t num_heads, uint64_t num_tokens, const SelectParams& params);
absl::Status CheckCompactArgs(const HeadsView& keys, const HeadsView& values, MemorySpace space);
absl::Status CheckScoreSelectCompactArgs(const ScoreSelectCompactArgs& args, MemorySpace space);
absl::Status CheckScoreSelectCompactVarlenArgs(const ScoreSelectCompactVarlenArgs& args,
                                               MemorySpace space);
// The ScoreSelectCompactArgs of request r of a varlen batch: a view of its tokens, its budget,
// and its outputs at `rows_before` (the kept rows of requests 0..r-1).
ScoreSelectCompactArgs VarlenRequestArgs(const ScoreSelectCompactVarlenArgs& args, uint32_t r,
                                         uint64_t rows_before);

// --- Parameters from a policy ---
// `layer` becomes the random scorer's stream; `queries` is the layer's snapkv window (or empty).
ScoreParams ScoreParamsFromPolicy(const CompressionPolicy& policy, uint32_t layer,
                                  const HeadsView& queries = {});
// kept_per_head = policy.KeptPerHead(num_tokens), n_recent = policy.EffectiveRecent(kept_per_head)
// (recent_fraction of the per-head budget, at least n_recent; under AdaKV of the uniform per-head
// budget). InvalidArgument when kept_per_head is zero ("budget of zero": ratio too high for so
// few tokens) or the policy does not validate.
absl::StatusOr<SelectParams> SelectParamsFromPolicy(const CompressionPolicy& policy,
                                                    uint64_t num_tokens);

// --- Formulas every backend must reproduce bit-exactly ---
KVCOMP_HOST_DEVICE inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// The random scorer: uniform in [0, 1) with 24 bits, a function of (seed, stream, head, position).
KVCOMP_HOST_DEVICE inline float RandomScore(uint64_t seed, uint64_t stream, uint32_t head,
                                            uint64_t position) {
  uint64_t x = SplitMix64(seed ^ SplitMix64(stream));
  x = SplitMix64(x ^ head);
  x = SplitMix64(x ^ position);
  return static_cast<float>(x >> 40) * (1.0f / 16777216.0f);
}
// The streaming scorer: sinks first, then later positions score higher (exact to 2^24 tokens).
KVCOMP_HOST_DEVICE inline float StreamingScore(uint64_t position, uint32_t n_sink) {
  return position < n_sink ? kStreamingSinkScore : static_cast<float>(position);
}
// True when `position` is protected under `params` for a sequence of `sequence_length` tokens.
KVCOMP_HOST_DEVICE inline bool IsProtected(uint64_t position, uint64_t sequence_length,
                                           const SelectParams& params) {
  if (!params.protect) return false;
  if (position < params.n_sink) return true;
  return params.n_recent > 0 && position + params.n_recent >= sequence_length;
}

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SCORING_OPS_H_
