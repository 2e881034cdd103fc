#include "kvcomp/core/policy.h"

#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

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
};
constexpr std::pair<absl::string_view, ValueCodec> kValueCodecs[] = {
    {"none", ValueCodec::kRaw},
    {"orthogonal", ValueCodec::kOrthogonal},
    {"orthogonal_int8", ValueCodec::kOrthogonalInt8},
    {"orthogonal_int4", ValueCodec::kOrthogonalInt4},
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
  if (static_cast<uint8_t>(scorer) > static_cast<uint8_t>(Scorer::kSnapKV)) {
    return Bad("unknown scorer");
  }
  if (!(ratio >= 0.0 && ratio < 1.0)) {  // also rejects NaN
    return Bad(absl::StrFormat("ratio %g outside [0, 1)", ratio));
  }
  if (static_cast<uint8_t>(head_budget) > static_cast<uint8_t>(HeadBudget::kAdaKV)) {
    return Bad("unknown head_budget");
  }
  if (!(alpha_safeguard >= 0.0 && alpha_safeguard <= 1.0)) {
    return Bad(absl::StrFormat("alpha_safeguard %g outside [0, 1]", alpha_safeguard));
  }
  if (!(recent_fraction >= 0.0 && recent_fraction < 1.0)) {
    return Bad(absl::StrFormat("recent_fraction %g outside [0, 1)", recent_fraction));
  }
  if (window == 0) return Bad("window must be at least 1 token");
  if (snapkv_window == 0) return Bad("snapkv_window must be at least 1 query");
  if (snapkv_pool == 0 || snapkv_pool % 2 == 0) {
    return Bad(absl::StrFormat("snapkv_pool %u must be odd (centred pooling)", snapkv_pool));
  }
  if (static_cast<uint8_t>(key_codec) > static_cast<uint8_t>(KeyCodec::kInt8)) {
    return Bad("unknown key_codec");
  }
  if (static_cast<uint8_t>(value_codec) > static_cast<uint8_t>(ValueCodec::kOrthogonalInt4)) {
    return Bad("unknown value_codec");
  }
  if (group_size == 0 || group_size > 256) {
    return Bad(absl::StrFormat("group_size %u outside [1, 256]", group_size));
  }
  if (!(value_outlier_factor >= 1.0 && value_outlier_factor <= 1e9)) {
    return Bad(absl::StrFormat("value_outlier_factor %g outside [1, 1e9]", value_outlier_factor));
  }
  if (!(value_raw_fraction >= 0.0 && value_raw_fraction <= 1.0)) {
    return Bad(absl::StrFormat("value_raw_fraction %g outside [0, 1]", value_raw_fraction));
  }
  if (value_codec == ValueCodec::kRaw && rank != 0) {
    return Bad("rank set but value_codec is none");
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
  return absl::OkStatus();
}

uint32_t CompressionPolicy::EffectiveRank(uint32_t head_dim) const {
  if (value_codec == ValueCodec::kRaw) return 0;
  return rank != 0 ? rank : DefaultRank(value_codec, head_dim);
}

uint64_t CompressionPolicy::KeptPerHead(uint64_t num_tokens) const {
  if (token_budget > 0) return num_tokens < token_budget ? num_tokens : token_budget;
  const double kept = static_cast<double>(num_tokens) * (1.0 - ratio);
  return static_cast<uint64_t>(kept);
}

uint32_t CompressionPolicy::EffectiveRecent(uint64_t kept_per_head) const {
  const double share = std::floor(recent_fraction * static_cast<double>(kept_per_head));
  const uint64_t from_fraction =
      share >= 4294967295.0 ? uint64_t{4294967295} : static_cast<uint64_t>(share);
  return static_cast<uint32_t>(from_fraction > n_recent ? from_fraction : n_recent);
}

std::string CompressionPolicy::DebugString() const {
  return absl::StrFormat(
      "Policy{scorer=%s ratio=%g token_budget=%u head_budget=%s alpha=%g n_sink=%u n_recent=%u "
      "recent_fraction=%g protect=%d window=%u snapkv=%u/%u seed=%u block=%u moments=%d "
      "moment_aware=%d "
      "key_codec=%s value_codec=%s rank=%u group=%u gamma=%d outlier_factor=%g "
      "raw_fraction=%g}",
      ScorerName(scorer), ratio, token_budget, HeadBudgetName(head_budget), alpha_safeguard, n_sink,
      n_recent, recent_fraction, protect, window, snapkv_window, snapkv_pool, seed, block_size,
      moments, moment_aware, KeyCodecName(key_codec), ValueCodecName(value_codec), rank, group_size,
      gamma_aware, value_outlier_factor, value_raw_fraction);
}

bool operator==(const CompressionPolicy& a, const CompressionPolicy& b) {
  return a.scorer == b.scorer && a.ratio == b.ratio && a.token_budget == b.token_budget &&
         a.head_budget == b.head_budget && a.alpha_safeguard == b.alpha_safeguard &&
         a.n_sink == b.n_sink && a.n_recent == b.n_recent &&
         a.recent_fraction == b.recent_fraction && a.protect == b.protect && a.window == b.window &&
         a.snapkv_window == b.snapkv_window && a.snapkv_pool == b.snapkv_pool && a.seed == b.seed &&
         a.block_size == b.block_size && a.moments == b.moments &&
         a.moment_aware == b.moment_aware && a.key_codec == b.key_codec &&
         a.value_codec == b.value_codec && a.rank == b.rank && a.group_size == b.group_size &&
         a.gamma_aware == b.gamma_aware && a.value_outlier_factor == b.value_outlier_factor &&
         a.value_raw_fraction == b.value_raw_fraction;
}

}  // namespace kvcomp
