#include "kvcomp/core/status.h"

#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kvcomp/core/error_detail.h"

namespace kvcomp {

uint16_t StatusCodeToWire(absl::StatusCode code) { return static_cast<uint16_t>(code); }

absl::StatusCode StatusCodeFromWire(uint16_t wire) {
  if (wire > static_cast<uint16_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::StatusCode::kUnknown;
  }
  return static_cast<absl::StatusCode>(wire);
}

Status Annotate(const Status& status, absl::string_view context) {
  if (status.ok()) return status;
  Status out(status.code(), absl::StrCat(context, ": ", status.message()));
  status.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

Status WithDetail(Status status, ErrorDetail detail) {
  if (status.ok()) return status;
  if (detail == ErrorDetail::kNone) {
    status.ErasePayload(kErrorDetailUrl);
  } else {
    status.SetPayload(kErrorDetailUrl, absl::Cord(absl::StrCat(ErrorDetailToWire(detail))));
  }
  return status;
}

ErrorDetail DetailOf(const Status& status) {
  const auto payload = status.GetPayload(kErrorDetailUrl);
  if (!payload.has_value()) return ErrorDetail::kNone;
  uint32_t wire = 0;
  if (!absl::SimpleAtoi(std::string(*payload), &wire) || wire > UINT16_MAX) {
    return ErrorDetail::kNone;
  }
  return ErrorDetailFromWire(static_cast<uint16_t>(wire));
}

uint16_t ErrorDetailToWire(ErrorDetail detail) { return static_cast<uint16_t>(detail); }

ErrorDetail ErrorDetailFromWire(uint16_t wire) {
  if (wire > static_cast<uint16_t>(ErrorDetail::kDiskFull)) return ErrorDetail::kNone;
  return static_cast<ErrorDetail>(wire);
}

Status BusyError(absl::string_view message) {
  return WithDetail(absl::UnavailableError(message), ErrorDetail::kBusy);
}

bool IsBusy(const Status& status) {
  return status.code() == absl::StatusCode::kUnavailable && DetailOf(status) == ErrorDetail::kBusy;
}

}  // namespace kvcomp
