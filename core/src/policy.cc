#include "kvcomp/core/policy.h"

#include <cmath>
#include <type_traits>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvcomp/core/policy_fields.h"

namespace kvcomp {
namespace {

template <typename E, size_t N>
absl::StatusOr<E> ParseName(absl::string_view what, absl::string_view name,
                            const std::pair<absl::string_view, E> (&table)[N]) {
  const std::string n = absl::AsciiStrToLower(name);
  std::string allowed;
  for (const auto& [k, v] : table) {
    if (n == k) return v;
    absl::StrAppend(&allowed, allowed.empty() ? "" : ", ", k);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown ", what, " '", name, "' (expected one of: ", allowed, ")"));
}

constexpr std::pair<absl::string_view, Scorer> kScorers[] = {
    {"knorm", Scorer::kKnorm},         {"keydiff", Scorer::kKeyDiff},
    {"manifold", Scorer::kManifold},   {"windowed_manifold", Scorer::kWindowedManifold},
    {"streaming", Scorer::kStreaming}, {"random", Scorer::kRandom},
    {"snapkv", Scorer::kSnapKV},
};
constexpr std::pair<absl::string_view, HeadBudget> kHeadBudgets[] = {
    {"uniform", HeadBudget::kUniform},
    {"adakv", HeadBudget::kAdaKV},
};
constexpr std::pair<absl::string_view, KeyCodec> kKeyCodecs[] = {
    {"raw", KeyCodec::kRaw},
    {"fp16", KeyCodec::kFp16},
    {"int8", KeyCodec::kInt8},
    {"int4", KeyCodec::kInt4},
    {"hq4", KeyCodec::kHq4},
    {"hq3", KeyCodec::kHq3},
    {"pq", KeyCodec::kPq},
};
constexpr std::pair<absl::string_view, ValueCodec> kValueCodecs[] = {
    {"none", ValueCodec::kRaw},
    {"orthogonal", ValueCodec::kOrthogonal},
    {"orthogonal_int8", ValueCodec::kOrthogonalInt8},
    {"orthogonal_int4", ValueCodec::kOrthogonalInt4},
    {"hq4", ValueCodec::kHq4},
    {"hq3", ValueCodec::kHq3},
    {"pq", ValueCodec::kPq},
};

template <typename E, size_t N>
absl::string_view NameOf(E e, const std::pair<absl::string_view, E> (&table)[N]) {
  for (const auto& [k, v] : table) {
    if (v == e) return k;
  }
  return "invalid";
}

absl::Status Bad(absl::string_view msg) {
  return absl::InvalidArgumentError(absl::StrCat("policy: ", msg));
}

template <typename T>
absl::Status CheckRange(absl::string_view name, T value, const PolicyRange& range) {
  if constexpr (std::is_enum_v<T>) {
    if (PolicyEnum<T>::Name(value) != "invalid") return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("unknown ", name, " ", static_cast<int>(value)));
  } else if constexpr (std::is_same_v<T, bool>) {
    return absl::OkStatus();
  } else {
    if (range.Contains(static_cast<double>(value))) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        name, " ", value, range.kind == PolicyRange::kAtLeast ? " must be " : " outside ",
        range.Text()));
  }
}

}  // namespace

absl::string_view ScorerName(Scorer s) { return NameOf(s, kScorers); }
absl::StatusOr<Scorer> ParseScorer(absl::string_view n) { return ParseName("scorer", n, kScorers); }
absl::string_view HeadBudgetName(HeadBudget b) { return NameOf(b, kHeadBudgets); }
absl::StatusOr<HeadBudget> ParseHeadBudget(absl::string_view n) {
  return ParseName("head_budget", n, kHeadBudgets);
}
absl::string_view KeyCodecName(KeyCodec c) { return NameOf(c, kKeyCodecs); }
absl::StatusOr<KeyCodec> ParseKeyCodec(absl::string_view n) {
  return ParseName("key_codec", n, kKeyCodecs);
}
absl::string_view ValueCodecName(ValueCodec c) { return NameOf(c, kValueCodecs); }
absl::StatusOr<ValueCodec> ParseValueCodec(absl::string_view n) {
  if (absl::AsciiStrToLower(n) == "raw") return ValueCodec::kRaw;
  return ParseName("value_codec", n, kValueCodecs);
}

uint32_t DefaultRank(ValueCodec codec, uint32_t head_dim) {
  switch (codec) {
    case ValueCodec::kRaw:
    case ValueCodec::kHq4:
    case ValueCodec::kHq3:
    case ValueCodec::kPq:
      return 0;
    case ValueCodec::kOrthogonal:
    case ValueCodec::kOrthogonalInt8:
      return head_dim / 2;
    case ValueCodec::kOrthogonalInt4:
      return head_dim * 3 / 4;
  }
  return 0;
}

absl::Status CompressionPolicy::Validate() const {
  // Each field against its declared range (policy_fields.def).
#define KVCOMP_POLICY_FIELD(name, type, tlv_tag, thrift_id, default_value, range, unit, doc) \
  if (absl::Status s = CheckRange(#name, name, range); !s.ok()) return Bad(s.message());
#include "kvcomp/core/policy_fields.def"
#undef KVCOMP_POLICY_FIELD
  // Rules beyond one field's range.
  if (snapkv_pool % 2 == 0) {
    return Bad(absl::StrFormat("snapkv_pool %u must be odd (centred pooling)", snapkv_pool));
  }
  if (value_codec == ValueCodec::kRaw && rank != 0) {
    return Bad("rank set but value_codec is none");
  }
  if (HqBits(value_codec) != 0 && rank != 0) {
    return Bad(absl::StrCat("rank set but value_codec ", ValueCodecName(value_codec),
                            " has no rank (the Hadamard codec keeps every dimension)"));
  }
  if (IsPq(value_codec) && rank != 0) {
    return Bad("rank set but value_codec pq has no rank (its calibration fixes the components)");
  }
  if (IsPq(key_codec) && IsProjectionCodec(value_codec)) {
    return Bad(absl::StrCat(
        "key_codec pq with value_codec ", ValueCodecName(value_codec),
        ": a cache names one calibration, the pq calibration or a KVSplice projection (use pq, "
        "hq4, hq3 or none for the values)"));
  }
  if (value_codec == ValueCodec::kOrthogonalInt4 && rank % 2 != 0) {
    return Bad(absl::StrFormat("rank %u must be even for orthogonal_int4", rank));
  }
  return absl::OkStatus();
}

absl::Status CompressionPolicy::ValidateFor(uint32_t head_dim) const {
  if (absl::Status s = Validate(); !s.ok()) return s;
  if (rank > head_dim) {
    return Bad(absl::StrFormat("rank %u exceeds head_dim %u", rank, head_dim));
  }
  const bool pow2 = head_dim != 0 && (head_dim & (head_dim - 1)) == 0;
  if ((HqBits(key_codec) != 0 || HqBits(value_codec) != 0) &&
      (!pow2 || head_dim < 8 || head_dim > 256)) {
    return Bad(absl::StrFormat(
        "the hq codecs need a head_dim that is a power of two in [8, 256], got %u", head_dim));
  }
  return absl::OkStatus();
}

uint32_t CompressionPolicy::EffectiveRank(uint32_t head_dim) const {
  if (!IsProjectionCodec(value_codec)) return 0;
  return rank != 0 ? rank : DefaultRank(value_codec, head_dim);
}

uint64_t CompressionPolicy::KeptPerHead(uint64_t num_tokens) const {
  if (token_budget > 0) return num_tokens < token_budget ? num_tokens : token_budget;
  const double kept = static_cast<double>(num_tokens) * (1.0 - ratio);
  return static_cast<uint64_t>(kept);
}

uint32_t CompressionPolicy::EffectiveRecent(uint64_t kept_per_head) const {
  double share = std::floor(recent_fraction * static_cast<double>(kept_per_head));
  // The fraction's window leaves the sink its room, so that at small budgets the sink and the
  // window together fit the budget and the newest tokens are not the ones cut off.
  const uint64_t room = kept_per_head > n_sink ? kept_per_head - n_sink : 0;
  if (share > static_cast<double>(room)) share = static_cast<double>(room);
  const uint64_t from_fraction =
      share >= 4294967295.0 ? uint64_t{4294967295} : static_cast<uint64_t>(share);
  return static_cast<uint32_t>(from_fraction > n_recent ? from_fraction : n_recent);
}

std::string CompressionPolicy::DebugString() const {
  std::string out = "Policy{";
  for (const PolicyFieldInfo& f : PolicyFields()) {
    absl::StrAppend(&out, out.size() > 7 ? " " : "", f.name, "=", f.text(*this));
  }
  return out + "}";
}

CompressionPolicy AbsentFieldPolicy() {
  CompressionPolicy p;
#define KVCOMP_POLICY_ABSENT(name, value) p.name = value;
#include "kvcomp/core/policy_absent.def"
#undef KVCOMP_POLICY_ABSENT
  return p;
}

bool operator==(const CompressionPolicy& a, const CompressionPolicy& b) {
#define KVCOMP_POLICY_FIELD(name, type, tlv_tag, thrift_id, default_value, range, unit, doc) \
  if (!(a.name == b.name)) return false;
#include "kvcomp/core/policy_fields.def"
#undef KVCOMP_POLICY_FIELD
  return true;
}

}  // namespace kvcomp
