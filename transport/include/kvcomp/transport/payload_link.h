// Payload links: the ways a put's or get's payload (K and V, or a cache's bytes) moves between
// a client and kvcompd, one object per link behind one interface (PayloadLink), and the choice
// among them. Five kinds exist:
//
//   link       memory it reads and writes in place   reaches                code
//   ipc        CUDA                                  the same GPU           gpu_link.h (CudaIpcLink)
//   nccl       CUDA                                  another GPU            gpu_link.h (NcclPayloadLink)
//   ucx-cuda   CUDA                                  any peer               ucx_link.h (UcxLink)
//   shm        host (through a shared region)        the same host          shm_link.h (ShmLink)
//   ucx        host; CUDA staged via pinned host     any peer               ucx_link.h (UcxLink)
//
// A link declares the memory kinds and locality it serves (CapsOf), registers memory
// (Register: checks it can reach it in place and says what the peer needs to reach it),
// posts a transfer (Post) and reports its completion (Completion). Each end offers the links it
// has now (a library loaded, a device present, UCX transports for CUDA memory); LinkRouter takes,
// per transfer, the first link in the order above that both ends offer and that serves the
// transfer's memory and locality (ChooseLinks), and passes a link over for the next when it
// refuses the memory. A link that fails says, by the typed detail of its status
// (kvcomp::ErrorDetail), whether the next link should be tried, the same link reopened, or the
// caller answered (AfterLinkFailure): never by its message. Device memory always has a last
// resort through host memory: the ucx link stages it itself (a copy on the transfer's stream,
// then the host send; for a receive the host get, then the copy), so ucx is chosen for CUDA
// memory too, after the links that move it in place (CapsOf(kUcxHost).staged).
//
// What each link moves and how the two ends agree on it: docs/architecture.md ("Payload links")
// and docs/protocol.md. The free functions and plain types are thread-safe; Completion is
// thread-safe; a PayloadLink says its own rules (ucx: thread-safe; nccl: one thread at a time).
#ifndef KVCOMP_TRANSPORT_PAYLOAD_LINK_H_
#define KVCOMP_TRANSPORT_PAYLOAD_LINK_H_

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvcomp/transport/protocol.h"

namespace kvcomp {
namespace transport {

// Where a payload lies at the end that holds it.
enum class MemoryKind : uint8_t { kHost = 0, kCuda = 1 };

// Where the peer's memory lies from this end's: on the same GPU (CUDA IPC), on another GPU or
// host, or not yet known (before the two ends compared their devices).
enum class Locality : uint8_t { kSameDevice = 0, kOtherDevice = 1, kUnknown = 2 };

// In preference order: the first link both ends offer that serves a transfer carries it.
// (Values are not on any wire: only the order matters.)
enum class LinkKind : uint8_t { kCudaIpc = 0, kNccl = 1, kUcxCuda = 2, kShm = 3, kUcxHost = 4 };
inline constexpr int kLinkKinds = 5;

// "ipc", "nccl", "ucx-cuda", "shm", "ucx": the names results carry (PutResult::path and
// friends).
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

// FailedPrecondition with ErrorDetail::kMemoryNotMappable: `link` cannot reach `memory` in place
// (AfterLinkFailure: kNextLink).
absl::Status MemoryNotServed(LinkKind link, MemoryKind memory, absl::string_view why);

// A span of memory at this end that a transfer reads (send) or writes (receive).
struct MemoryRegion {
  void* data = nullptr;
  uint64_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
};

// A region a link accepted, and what the peer needs to reach it (a CUDA IPC memory handle and
// offset); empty for links that carry the bytes themselves (ucx, nccl).
struct Registration {
  MemoryRegion region;
  std::string descriptor;
};

// Which way a transfer's bytes go: out of this end's regions, or into them.
enum class Direction : uint8_t { kSend = 0, kReceive = 1 };

// The cache a get names, where the link carries the request itself (ucx).
struct GetRequest {
  std::string model_id;
  std::string key;
  wire::Representation representation = wire::Representation::kStored;
};

// One transfer. `regions` in transfer order. Links that carry the request with the bytes (ucx)
// need what the peer knows it by: `block` for a put's block (sent: regions are its keys and its
// values, either 0 bytes when the block lacks that part) or `get` for a get (received: one
// region, its capacity). Links negotiated beforehand (nccl, ipc) move `regions` only, ordered
// on `stream` (a CUDA stream of the link's device); the UCX links move CUDA regions after the
// work queued on `stream` so far (ucx_link.h).
struct Transfer {
  Direction direction = Direction::kSend;
  std::vector<MemoryRegion> regions;
  const wire::Block* block = nullptr;
  const GetRequest* get = nullptr;
  void* stream = nullptr;
  absl::Time deadline = absl::InfiniteFuture();
  // The peer's side, for links that map the peer's memory (ipc: EncodeIpcMemory of its
  // regions, one per region of `regions`, of the same size, or at least that size with
  // `peer_may_be_larger`: a buffer a get fills in part); empty for the others.
  absl::string_view peer;
  bool peer_may_be_larger = false;
};

// The outcome of a posted transfer, reported once by its link. Thread-safe.
class Completion {
 public:
  // A transfer in flight: its link calls Finish.
  static std::shared_ptr<Completion> Pending();
  // A transfer already done when posted (links whose call returns with the transfer).
  static std::shared_ptr<Completion> Done(absl::Status status, uint64_t bytes = 0);
  // A transfer whose end is learned only by waiting for it (a CUDA stream: NCCL): `wait` runs
  // once, at the first Wait, with its deadline; Check says nullopt until then.
  static std::shared_ptr<Completion> ByWaiting(
      absl::AnyInvocable<absl::Status(absl::Time deadline)> wait, uint64_t bytes = 0);

  // Records the outcome (the first call wins) and runs the callbacks given to Then.
  void Finish(absl::Status status, uint64_t bytes = 0);
  // The outcome once known; nullopt while in flight.
  std::optional<absl::Status> Check();
  // Waits for the outcome until `deadline`: DeadlineExceeded then (the transfer goes on).
  absl::Status Wait(absl::Time deadline = absl::InfiniteFuture());
  // Runs `done` with the outcome once known: at once (here) when it is, else on the thread
  // that finishes it (a link's progress thread: keep it short). Not for ByWaiting.
  void Then(absl::AnyInvocable<void(const absl::Status&)> done);
  // The bytes a finished receive wrote (0 for sends and before the end).
  uint64_t bytes();

 private:
  Completion() = default;
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<absl::AnyInvocable<void(const absl::Status&)>> then_ ABSL_GUARDED_BY(mu_);
  absl::AnyInvocable<absl::Status(absl::Time)> wait_ ABSL_GUARDED_BY(mu_);
};

// One payload link at one end of one connection or channel.
class PayloadLink {
 public:
  virtual ~PayloadLink() = default;
  virtual LinkKind kind() const = 0;
  // The memory kinds and locality it serves (fixed per kind).
  LinkCaps caps() const { return CapsOf(kind()); }
  // Accepts `region` for transfers on this link: MemoryNotServed when the link cannot reach it
  // in place now (another memory kind, or the support it needs absent at either end).
  virtual absl::StatusOr<Registration> Register(const MemoryRegion& region) = 0;
  // Posts `transfer` (its regions registered); the completion reports its outcome. An error
  // here: nothing was posted.
  virtual absl::StatusOr<std::shared_ptr<Completion>> Post(const Transfer& transfer) = 0;
};

// The links of this end of one connection and what the peer offers: picks a link per transfer.
// Links are not owned; Add and the constructor before use, then thread-safe to read.
class LinkRouter {
 public:
  explicit LinkRouter(LinkOffer remote) : remote_(remote) {}
  void Add(PayloadLink* link);
  const LinkOffer& local() const { return local_; }
  const LinkOffer& remote() const { return remote_; }
  // The links, best first, that can carry `need` (ChooseLinks over both ends' offers).
  std::vector<PayloadLink*> Choose(const TransferNeed& need) const;
  // Registers the regions of `transfer` and posts it on the first link chosen for `need` that
  // accepts them: a link that refuses (AfterLinkFailure: kNextLink) is passed over for the next.
  // `used` (when given) names the link that took it. FailedPrecondition with
  // kMemoryNotMappable when no link takes it (naming each refusal); any other failure of
  // Register or Post is returned as it is.
  absl::StatusOr<std::shared_ptr<Completion>> Post(const TransferNeed& need,
                                                   const Transfer& transfer,
                                                   LinkKind* used = nullptr) const;

 private:
  LinkOffer local_;
  LinkOffer remote_;
  std::vector<PayloadLink*> links_;
};

}  // namespace transport
}  // namespace kvcomp

#endif  // KVCOMP_TRANSPORT_PAYLOAD_LINK_H_
