#include "policy_rpc.h"

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/policy_fields.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace service {
namespace {

// CompressionPolicy's type -> the Thrift field's.
template <typename T>
auto ToWire(T v) {
  if constexpr (std::is_enum_v<T>) {
    return std::string(PolicyEnum<T>::Name(v));
  } else if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    return static_cast<int64_t>(v);  // a uint64 keeps its bit pattern (see FromWire)
  } else {
    return v;
  }
}

// The Thrift field's type -> CompressionPolicy's; ranges are Validate's, afterwards.
template <typename T, typename W>
absl::Status FromWire(const char* name, const W& w, T* out) {
  if constexpr (std::is_enum_v<T>) {
    auto v = PolicyEnum<T>::Parse(w);
    if (!v.ok()) return Annotate(v.status(), absl::StrCat("policy: ", name));
    *out = *v;
  } else if constexpr (std::is_same_v<T, uint64_t>) {
    // Thrift has no unsigned type: a uint64 field travels as its bit pattern in an i64, so
    // values from 2^63 up read as negative there and come back whole here.
    *out = static_cast<uint64_t>(w);
  } else if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    if (w < 0 || static_cast<uint64_t>(w) > std::numeric_limits<T>::max()) {
      return absl::InvalidArgumentError(absl::StrCat("policy: ", name, " ", w, " outside [0, ",
                                                     std::numeric_limits<T>::max(), "]"));
    }
    *out = static_cast<T>(w);
  } else {
    *out = w;
  }
  return absl::OkStatus();
}

}  // namespace

rpc::Policy PolicyToRpc(const CompressionPolicy& p) {
  rpc::Policy r;
#define KVCOMP_POLICY_FIELD(name, type, tlv_tag, thrift_id, default_value, range, unit, doc) \
  r.name = ToWire<type>(p.name);
#include "kvcomp/core/policy_fields.def"
#undef KVCOMP_POLICY_FIELD
  return r;
}

absl::StatusOr<CompressionPolicy> PolicyFromRpc(const rpc::Policy& r) {
  CompressionPolicy p;
#define KVCOMP_POLICY_FIELD(name, type, tlv_tag, thrift_id, default_value, range, unit, doc) \
  KVCOMP_RETURN_IF_ERROR(FromWire<type>(#name, r.name, &p.name));
#include "kvcomp/core/policy_fields.def"
#undef KVCOMP_POLICY_FIELD
  KVCOMP_RETURN_IF_ERROR(p.Validate());
  return p;
}

rpc::Status StatusToRpc(const absl::Status& status) {
  rpc::Status out;
  out.code = static_cast<rpc::StatusCode::type>(StatusCodeToWire(status.code()));
  out.message = std::string(status.message());
  if (const ErrorDetail detail = DetailOf(status); detail != ErrorDetail::kNone) {
    out.__set_detail(static_cast<int16_t>(ErrorDetailToWire(detail)));
  }
  return out;
}

absl::Status StatusFromRpc(const rpc::Status& status) {
  const int code = static_cast<int>(status.code);
  const absl::StatusCode c = code < 0 || code > UINT16_MAX
                                 ? absl::StatusCode::kUnknown
                                 : StatusCodeFromWire(static_cast<uint16_t>(code));
  if (c == absl::StatusCode::kOk) return absl::OkStatus();
  absl::Status out(c, status.message);
  if (status.__isset.detail && status.detail > 0) {
    out = WithDetail(std::move(out), ErrorDetailFromWire(static_cast<uint16_t>(status.detail)));
  }
  return out;
}

}  // namespace service
}  // namespace kvcomp
