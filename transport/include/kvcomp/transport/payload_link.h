// Payload links: the ways a put's or get's payload (K and V, or a cache's bytes) moves between
// a client and kvcompd, and the choice among them. Four links exist:
//
//   link       memory it reads and writes in place   reaches                code
//   ipc        CUDA                                  the same GPU           gpu_link.h (CUDA IPC)
//   nccl       CUDA                                  another GPU            gpu_link.h (NcclLink)
//   ucx-cuda   CUDA and host                         any peer               client.h (device payloads)
//   ucx        host                                  any peer               client.h, server.h
//
// Each end offers the links it has now (a library loaded, a device present, UCX transports for
// CUDA memory); a transfer takes the first link, in the order above, that both ends offer and
// that serves its memory and locality (ChooseLinks). A link that fails says, by the typed detail
// of its status (kvcomp::ErrorDetail), whether the next link should be tried, the same link
// reopened, or the caller answered (AfterLinkFailure): never by its message. Device memory
// always has a last resort through host memory (staged on the caller's stream), so ucx is
// chosen for CUDA memory too, after the links that move it in place.
//
// What each link moves and how the two ends agree on it: docs/architecture.md ("Payload links")
// and docs/protocol.md. Everything here is plain data and pure functions: thread-safe.
#ifndef KVCOMP_TRANSPORT_PAYLOAD_LINK_H_
#define KVCOMP_TRANSPORT_PAYLOAD_LINK_H_

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvcomp {
namespace transport {

// Where a payload lies at the end that holds it.
enum class MemoryKind : uint8_t { kHost = 0, kCuda = 1 };

// Where the peer's memory lies from this end's: on the same GPU (CUDA IPC), on another GPU or
// host, or not yet known (before the two ends compared their devices).
enum class Locality : uint8_t { kSameDevice = 0, kOtherDevice = 1, kUnknown = 2 };

// In preference order: the first link both ends offer that serves a transfer carries it.
enum class LinkKind : uint8_t { kCudaIpc = 0, kNccl = 1, kUcxCuda = 2, kUcxHost = 3 };
inline constexpr int kLinkKinds = 4;

// "ipc", "nccl", "ucx-cuda", "ucx": the names results carry (PutResult::path and friends).
absl::string_view LinkName(LinkKind kind);

// What a link can do, fixed per kind.
struct LinkCaps {
  bool host_memory = false;  // reads and writes host memory in place
  bool cuda_memory = false;  // reads and writes CUDA device memory in place
  bool same_device = false;  // reaches a peer on the same GPU
  bool other_device = false;  // reaches a peer on another GPU or host
  bool staged = false;       // serves CUDA memory through a host copy on the caller's stream
};
LinkCaps CapsOf(LinkKind kind);

// The links one end has available now.
class LinkOffer {
 public:
  LinkOffer() = default;
  LinkOffer(std::initializer_list<LinkKind> kinds);
  // Every link (an end that has not said, or says it would take any).
  static LinkOffer All();

  void Add(LinkKind kind) { bits_ |= Bit(kind); }
  void Remove(LinkKind kind) { bits_ &= ~Bit(kind); }
  bool Has(LinkKind kind) const { return (bits_ & Bit(kind)) != 0; }
  bool empty() const { return bits_ == 0; }

 private:
  static uint8_t Bit(LinkKind kind) { return static_cast<uint8_t>(1u << static_cast<int>(kind)); }
  uint8_t bits_ = 0;
};

// What one transfer needs moved: the memory kind at this end and where the peer is.
struct TransferNeed {
  MemoryKind memory = MemoryKind::kHost;
  Locality locality = Locality::kUnknown;
};

// The links that can carry `need`, best first: offered by both ends and serving its memory
// (in place, or staged for ucx) and its locality (a kUnknown locality keeps links of either).
// Empty when none can.
std::vector<LinkKind> ChooseLinks(const LinkOffer& local, const LinkOffer& remote,
                                  const TransferNeed& need);

// What a failed call on a link means for the transfer, from the status's code and typed detail:
//   kReopen    the link is gone (ErrorDetail::kLinkGone, or Unavailable that is not busy: a
//              connection dropped, a peer draining): drop it, open another, try again;
//   kNextLink  the link cannot serve this transfer (ErrorDetail::kMemoryNotMappable): drop it
//              and move the bytes over the next link chosen;
//   kAnswer    the peer answered the request itself (busy, not found, refused, invalid): the
//              caller gets the status.
enum class LinkVerdict { kReopen, kNextLink, kAnswer };
LinkVerdict AfterLinkFailure(const absl::Status& failure);

}  // namespace transport
}  // namespace kvcomp

#endif  // KVCOMP_TRANSPORT_PAYLOAD_LINK_H_
