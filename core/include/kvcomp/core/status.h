// Status handling for kvcomp: absl::Status everywhere on host paths, plus the macros Debian's
// Abseil (20220623) lacks, and the mapping between statuses and the 16-bit codes on the wire.
#ifndef KVCOMP_CORE_STATUS_H_
#define KVCOMP_CORE_STATUS_H_

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#define KVCOMP_STATUS_CONCAT_INNER(a, b) a##b
#define KVCOMP_STATUS_CONCAT(a, b) KVCOMP_STATUS_CONCAT_INNER(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define KVCOMP_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status kvcomp_status_ = (expr);          \
    if (!kvcomp_status_.ok()) return kvcomp_status_; \
  } while (0)

// `lhs = value of rexpr` where rexpr is an absl::StatusOr<T>; returns its status when not OK.
// `lhs` may be a declaration: KVCOMP_ASSIGN_OR_RETURN(auto x, Foo());
#define KVCOMP_ASSIGN_OR_RETURN(lhs, rexpr) \
  KVCOMP_ASSIGN_OR_RETURN_IMPL(KVCOMP_STATUS_CONCAT(kvcomp_statusor_, __LINE__), lhs, rexpr)
#define KVCOMP_ASSIGN_OR_RETURN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                 \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

namespace kvcomp {

using Status = absl::Status;
template <typename T>
using StatusOr = absl::StatusOr<T>;

// The status code as carried on the wire (UCX protocol and Thrift): absl's canonical code
// numbers, which are stable, in 16 bits. Unknown numbers read back as kUnknown.
uint16_t StatusCodeToWire(absl::StatusCode code);
absl::StatusCode StatusCodeFromWire(uint16_t wire);

// A status with the same code, the same payloads (error_detail.h) and `context: message`, for
// adding where an error happened.
Status Annotate(const Status& status, absl::string_view context);

// kvcomp's "busy, retry later" status (back-pressure): Unavailable with ErrorDetail::kBusy
// (error_detail.h); IsBusy reads that detail, never the message.
Status BusyError(absl::string_view message);
bool IsBusy(const Status& status);

}  // namespace kvcomp

#endif  // KVCOMP_CORE_STATUS_H_
