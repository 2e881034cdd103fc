// Named compression policy presets (docs/research.md, "Presets"; the same table as
// kvcomp.preset in Python):
//   lossless  every token, raw keys and values, no moments: the cache as given.
//   codec     every token, the calibrated basis codec with keys at 3 bits and values at 2 bits
//             per element (pq, key_bits 3, value_bits 2; "k3v2", 6.4x), no moments: what an
//             unmodified engine loads at full length once decoded. Compressing with it needs the
//             model's pq calibration at those bits (kvcompd: the Calibrate call with value_codec
//             "pq"; Python: kvcomp.calibrate_pq): without one it fails with FailedPrecondition
//             naming that call, and never falls back to other codecs (other bytes, other loss).
//             Without a calibration, pin hq4 / hq3 (4.27x, nothing to calibrate).
//   balanced  manifold eviction of a third of the tokens with 85% of the kept budget recent,
//             hq4 keys and hq3 values, no moments.
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
