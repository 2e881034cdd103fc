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
    if (name == "codec") {
      // The calibrated basis codec, keys 3 bits and values 2 bits per element: a compression
      // needs the model's pq calibration at these bits (FailedPrecondition naming the
      // calibration call without one; never other codecs in its place).
      p.key_codec = KeyCodec::kPq;
      p.value_codec = ValueCodec::kPq;
      p.key_bits = 3;
      p.value_bits = 2;
    }
    if (name == "balanced") {
      p.key_codec = KeyCodec::kHq4;
      p.value_codec = ValueCodec::kHq3;
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
