#include "kvcomp/core/cache_key.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvcomp {
namespace {

constexpr absl::string_view kDefaultTenant = "default";

bool IsTenantChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         c == '_' || c == '.' || c == '-';
}

void AppendField(std::string* out, absl::string_view field) {
  out->push_back(static_cast<char>((field.size() >> 8) & 0xff));
  out->push_back(static_cast<char>(field.size() & 0xff));
  out->append(field.data(), field.size());
}

bool ReadField(absl::string_view* in, std::string* field) {
  if (in->size() < 2) return false;
  const size_t n = (static_cast<uint8_t>((*in)[0]) << 8) | static_cast<uint8_t>((*in)[1]);
  in->remove_prefix(2);
  if (in->size() < n) return false;
  field->assign(in->data(), n);
  in->remove_prefix(n);
  return true;
}

absl::string_view NormalTenant(absl::string_view t) { return t.empty() ? kDefaultTenant : t; }

}  // namespace

absl::Status CacheKey::Validate() const {
  const absl::string_view t = NormalTenant(tenant);
  if (t.size() > kMaxTenantBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cache key: tenant is %u bytes, at most %u allowed", t.size(), kMaxTenantBytes));
  }
  for (char c : t) {
    if (!IsTenantChar(c)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "cache key: tenant '%s' has a byte outside [A-Za-z0-9_.-]", absl::CHexEscape(t)));
    }
  }
  if (model_id.empty() || model_id.size() > kMaxModelBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cache key: model id is %u bytes, must be 1..%u", model_id.size(), kMaxModelBytes));
  }
  for (char c : model_id) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError("cache key: model id must be printable ASCII without spaces");
    }
  }
  if (key.empty() || key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cache key: key is %u bytes, must be 1..%u", key.size(), kMaxKeyBytes));
  }
  return absl::OkStatus();
}

std::string CacheKey::TenantPrefix(absl::string_view tenant) {
  std::string out;
  AppendField(&out, NormalTenant(tenant));
  return out;
}

std::string CacheKey::Encode() const {
  std::string out = TenantPrefix(tenant);
  AppendField(&out, model_id);
  AppendField(&out, key);
  return out;
}

absl::StatusOr<CacheKey> CacheKey::Decode(absl::string_view encoded) {
  CacheKey k;
  if (!ReadField(&encoded, &k.tenant) || !ReadField(&encoded, &k.model_id) ||
      !ReadField(&encoded, &k.key) || !encoded.empty()) {
    return absl::DataLossError("cache key: malformed encoded key");
  }
  if (absl::Status s = k.Validate(); !s.ok()) return s;
  return k;
}

std::string CacheKey::DebugString() const {
  const absl::string_view shown = absl::string_view(key).substr(0, 16);
  return absl::StrCat(NormalTenant(tenant), "/", model_id, "/", absl::BytesToHexString(shown),
                      key.size() > 16 ? "..." : "");
}

}  // namespace kvcomp
