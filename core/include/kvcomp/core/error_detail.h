// Typed error details: what code that decides (retry, reopen a link, fall back to another, give
// up) needs to know about an error beyond its canonical code, carried as an absl::Status payload
// (kErrorDetailUrl) so that no decision reads message text. On the control plane a detail
// travels as Status.detail (service/thrift/kvcomp.thrift); on the data plane busy is its own
// message type (docs/protocol.md). kvcomp::BusyError (status.h) is Unavailable with kBusy.
// Annotate (status.h) keeps details. Thread-safe: plain functions of their arguments.
#ifndef KVCOMP_CORE_ERROR_DETAIL_H_
#define KVCOMP_CORE_ERROR_DETAIL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvcomp {

// The numbers are stable (they travel); unknown numbers read back as kNone.
enum class ErrorDetail : uint16_t {
  kNone = 0,
  // Back-pressure: the request was refused whole and may be sent again later (Unavailable).
  kBusy = 1,
  // The payload link (GPU channel, communicator, connection) the request named is gone or
  // broken: open a new one, then retry (NotFound or Unavailable).
  kLinkGone = 2,
  // The peer cannot map the memory the request offered (a CUDA IPC handle or event from another
  // device or process namespace): move the bytes over another link (FailedPrecondition).
  kMemoryNotMappable = 3,
  // The caller's own deadline for the whole call passed (DeadlineExceeded): every endpoint and
  // retry it allowed is spent, so nothing else is tried (a per-request timeout is not this).
  kCallDeadline = 4,
  // A tier's disk has no room for the write (ResourceExhausted): writes resume by themselves
  // once space returns; a full tier or a tenant's quota is ResourceExhausted without it.
  kDiskFull = 5,
};
inline constexpr absl::string_view kErrorDetailUrl = "type.kvcomp.dev/kvcomp.ErrorDetail";

// `status` with `detail` attached (replacing any earlier one); OK stays OK, kNone removes it.
absl::Status WithDetail(absl::Status status, ErrorDetail detail);
// The detail attached to `status`; kNone when there is none or it is not one this build knows.
ErrorDetail DetailOf(const absl::Status& status);
uint16_t ErrorDetailToWire(ErrorDetail detail);
ErrorDetail ErrorDetailFromWire(uint16_t wire);

}  // namespace kvcomp

#endif  // KVCOMP_CORE_ERROR_DETAIL_H_
