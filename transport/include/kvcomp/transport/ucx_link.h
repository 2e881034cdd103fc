// The UCX payload links (payload_link.h): ucx moves host memory and ucx-cuda CUDA memory between
// this process and a kvcompd over one UcxClient connection; the request travels with its bytes
// (a put's block, a get's reply), so nothing is negotiated beforehand. The daemon's end is the
// transport server (server.h), the same for both.
//
//   Register  ucx: host memory; CUDA memory too, staged (below), where this process has a CUDA
//             driver and the region is device memory. ucx-cuda: CUDA memory only, and only when
//             this process's UCX is CUDA-aware (UcxClient::LocalCudaMemory). A refusal is
//             MemoryNotServed.
//   Post      a send is one block of a put (Transfer::block; regions: keys, values), posted
//             without waiting (UcxClient::SendBlockAsync); it completes when the daemon has
//             acknowledged it, on the connection's progress thread. A ucx-cuda send needs the
//             daemon's UCX CUDA-aware as well (UcxClient::DevicePayloads; else MemoryNotServed).
//             A receive is a get into the one region (Transfer::get; UcxClient::GetInto), done
//             when Post returns (the connection's get waits for its reply).
//   CUDA      regions are read and written after the work queued on Transfer::stream so far
//             (the caller's; nullptr: the legacy default stream). ucx-cuda waits for that work,
//             then UCX moves the device memory in place. ucx stages: a send copies the regions
//             into pinned host memory on the stream, waits for the copies and sends the host
//             bytes; a receive gets into pinned host memory and copies it to the region on the
//             stream, returning once the copy is done. The pinned buffers are the link's, reused
//             by its later transfers (a put's blocks) and freed with the link.
//
// UcxLinks holds both links of one connection with the routers of each direction (ucx-cuda
// before ucx for CUDA memory: in place first, staged where either end's UCX lacks CUDA memory);
// BlockPipe keeps a put's blocks in flight within a window over a router. Thread-safe: the
// links and routers as the UcxClient is; a BlockPipe serves one put (Send from one thread at a
// time).
#ifndef KVCOMP_TRANSPORT_UCX_LINK_H_
#define KVCOMP_TRANSPORT_UCX_LINK_H_

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvcomp/transport/client.h"
#include "kvcomp/transport/payload_link.h"
#include "kvcomp/transport/protocol.h"
#include "kvcomp/transport/shm_link.h"

namespace kvcomp {
namespace transport {

class PinnedPool;

class UcxLink final : public PayloadLink {
 public:
  // `kind` kUcxHost or kUcxCuda; `client` outlives the link.
  UcxLink(UcxClient* client, LinkKind kind);
  LinkKind kind() const override { return kind_; }
  absl::StatusOr<Registration> Register(const MemoryRegion& region) override;
  absl::StatusOr<std::shared_ptr<Completion>> Post(const Transfer& transfer) override;

 private:
  // CUDA regions over ucx: through pinned host memory on the transfer's stream.
  absl::StatusOr<std::shared_ptr<Completion>> PostStaged(const Transfer& transfer);

  UcxClient* const client_;
  const LinkKind kind_;
  const std::shared_ptr<PinnedPool> staging_;  // held by sends in flight as well
};

// What a kvcompd offers for transfers in `direction` (from this end's view), by its hello-ok:
// ucx always; shm when it takes same-host shared memory (wire::kServerSharedMemory); ucx-cuda for gets (the daemon's side of a get is host memory, whatever its UCX)
// and for puts only when its UCX is CUDA-aware (wire::kServerCudaMemory).
LinkOffer UcxPeerOffer(const wire::HelloOk& hello, Direction direction);

// The links of one connection (shm where the connection has a shared-memory channel, then
// both UCX links), and a router per direction. `client` outlives it.
class UcxLinks {
 public:
  explicit UcxLinks(UcxClient* client);
  UcxLinks(const UcxLinks&) = delete;
  UcxLinks& operator=(const UcxLinks&) = delete;
  const LinkRouter& For(Direction direction) const {
    return direction == Direction::kSend ? send_ : receive_;
  }
  // A get of `request` into `into` (its capacity) by `deadline`, on the link chosen for its
  // memory (CUDA memory: after `stream`'s work so far, written by the time this returns); the
  // bytes written. As UcxClient::GetInto (OutOfRange when the cache is larger, NotFound, ...),
  // FailedPrecondition with kMemoryNotMappable when no link reaches `into`.
  absl::StatusOr<uint64_t> GetInto(const GetRequest& request, const MemoryRegion& into,
                                   absl::Time deadline, LinkKind* used = nullptr,
                                   void* stream = nullptr) const;

 private:
  std::optional<ShmLink> shm_;
  UcxLink host_;
  UcxLink cuda_;
  LinkRouter send_;
  LinkRouter receive_;
};

// The blocks of one put over `links`' send router, pipelined: at most `window` bytes in flight
// (one block more when a single block is larger). The destructor waits for what is in flight.
class BlockPipe {
 public:
  BlockPipe(const UcxLinks& links, uint64_t window) : links_(links), window_(window) {}
  ~BlockPipe() { Wait().IgnoreError(); }
  BlockPipe(const BlockPipe&) = delete;
  BlockPipe& operator=(const BlockPipe&) = delete;

  // Posts `block` (its put id, layers, tokens, parts and sizes set) with `keys` and `values`
  // (regions of one memory kind; the part the block lacks may be empty; CUDA memory is read
  // after `stream`'s work so far). `keep` is held until the block completes (a packed copy).
  // Waits first for room in the window. A failure is kept for Wait; blocks after a failure are
  // not posted.
  void Send(const wire::Block& block, const MemoryRegion& keys, const MemoryRegion& values,
            std::shared_ptr<const void> keep = nullptr, void* stream = nullptr);
  // Waits until every posted block completed; the first failure.
  absl::Status Wait();
  // Blocks posted so far (the count a commit names).
  uint64_t sent();
  // The link the last block took (kUcxHost before any).
  LinkKind link();

 private:
  const UcxLinks& links_;
  const uint64_t window_;
  absl::Mutex mu_;
  uint64_t inflight_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t sent_ ABSL_GUARDED_BY(mu_) = 0;
  LinkKind link_ ABSL_GUARDED_BY(mu_) = LinkKind::kUcxHost;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace transport
}  // namespace kvcomp

#endif  // KVCOMP_TRANSPORT_UCX_LINK_H_
