#include "kvcomp/core/policy_presets.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvcomp {

absl::StatusOr<CompressionPolicy> PolicyPreset(absl::string_view name) {
  CompressionPolicy p;
  if (name == "default") return p;
  if (name == "lossless" || name == "codec" || name == "balanced") {
    p.moments = false;
    p.ratio = 0.0;
    if (name != "lossless") {
      p.key_codec = KeyCodec::kHq4;
      p.value_codec = ValueCodec::kHq3;
    }
    if (name == "balanced") {
      p.scorer = Scorer::kManifold;
      p.ratio = 0.33;
      p.recent_fraction = 0.85;
    }
    return p;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown policy preset '", name, "'; one of: ", absl::StrJoin(PolicyPresetNames(), ", ")));
}

const std::vector<std::string>& PolicyPresetNames() {
  static const auto* names =
      new std::vector<std::string>{"lossless", "codec", "balanced", "default"};
  return *names;
}

}  // namespace kvcomp
