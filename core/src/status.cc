#include "kvcomp/core/status.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvcomp {
namespace {
constexpr absl::string_view kBusyMarker = "[busy] ";
}  // namespace

uint16_t StatusCodeToWire(absl::StatusCode code) { return static_cast<uint16_t>(code); }

absl::StatusCode StatusCodeFromWire(uint16_t wire) {
  if (wire > static_cast<uint16_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::StatusCode::kUnknown;
  }
  return static_cast<absl::StatusCode>(wire);
}

Status Annotate(const Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

Status BusyError(absl::string_view message) {
  return absl::UnavailableError(absl::StrCat(kBusyMarker, message));
}

bool IsBusy(const Status& status) {
  return status.code() == absl::StatusCode::kUnavailable &&
         absl::StartsWith(status.message(), kBusyMarker);
}

}  // namespace kvcomp
