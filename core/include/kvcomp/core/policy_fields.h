// Reflection over CompressionPolicy's fields, built from their one declaration
// (kvcomp/core/policy_fields.def): for each field its tags, range, documentation and text form.
// kvcompd's configuration rows, the per-tenant policies file and the consistency checks of the
// IDL, SDK, docs and Helm chart are built from this table; code that maps the struct to typed
// values (TLV records, Thrift) includes the .def directly. Everything here is immutable after
// first use and thread-safe.
#ifndef KVCOMP_CORE_POLICY_FIELDS_H_
#define KVCOMP_CORE_POLICY_FIELDS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvcomp/core/policy.h"

namespace kvcomp {

// The values a field accepts (the `range` column of policy_fields.def).
struct PolicyRange {
  enum Kind : uint8_t {
    kAny,      // every value of the type
    kNamed,    // an enum: one of its named values
    kAtLeast,  // [lo, type's max]
    kClosed,   // [lo, hi]
    kBelow,    // [lo, hi)
  };
  Kind kind = kAny;
  double lo = 0;
  double hi = 0;

  bool Contains(double v) const;  // false for NaN unless kAny
  // "[0, 1)", "[1, 256]", "at least 1"; empty for kAny and kNamed.
  std::string Text() const;
};

#define KVCOMP_POLICY_ANY (::kvcomp::PolicyRange{::kvcomp::PolicyRange::kAny, 0, 0})
#define KVCOMP_POLICY_NAMED (::kvcomp::PolicyRange{::kvcomp::PolicyRange::kNamed, 0, 0})
#define KVCOMP_POLICY_AT_LEAST(lo) (::kvcomp::PolicyRange{::kvcomp::PolicyRange::kAtLeast, lo, 0})
#define KVCOMP_POLICY_IN(lo, hi) (::kvcomp::PolicyRange{::kvcomp::PolicyRange::kClosed, lo, hi})
#define KVCOMP_POLICY_IN_BELOW(lo, hi) \
  (::kvcomp::PolicyRange{::kvcomp::PolicyRange::kBelow, lo, hi})

// The policy enums by type, for code generated from the declaration: their names (what the
// configuration, Thrift and Python use) and numbers (what the TLV records store).
template <typename E>
struct PolicyEnum;
template <>
struct PolicyEnum<Scorer> {
  static absl::string_view Name(Scorer v) { return ScorerName(v); }
  static absl::StatusOr<Scorer> Parse(absl::string_view n) { return ParseScorer(n); }
};
template <>
struct PolicyEnum<HeadBudget> {
  static absl::string_view Name(HeadBudget v) { return HeadBudgetName(v); }
  static absl::StatusOr<HeadBudget> Parse(absl::string_view n) { return ParseHeadBudget(n); }
};
template <>
struct PolicyEnum<KeyCodec> {
  static absl::string_view Name(KeyCodec v) { return KeyCodecName(v); }
  static absl::StatusOr<KeyCodec> Parse(absl::string_view n) { return ParseKeyCodec(n); }
};
template <>
struct PolicyEnum<ValueCodec> {
  static absl::string_view Name(ValueCodec v) { return ValueCodecName(v); }
  static absl::StatusOr<ValueCodec> Parse(absl::string_view n) { return ParseValueCodec(n); }
};

struct PolicyFieldInfo {
  absl::string_view name;  // member, YAML key (default_policy.<name>), Thrift field
  absl::string_view type;  // as declared: "bool", "uint32_t", "uint64_t", "double", "Scorer", ...
  uint16_t tlv_tag;
  uint16_t tlv_bytes;        // length of the record's value: 1 (bool, enums), 4, 8
  int16_t thrift_id;
  absl::string_view thrift_type;  // "bool", "i64", "double", "string" (enums by name)
  absl::string_view unit;         // docs type column: enum, bool, uint, fraction, factor
  absl::string_view doc;          // the declaration's line
  PolicyRange range;
  std::vector<std::string> names;  // enums: every name, in number order; empty otherwise
  std::string default_text;        // Text() of a default-constructed policy
  std::string absent_text;         // Text() of AbsentFieldPolicy(): what an absent record means

  // The field of `p` as text: enums by name, booleans true/false, numbers in their shortest
  // form that reads back to the same value.
  std::string (*text)(const CompressionPolicy& p);
  // Parses `text` into the field of `p` and checks it against the range; InvalidArgument naming
  // the field otherwise (`p` unchanged then).
  absl::Status (*set)(CompressionPolicy& p, absl::string_view text);

  // doc + range + default (+ enum names): the line of --help and docs/configuration.md.
  std::string Help() const;
};

// Every field, in declaration order.
const std::vector<PolicyFieldInfo>& PolicyFields();
// nullptr for an unknown name.
const PolicyFieldInfo* FindPolicyField(absl::string_view name);

// The declaration as JSON (an array of objects, one per field, keys as PolicyFieldInfo's), for
// the checks that compare the IDL, SDK, docs and chart with it.
std::string PolicyFieldsJson();

}  // namespace kvcomp

#endif  // KVCOMP_CORE_POLICY_FIELDS_H_
