#include "kvcomp/core/policy_fields.h"

#include <charconv>
#include <cmath>
#include <limits>
#include <type_traits>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace {

// Shortest text that reads back to the same double ("0.2", "4", "1e+09").
std::string ShortestDouble(double d) {
  char buf[32];
  auto r = std::to_chars(buf, buf + sizeof(buf), d);
  return std::string(buf, r.ptr);
}

absl::Status NotA(absl::string_view name, absl::string_view text, absl::string_view want) {
  return absl::InvalidArgumentError(absl::StrCat(name, ": '", text, "' is not ", want));
}

// How each declared type is stored, sent and spelled.
template <typename T, typename = void>
struct Traits;

template <>
struct Traits<bool> {
  static constexpr uint16_t kTlvBytes = 1;
  static constexpr absl::string_view kThrift = "bool";
  static std::string Text(bool v) { return v ? "true" : "false"; }
  static absl::StatusOr<bool> Parse(absl::string_view name, absl::string_view text) {
    const std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
    if (s == "true" || s == "1" || s == "yes" || s == "on") return true;
    if (s == "false" || s == "0" || s == "no" || s == "off") return false;
    return NotA(name, text, "a boolean (true/false)");
  }
};

template <typename T>
struct Traits<T, std::enable_if_t<std::is_same_v<T, uint32_t> || std::is_same_v<T, uint64_t>>> {
  static constexpr uint16_t kTlvBytes = sizeof(T);
  static constexpr absl::string_view kThrift = "i64";
  static std::string Text(T v) { return absl::StrCat(v); }
  static absl::StatusOr<T> Parse(absl::string_view name, absl::string_view text) {
    uint64_t x = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &x) ||
        x > std::numeric_limits<T>::max()) {
      return NotA(name, text,
                  absl::StrCat("an integer in [0, ", std::numeric_limits<T>::max(), "]"));
    }
    return static_cast<T>(x);
  }
};

template <>
struct Traits<double> {
  static constexpr uint16_t kTlvBytes = 8;
  static constexpr absl::string_view kThrift = "double";
  static std::string Text(double v) { return ShortestDouble(v); }
  static absl::StatusOr<double> Parse(absl::string_view name, absl::string_view text) {
    double x = 0;
    if (!absl::SimpleAtod(absl::StripAsciiWhitespace(text), &x) || !std::isfinite(x)) {
      return NotA(name, text, "a number");
    }
    return x;
  }
};

template <typename E>
struct Traits<E, std::enable_if_t<std::is_enum_v<E>>> {
  static constexpr uint16_t kTlvBytes = 1;
  static constexpr absl::string_view kThrift = "string";
  static std::string Text(E v) { return std::string(PolicyEnum<E>::Name(v)); }
  static absl::StatusOr<E> Parse(absl::string_view name, absl::string_view text) {
    auto v = PolicyEnum<E>::Parse(absl::StripAsciiWhitespace(text));
    if (!v.ok()) return Annotate(v.status(), name);
    return *v;
  }
  static std::vector<std::string> Names() {
    std::vector<std::string> names;
    for (int i = 0; i <= std::numeric_limits<std::underlying_type_t<E>>::max(); ++i) {
      absl::string_view n = PolicyEnum<E>::Name(static_cast<E>(i));
      if (n != "invalid") names.emplace_back(n);
    }
    return names;
  }
};

template <typename T>
std::vector<std::string> NamesOf() {
  if constexpr (std::is_enum_v<T>) {
    return Traits<T>::Names();
  } else {
    return {};
  }
}

template <typename T>
absl::Status SetField(absl::string_view name, const PolicyRange& range, absl::string_view text,
                      T* field) {
  KVCOMP_ASSIGN_OR_RETURN(T v, Traits<T>::Parse(name, text));
  if constexpr (!std::is_enum_v<T> && !std::is_same_v<T, bool>) {
    if (!range.Contains(static_cast<double>(v))) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " ", Traits<T>::Text(v),
          range.kind == PolicyRange::kAtLeast ? " must be " : " outside ", range.Text()));
    }
  }
  *field = v;
  return absl::OkStatus();
}

std::vector<PolicyFieldInfo> BuildFields() {
  std::vector<PolicyFieldInfo> fields;
  const CompressionPolicy defaults;
  const CompressionPolicy absent = AbsentFieldPolicy();
#define KVCOMP_POLICY_FIELD(name, type, tlv_tag, thrift_id, default_value, range, unit, doc) \
  fields.push_back(PolicyFieldInfo{                                                          \
      #name,                                                                                 \
      #type,                                                                                 \
      tlv_tag,                                                                               \
      Traits<type>::kTlvBytes,                                                               \
      thrift_id,                                                                             \
      Traits<type>::kThrift,                                                                 \
      unit,                                                                                  \
      doc,                                                                                   \
      range,                                                                                 \
      NamesOf<type>(),                                                                       \
      Traits<type>::Text(defaults.name),                                                     \
      Traits<type>::Text(absent.name),                                                       \
      [](const CompressionPolicy& p) { return Traits<type>::Text(p.name); },                 \
      [](CompressionPolicy& p, absl::string_view text) {                                     \
        return SetField<type>(#name, range, text, &p.name);                                  \
      }});
#include "kvcomp/core/policy_fields.def"
#undef KVCOMP_POLICY_FIELD
  return fields;
}

std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out += c;
    }
  }
  return out + "\"";
}

// "1e9" rather than to_chars' "1e+09", for range texts.
std::string BoundText(double d) {
  std::string s = ShortestDouble(d);
  const size_t e = s.find("e+");
  if (e != std::string::npos) {
    size_t digits = e + 2;
    while (digits + 1 < s.size() && s[digits] == '0') ++digits;
    s = s.substr(0, e + 1) + s.substr(digits);
  }
  return s;
}

absl::string_view RangeKindName(PolicyRange::Kind k) {
  switch (k) {
    case PolicyRange::kAny:
      return "any";
    case PolicyRange::kNamed:
      return "named";
    case PolicyRange::kAtLeast:
      return "at_least";
    case PolicyRange::kClosed:
      return "closed";
    case PolicyRange::kBelow:
      return "below";
  }
  return "any";
}

}  // namespace

bool PolicyRange::Contains(double v) const {
  switch (kind) {
    case kAny:
    case kNamed:
      return true;
    case kAtLeast:
      return v >= lo;
    case kClosed:
      return v >= lo && v <= hi;
    case kBelow:
      return v >= lo && v < hi;
  }
  return false;
}

std::string PolicyRange::Text() const {
  switch (kind) {
    case kAny:
    case kNamed:
      return "";
    case kAtLeast:
      return absl::StrCat("at least ", BoundText(lo));
    case kClosed:
      return absl::StrCat("[", BoundText(lo), ", ", BoundText(hi), "]");
    case kBelow:
      return absl::StrCat("[", BoundText(lo), ", ", BoundText(hi), ")");
  }
  return "";
}

std::string PolicyFieldInfo::Help() const {
  std::string help(doc);
  if (range.kind == PolicyRange::kAtLeast) {
    absl::StrAppend(&help, " At least ", BoundText(range.lo), ".");
  } else if (range.kind == PolicyRange::kClosed || range.kind == PolicyRange::kBelow) {
    absl::StrAppend(&help, " In ", range.Text(), ".");
  }
  absl::StrAppend(&help, " Default ", default_text, ".");
  if (absent_text != default_text) {
    absl::StrAppend(&help, " Absent from a stored cache or a request: ", absent_text, ".");
  }
  if (!names.empty()) absl::StrAppend(&help, " One of: ", absl::StrJoin(names, ", "), ".");
  return help;
}

const std::vector<PolicyFieldInfo>& PolicyFields() {
  static const auto* fields = new std::vector<PolicyFieldInfo>(BuildFields());
  return *fields;
}

const PolicyFieldInfo* FindPolicyField(absl::string_view name) {
  for (const PolicyFieldInfo& f : PolicyFields()) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

std::string PolicyFieldsJson() {
  std::string out = "[\n";
  bool first = true;
  for (const PolicyFieldInfo& f : PolicyFields()) {
    std::string default_json = f.default_text;
    std::string absent_json = f.absent_text;
    if (!f.names.empty()) {
      default_json = JsonString(f.default_text);
      absent_json = JsonString(f.absent_text);
    }
    std::vector<std::string> names;
    for (const auto& n : f.names) names.push_back(JsonString(n));
    absl::StrAppend(
        &out, first ? "" : ",\n", "  {\"name\": ", JsonString(f.name),
        ", \"type\": ", JsonString(f.type), ", \"tlv_tag\": ", f.tlv_tag,
        ", \"tlv_bytes\": ", f.tlv_bytes, ", \"thrift_id\": ", f.thrift_id,
        ", \"thrift_type\": ", JsonString(f.thrift_type), ", \"unit\": ", JsonString(f.unit),
        ", \"range\": {\"kind\": ", JsonString(RangeKindName(f.range.kind)),
        ", \"lo\": ", ShortestDouble(f.range.lo), ", \"hi\": ", ShortestDouble(f.range.hi),
        ", \"text\": ", JsonString(f.range.Text()), "}, \"names\": [", absl::StrJoin(names, ", "),
        "], \"default\": ", default_json, ", \"default_text\": ", JsonString(f.default_text),
        ", \"absent\": ", absent_json, ", \"absent_text\": ", JsonString(f.absent_text),
        ", \"doc\": ", JsonString(f.doc), ", \"help\": ", JsonString(f.Help()), "}");
    first = false;
  }
  return out + "\n]\n";
}

}  // namespace kvcomp
