// The compression policy: which tokens to keep (scorer, budget, protection), what to keep of the
// evicted ones (moments) and how to encode the kept ones (codecs). Plain struct; every field
// documents its unit and default. Validate() is the single check used by the engine, the daemon
// and the SDKs.
#ifndef KVCOMP_CORE_POLICY_H_
#define KVCOMP_CORE_POLICY_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcomp {

// Numbers are stored in caches and sent on the wire: never renumber.
enum class Scorer : uint8_t {
  kKnorm = 0,             // s = -||k||2
  kKeyDiff = 1,           // s = -cos(k, a), a = mean of k/||k||
  kManifold = 2,          // s = ||k - mu||2, mu = mean of the keys
  kWindowedManifold = 3,  // as manifold, mu = mean of the W-token window holding the token
  kStreaming = 4,         // keep the n_sink first and the most recent tokens
  kRandom = 5,            // seeded uniform scores
  kSnapKV = 6,            // attention of the client's observation-window queries
};

enum class HeadBudget : uint8_t {
  kUniform = 0,  // every kv head keeps the same count
  kAdaKV = 1,    // heads of a layer share the layer's budget (AdaKV)
};

enum class KeyCodec : uint8_t {
  kRaw = 0,   // keys kept in the input dtype
  kFp16 = 1,  // keys as IEEE half
  kInt8 = 2,  // int8 with one f32 scale per (layer, kv head, channel)
};

enum class ValueCodec : uint8_t {
  kRaw = 0,             // values kept in the input dtype
  kOrthogonal = 1,      // latent = V P^T, f16, rank r
  kOrthogonalInt8 = 2,  // latent quantized per group to int8, f16 scales
  kOrthogonalInt4 = 3,  // latent quantized per group to int4 (two per byte), f16 scales
};

absl::string_view ScorerName(Scorer s);  // "knorm", "keydiff", "manifold", ...
absl::StatusOr<Scorer> ParseScorer(absl::string_view name);
absl::string_view HeadBudgetName(HeadBudget b);  // "uniform", "adakv"
absl::StatusOr<HeadBudget> ParseHeadBudget(absl::string_view name);
absl::string_view KeyCodecName(KeyCodec c);  // "raw", "fp16", "int8"
absl::StatusOr<KeyCodec> ParseKeyCodec(absl::string_view name);
absl::string_view ValueCodecName(ValueCodec c);  // "none", "orthogonal", "orthogonal_int8", ...
absl::StatusOr<ValueCodec> ParseValueCodec(absl::string_view name);
// Default latent rank of a value codec for a head dimension: orthogonal keeps head_dim/2,
// orthogonal_int8 head_dim/2, orthogonal_int4 head_dim*3/4 (int4 costs accuracy, rank buys it
// back); raw has no rank (0).
uint32_t DefaultRank(ValueCodec codec, uint32_t head_dim);

struct CompressionPolicy {
  // --- which tokens to keep ---
  Scorer scorer = Scorer::kManifold;  // default: ManifoldKV
  // Fraction of tokens to evict per head, in [0, 1). kept = int(n * (1 - ratio)) in double,
  // truncated (1000 tokens at 0.07 keep 929). Ignored when token_budget > 0. Default 0.5.
  double ratio = 0.5;
  // Absolute number of tokens kept per kv head; 0 = use ratio. Default 0.
  uint32_t token_budget = 0;
  HeadBudget head_budget = HeadBudget::kUniform;  // default uniform
  // AdaKV: fraction of each head's uniform budget it keeps before the layer-wide competition,
  // in [0, 1]. Default 0.20.
  double alpha_safeguard = 0.20;
  // Tokens at the start always kept when protect is set (the attention sink), and the sink size
  // of the streaming scorer. Default 4.
  uint32_t n_sink = 4;
  // Most recent tokens always kept when protect is set. Default 0.
  uint32_t n_recent = 0;
  // Share of each head's kept budget reserved for the most recent tokens when protect is set, in
  // [0, 1): the recent window is max(n_recent, floor(recent_fraction * kept per head)), so it
  // scales with the budget (EffectiveRecent). 0 = n_recent alone. Default 0.
  double recent_fraction = 0.0;
  // Keep the first n_sink and last n_recent tokens whatever their score. Default true.
  bool protect = true;
  // Window of windowed_manifold, in tokens (the last window may be short). Default 4096.
  uint32_t window = 4096;
  // SnapKV observation window (queries supplied by the client) and pooling width. 64 and 5.
  uint32_t snapkv_window = 64;
  uint32_t snapkv_pool = 5;
  // Seed of the random scorer. Default 0.
  uint64_t seed = 0;
  // Block-wise compression for streaming prefill: tokens per block, 0 = compress the whole
  // sequence at once. Default 0.
  uint32_t block_size = 0;

  // --- what to keep of the evicted tokens ---
  // Keep MomentKV summaries (count, sums of k and v, sum of v k^T) per kv head. Default true.
  bool moments = true;
  // Let the moment summary steer eviction (docs/moment_aware.md). Default false.
  bool moment_aware = false;

  // --- how to encode the kept tokens ---
  KeyCodec key_codec = KeyCodec::kRaw;        // default raw
  ValueCodec value_codec = ValueCodec::kRaw;  // default none
  // Latent rank for orthogonal codecs; 0 = DefaultRank(value_codec, head_dim). Default 0.
  uint32_t rank = 0;
  // Latent elements per quantization group (one f16 scale each). Default 32.
  uint32_t group_size = 32;
  // Scale latent directions by the calibration's eigenvalues before quantizing. Default true.
  bool gamma_aware = true;
  // KVSplice outliers (docs/kvsplice.md): a kept token whose value's residual energy off the
  // projection, ||v - P^T P v||^2, exceeds value_outlier_factor x the median of its head's (and
  // 1% of the head's median ||v||^2) keeps its value raw, the worst first, at most
  // value_raw_fraction of each head's kept tokens (0: never). Defaults 4 and 0.02.
  double value_outlier_factor = 4.0;
  double value_raw_fraction = 0.02;

  // OK or InvalidArgument naming the field and the allowed range.
  absl::Status Validate() const;
  // As Validate, plus checks that need the head dimension (rank <= head_dim, group fits).
  absl::Status ValidateFor(uint32_t head_dim) const;
  // Rank actually used for `head_dim` (0 when the value codec is raw).
  uint32_t EffectiveRank(uint32_t head_dim) const;
  // Tokens a head of `num_tokens` keeps under ratio or token_budget (before AdaKV moves them).
  uint64_t KeptPerHead(uint64_t num_tokens) const;
  // Recent tokens protected for a head keeping `kept_per_head` tokens:
  // max(n_recent, floor(recent_fraction * kept_per_head)), saturated at UINT32_MAX. Under AdaKV
  // `kept_per_head` is the uniform per-head budget (the layer's budget over its heads).
  uint32_t EffectiveRecent(uint64_t kept_per_head) const;

  std::string DebugString() const;
  friend bool operator==(const CompressionPolicy& a, const CompressionPolicy& b);
  friend bool operator!=(const CompressionPolicy& a, const CompressionPolicy& b) {
    return !(a == b);
  }
};

}  // namespace kvcomp

#endif  // KVCOMP_CORE_POLICY_H_
