// The compression policy: which tokens to keep (scorer, budget, protection), what to keep of the
// evicted ones (moments) and how to encode the kept ones (codecs). Plain struct whose fields are
// declared once, with their unit, default and range, in kvcomp/core/policy_fields.def.
// Validate() is the single check used by the engine, the daemon and the SDKs.
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
  kInt4 = 3,  // int4, two per byte, one f32 scale per (layer, kv head, channel) and group of
              // kKeyInt4GroupRows kept tokens
  kHq4 = 4,   // Hadamard codec (kvcomp/codecs/hq.h), 4 bits per element, per-token f16 min/step
  kHq3 = 5,   // the same at 3 bits
  kPq = 6,    // calibrated basis codec (kvcomp/codecs/pq.h): key_bits x head_dim bits per row
              // against the model's pq calibration, no scales
};

// Kept tokens of a head per int4 key scale group (the head's rows in order; the last group may be
// short).
inline constexpr uint64_t kKeyInt4GroupRows = 128;
// Scales per channel a head keeping `rows` tokens stores: 1 for int8 (also at 0 rows),
// ceil(rows / kKeyInt4GroupRows) for int4, 0 for raw and fp16.
inline uint64_t KeyScaleGroups(KeyCodec codec, uint64_t rows) {
  if (codec == KeyCodec::kInt8) return 1;
  if (codec == KeyCodec::kInt4) return (rows + kKeyInt4GroupRows - 1) / kKeyInt4GroupRows;
  return 0;
}

enum class ValueCodec : uint8_t {
  kRaw = 0,             // values kept in the input dtype
  kOrthogonal = 1,      // latent = V P^T, f16, rank r
  kOrthogonalInt8 = 2,  // latent quantized per group to int8, f16 scales
  kOrthogonalInt4 = 3,  // latent quantized per group to int4 (two per byte), f16 scales
  kHq4 = 4,             // Hadamard codec (kvcomp/codecs/hq.h) at 4 bits: no projection, no rank
  kHq3 = 5,             // the same at 3 bits
  kPq = 6,              // calibrated basis codec (kvcomp/codecs/pq.h): value_bits x head_dim
                        // bits per row against the model's pq calibration
};

// Codec numbers a cache or a wire message may carry (the largest defined), for parsers.
inline constexpr uint8_t kMaxKeyCodec = static_cast<uint8_t>(KeyCodec::kPq);
inline constexpr uint8_t kMaxValueCodec = static_cast<uint8_t>(ValueCodec::kPq);
// Bits per element of the Hadamard codecs; 0 for every other codec. Their rows are
// 4 + head_dim * bits / 8 bytes each (f16 minimum, f16 step, packed codes), with no scales.
inline uint32_t HqBits(KeyCodec c) {
  return c == KeyCodec::kHq4 ? 4 : c == KeyCodec::kHq3 ? 3 : 0;
}
inline uint32_t HqBits(ValueCodec c) {
  return c == ValueCodec::kHq4 ? 4 : c == ValueCodec::kHq3 ? 3 : 0;
}
// The calibrated basis codec (pq): needs the model's pq calibration (keys' and values' bases).
inline bool IsPq(KeyCodec c) { return c == KeyCodec::kPq; }
inline bool IsPq(ValueCodec c) { return c == ValueCodec::kPq; }
// Value codecs that go through KVSplice's projection (orthogonal, _int8, _int4).
inline bool IsProjectionCodec(ValueCodec c) {
  return c == ValueCodec::kOrthogonal || c == ValueCodec::kOrthogonalInt8 ||
         c == ValueCodec::kOrthogonalInt4;
}

absl::string_view ScorerName(Scorer s);  // "knorm", "keydiff", "manifold", ...
absl::StatusOr<Scorer> ParseScorer(absl::string_view name);
absl::string_view HeadBudgetName(HeadBudget b);  // "uniform", "adakv"
absl::StatusOr<HeadBudget> ParseHeadBudget(absl::string_view name);
absl::string_view KeyCodecName(KeyCodec c);  // "raw", "fp16", "int8", "int4", "hq4", "hq3", "pq"
absl::StatusOr<KeyCodec> ParseKeyCodec(absl::string_view name);
absl::string_view ValueCodecName(ValueCodec c);  // "none", "orthogonal", "orthogonal_int8", ...
absl::StatusOr<ValueCodec> ParseValueCodec(absl::string_view name);
// Default latent rank of a value codec for a head dimension: orthogonal keeps head_dim/2,
// orthogonal_int8 head_dim/2, orthogonal_int4 head_dim*3/4 (int4 costs accuracy, rank buys it
// back); raw, the Hadamard codecs and pq have no rank (0).
uint32_t DefaultRank(ValueCodec codec, uint32_t head_dim);

struct CompressionPolicy {
  // The fields, their defaults, ranges and documentation: one row each in policy_fields.def
  // (which tokens to keep: scorer, budget, protection; what to keep of the evicted ones:
  // moments; how to encode the kept ones: codecs). Read it for what each field means.
#define KVCOMP_POLICY_FIELD(name, type, tlv_tag, thrift_id, default_value, range, unit, doc) \
  type name = default_value;
#include "kvcomp/core/policy_fields.def"
#undef KVCOMP_POLICY_FIELD

  // OK or InvalidArgument naming the field and the allowed range: each field against its
  // declared range, then the rules between fields (snapkv_pool odd, rank and value codec).
  absl::Status Validate() const;
  // As Validate, plus checks that need the head dimension (rank <= head_dim, group fits).
  absl::Status ValidateFor(uint32_t head_dim) const;
  // Rank actually used for `head_dim` (0 when the value codec is raw).
  uint32_t EffectiveRank(uint32_t head_dim) const;
  // Tokens a head of `num_tokens` keeps under ratio or token_budget (before AdaKV moves them).
  uint64_t KeptPerHead(uint64_t num_tokens) const;
  // Recent tokens protected for a head keeping `kept_per_head` tokens:
  // max(n_recent, min(floor(recent_fraction * kept_per_head), kept_per_head - n_sink)),
  // saturated at UINT32_MAX (the fraction's window leaves the sink its room). Under AdaKV
  // `kept_per_head` is the uniform per-head budget (the layer's budget over its heads).
  uint32_t EffectiveRecent(uint64_t kept_per_head) const;

  std::string DebugString() const;
  friend bool operator==(const CompressionPolicy& a, const CompressionPolicy& b);
  friend bool operator!=(const CompressionPolicy& a, const CompressionPolicy& b) {
    return !(a == b);
  }
};

// The policy whose every field has its absent value: what a policy record set without a
// field's tag, an unset Thrift field and a policies-log record without the field's key mean.
// It is the default policy except for the fields policy_absent.def names (defaults that changed
// after caches and clients were written with the old one): a default changes for new policies,
// never for what was written before. The cache format's and the wire protocol's policy
// decoders, the Thrift mapping and the policies log start from it.
CompressionPolicy AbsentFieldPolicy();

}  // namespace kvcomp

#endif  // KVCOMP_CORE_POLICY_H_
