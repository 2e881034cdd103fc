// A policy with every declared field (kvcomp/core/policy_fields.def) away from its default, built
// from the declaration, so tests that must cover every field cover a new one without an edit.
#ifndef KVCOMP_TESTS_COMMON_POLICY_TEST_UTIL_H_
#define KVCOMP_TESTS_COMMON_POLICY_TEST_UTIL_H_

#include <string>

#include "absl/strings/str_cat.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/core/policy_fields.h"

namespace kvcomp {
namespace testing {

// A valid value of `f` other than its default, as text.
inline std::string NonDefaultText(const PolicyFieldInfo& f) {
  if (!f.names.empty()) {
    for (const std::string& n : f.names) {
      if (n != f.default_text) return n;
    }
  }
  if (f.type == "bool") return f.default_text == "true" ? "false" : "true";
  CompressionPolicy p;
  const bool real = f.type == "double";
  const double d = std::stod(f.default_text);
  const PolicyRange& r = f.range;
  // Integers move by 2 (an odd count stays odd); reals inside their range.
  double v = d + (real ? 0.25 : 2);
  if (r.kind == PolicyRange::kClosed || r.kind == PolicyRange::kBelow) {
    v = r.lo != d ? r.lo : (real ? (r.lo + r.hi) / 2 : r.lo + 2);
    if (real && v == d) v = r.lo + (r.hi - r.lo) / 4;
  }
  return real ? absl::StrCat(v) : absl::StrCat(static_cast<uint64_t>(v));
}

// Every field changed; a value codec is chosen when the rank is set (rank needs one).
inline CompressionPolicy EveryFieldChanged() {
  CompressionPolicy p;
  for (const PolicyFieldInfo& f : PolicyFields()) (void)f.set(p, NonDefaultText(f));
  if (p.rank != 0 && p.value_codec == ValueCodec::kRaw) p.value_codec = ValueCodec::kOrthogonal;
  return p;
}

}  // namespace testing
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_COMMON_POLICY_TEST_UTIL_H_
