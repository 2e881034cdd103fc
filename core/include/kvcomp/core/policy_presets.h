// Named compression policy presets (docs/research.md, "Presets"; the same table as
// kvcomp.preset in Python):
//   lossless  every token, raw keys and values, no moments: the cache as given.
//   codec     every token, Hadamard-codec keys at 4 bits and values at 3 bits (hq4 / hq3), no
//             moments: what an unmodified engine can load at full length (no projection needed).
//   balanced  manifold eviction of half the tokens with half the kept budget recent, hq4 keys
//             and hq3 values, no moments.
//   default   a default-constructed CompressionPolicy.
#ifndef KVCOMP_CORE_POLICY_PRESETS_H_
#define KVCOMP_CORE_POLICY_PRESETS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvcomp/core/policy.h"

namespace kvcomp {

// The preset's policy; InvalidArgument naming the presets for any other name.
absl::StatusOr<CompressionPolicy> PolicyPreset(absl::string_view name);
// The preset names, in the order above.
const std::vector<std::string>& PolicyPresetNames();

}  // namespace kvcomp

#endif  // KVCOMP_CORE_POLICY_PRESETS_H_
