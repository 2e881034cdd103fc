// The same-host shared-memory link ("shm", payload_link.h): a put's blocks and a get's cache
// move between a client and kvcompd on one host through memory both map, one copy at each end,
// while the requests, replies, authentication, admission and error handling stay those of the
// UCX connection (docs/protocol.md, "Shared memory").
//
// How the two ends meet:
//   1. kvcompd listens on an abstract Unix socket (ShmAcceptor). A client whose hello says
//      protocol minor >= 2 gets, in its hello-ok (wire::kServerSharedMemory), the socket's name,
//      an attach token of its own (16 random bytes, known only to that authenticated
//      connection) and the largest region the daemon maps.
//   2. The client makes a region: a memfd, sized, fully allocated (so the daemon never
//      allocates the client's pages), sealed against shrinking (so a mapping never loses its
//      pages under the daemon) and mapped; it passes the descriptor over the socket
//      (SCM_RIGHTS) with the token and the region's id (ShmRegion::Attach). The daemon takes it
//      only for a known token and only a sealed, fully allocated memfd of the stated size
//      within its bound, then maps it (ShmGrant). No path is ever opened: a peer that can hand
//      the daemon a descriptor shares its kernel, which is the proof of locality; a client on
//      another host (or in another network namespace) cannot reach the socket, its attach fails
//      and its transfers go over UCX.
//   3. A block (kBlockSharedMemory) names an offset in the put region: the daemon checks it
//      against the region, admits the bytes as any block's (max_buffered_bytes, the tenant's
//      share, the connection's in-flight bound) and copies them into the block's own buffer.
//      A get (Get::shared) names an offset and capacity in the get region: the daemon writes
//      the cache there, publishing its progress in the region's first bytes (ShmProgress), and
//      answers with the byte count; the client copies behind it into the caller's memory.
//
// Direct mode (cross-memory attach): a client may also register itself as the connection's
// peer (an attach request of kShmPeer, no descriptor): the daemon takes the peer's process from
// the socket's credentials (SO_PEERCRED, and a pidfd held while the connection lives: never a
// pid the client names), proves it may read that process's memory by reading a probe word the
// client named and answering it back, and from then on moves blocks and gets with one copy
// between the client's own memory and its buffers (process_vm_readv / process_vm_writev, as
// UCX's cma does): a block (kBlockPeerMemory) names the addresses of its keys and values, a get
// (Get::direct) the caller's destination. Where the kernel does not allow it (another user,
// Yama ptrace_scope, a container without the permission), the probe fails and the regions
// carry the bytes. A client can only make the daemon read or write its own memory, and a
// liveness check on the pidfd comes before every access (a pid reused after the client died is
// never touched).
//
// Regions are the client's memory: mapping one costs the daemon no memory, and a dying client
// leaves the daemon's mapping valid until the connection's grant is dropped (its UCX
// connection closing). Thread-safe: ShmAcceptor, ShmGrant, ShmChannel; ShmLink as its channel.
#ifndef KVCOMP_TRANSPORT_SHM_LINK_H_
#define KVCOMP_TRANSPORT_SHM_LINK_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvcomp/transport/buffer.h"
#include "kvcomp/transport/client.h"
#include "kvcomp/transport/payload_link.h"
#include "kvcomp/transport/protocol.h"
#include "kvcomp/transport/shm_copy_pool.h"

namespace kvcomp {
namespace transport {

class UcxClient;

// Region ids: the put region holds blocks in flight, the get region a get's cache.
inline constexpr uint8_t kShmPutRegion = 0;
inline constexpr uint8_t kShmGetRegion = 1;
inline constexpr int kShmRegions = 2;
// An attach request that registers the sending process as the connection's peer (direct mode).
inline constexpr uint8_t kShmPeer = 0xff;
// Smallest region either end accepts.
inline constexpr uint64_t kShmMinRegionBytes = uint64_t{64} << 10;
// The get region starts with the daemon's progress (ShmProgress); the cache lands from here.
inline constexpr uint64_t kShmGetDataOffset = 4096;

// At offset 0 of the get region while a get with shm_offset >= kShmGetDataOffset is written:
// the request it belongs to, then how many bytes of the cache are in place (release order),
// and the cache's size (stored before the request id; 0 from daemons before it was added).
struct ShmProgress {
  std::atomic<uint64_t> request_id;
  std::atomic<uint64_t> written;
  std::atomic<uint64_t> total;
};

// [offset, offset + bytes) within a region of `size` bytes (no overflow), else InvalidArgument
// naming `what`.
absl::Status CheckShmRange(uint64_t offset, uint64_t bytes, uint64_t size, const char* what);

// ---- kvcompd's end ----

// A client's region mapped into the daemon (and its descriptor); unmapped when the last holder
// drops it.
class ShmMapping {
 public:
  ShmMapping(uint8_t* data, uint64_t size, int fd) : data_(data), size_(size), fd_(fd) {}
  ~ShmMapping();
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  // Still fully allocated (the owner may punch holes, which the seals allow: the daemon's
  // accesses would then allocate pages); FailedPrecondition otherwise. Checked before each
  // block's and get's copy.
  absl::Status Intact() const;

 private:
  uint8_t* const data_;
  const uint64_t size_;
  const int fd_;
};

// What one connection attached. Regions are replaced by a later attach of the same id; a
// holder of the old mapping keeps it until done.
// The least a lane of a split peer copy moves: smaller copies stay on one thread.
inline constexpr uint64_t kShmMinLaneBytes = uint64_t{8} << 20;
// The lanes of a direct get's copy: `configured` when not 0 (at most 16), else one per 4 CPUs
// this process may run on, 1 to 4.
int ShmCopyLanes(uint32_t configured);

class ShmGrant {
 public:
  // `pool`: the threads a split peer copy's lanes run on (the acceptor's copy threads); none:
  // every copy on the calling thread.
  explicit ShmGrant(std::string token, std::shared_ptr<CopyPool> pool = nullptr)
      : token_(std::move(token)), pool_(std::move(pool)) {}
  ~ShmGrant();
  const std::string& token() const { return token_; }
  std::shared_ptr<ShmMapping> Region(uint8_t id) const;
  void Set(uint8_t id, std::shared_ptr<ShmMapping> mapping);
  // Direct mode: the registered peer process (its pidfd is the grant's from then on).
  void SetPeer(int pid, int pidfd);
  bool has_peer() const;
  // Copies between the peer's memory at `address` and this process's, one copy; FailedPrecondition
  // when no peer is registered, it has exited or the kernel refuses (permission), InvalidArgument
  // when the peer's range is not its memory.
  // `lanes` > 1: a copy of at least kShmMinLaneBytes per lane is split into that many
  // contiguous ranges copied at once on the calling thread and the grant's pool (CopyPool::
  // ForEach: the calling thread copies whatever range no pool thread took).
  absl::Status ReadPeer(uint64_t address, void* to, uint64_t bytes, int lanes = 1) const;
  absl::Status WritePeer(uint64_t address, const void* from, uint64_t bytes, int lanes = 1) const;

 private:
  absl::Status PeerAccess(bool write, uint64_t address, void* local, uint64_t bytes,
                          int lanes) const;
  const std::string token_;
  const std::shared_ptr<CopyPool> pool_;
  mutable absl::Mutex mu_;
  std::shared_ptr<ShmMapping> regions_[kShmRegions] ABSL_GUARDED_BY(mu_);
  int pid_ ABSL_GUARDED_BY(mu_) = 0;
  int pidfd_ ABSL_GUARDED_BY(mu_) = -1;
};

struct ShmAcceptorStats {
  uint64_t attached = 0;  // regions mapped
  uint64_t refused = 0;   // attach requests refused (unknown token, bad descriptor, size, ...)
};

// The daemon's Unix socket for attaching regions, and the grants of live connections.
class ShmAcceptor {
 public:
  // Listens on a fresh abstract socket; regions of more than `max_region_bytes` are refused.
  // `report` gets one line per refused attach (rate is the peer's; keep it short).
  // `pool`: the copy threads RunCopy and the grants' split peer copies run on (the server's,
  // which also checks received blocks' checksums there); none: a pool of one thread. The
  // acceptor stops it when it goes (queued copies run first).
  static absl::StatusOr<std::unique_ptr<ShmAcceptor>> Start(
      uint64_t max_region_bytes, std::function<void(const std::string&)> report,
      std::shared_ptr<CopyPool> pool = nullptr);
  ~ShmAcceptor();

  // Runs `work` (a block's copy out of a client's memory) on one of the copy threads (made as
  // copies arrive); work still queued when the acceptor goes runs before it is gone.
  void RunCopy(absl::AnyInvocable<void() &&> work);

  // The socket's abstract name (without the leading NUL), for hello-ok.
  const std::string& name() const { return name_; }
  uint64_t max_region_bytes() const { return max_region_bytes_; }
  // A grant with a fresh token (an authenticated connection's); attaches with it land there.
  std::shared_ptr<ShmGrant> Enroll();
  // The connection is gone: its token attaches nothing any more (mappings go with the last
  // holder of the grant).
  void Withdraw(const ShmGrant& grant);
  ShmAcceptorStats stats() const;

 private:
  ShmAcceptor(int listen_fd, int wake_fd, std::string name, uint64_t max_region_bytes,
              std::function<void(const std::string&)> report, std::shared_ptr<CopyPool> pool);
  void Loop();
  void Serve(int fd);
  absl::Status Attach(int fd, const void* message, size_t length, int region_fd,
                      uint64_t* probe);

  const int listen_fd_;
  const int wake_fd_;
  const std::string name_;
  const uint64_t max_region_bytes_;
  const std::function<void(const std::string&)> report_;
  std::atomic<uint64_t> attached_{0}, refused_{0};
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::weak_ptr<ShmGrant>> grants_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
  // Shared with the grants (a grant may outlive the acceptor: its copies then run on the
  // calling thread, the pool stopped).
  const std::shared_ptr<CopyPool> pool_;
};

// ---- the client's end ----

// A memfd region of this process, attached to a kvcompd (steps 2 above).
class ShmRegion {
 public:
  // Makes a region of `bytes` and attaches it as `id` at the daemon that sent `hello`, by
  // `deadline`. Unavailable when the daemon cannot be reached (another host) or refuses.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Attach(const wire::HelloOk& hello, uint8_t id,
                                                           uint64_t bytes, absl::Time deadline);
  ~ShmRegion();
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  ShmRegion(uint8_t* data, uint64_t size) : data_(data), size_(size) {}
  uint8_t* const data_;
  const uint64_t size_;
};

// The attach request itself: `fd` (none when negative) as region `id` of `bytes` with `token`,
// to the server's socket named `socket_name`; OK or the server's refusal (its code and reason).
// ShmRegion::Attach makes a proper region and calls it; tests send improper ones.
// `probe` (kShmPeer): the address of 8 bytes the server reads back from this process; the
// answer carries what it read (`*probe_read`).
absl::Status SendShmAttach(const std::string& socket_name, absl::string_view token, uint8_t id,
                           uint64_t bytes, int fd, absl::Time deadline, uint64_t probe = 0,
                           uint64_t* probe_read = nullptr);

struct ShmChannelOptions {
  uint64_t put_region_bytes = uint64_t{64} << 20;
  uint64_t max_get_region_bytes = uint64_t{1} << 30;
  bool direct = true;  // try direct mode (else the regions only)
  // Threads that copy blocks into the put region (the regions' path; direct mode has no
  // client-side copy). 1: each block on the sending thread, SendBlock returning when it is in
  // place. More: SendBlock returns once the block's copy is queued on the channel's copy
  // threads (a CopyPool of that many), which copy several blocks at once, a block of at least
  // 2 x kShmMinClientLaneBytes split into up to that many contiguous ranges. 0: as the
  // daemon's data_plane.shm_copy_lanes default (ShmCopyLanes: one per 4 CPUs of this process,
  // 1 to 4); at most 16.
  uint32_t copy_lanes = 0;
};

// The least one lane of a client's copy into its put region moves.
inline constexpr uint64_t kShmMinClientLaneBytes = uint64_t{256} << 10;

// One connection's shared memory: its put region (blocks in flight, a ring) and its get region
// (one get at a time, grown to the largest capacity asked, within both ends' bounds). Regions
// are made at first use; when one cannot be attached the channel stops offering itself
// (usable() false) and its transfers go over the next link.
class ShmChannel {
 public:
  ShmChannel(UcxClient* client, ShmChannelOptions options);
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // False once an attach failed (the reason: why()).
  bool usable() const;
  // Gets answered through shared memory (direct or the get region) and gets whose cache came
  // back as a UCX payload within the same request (larger than the room asked), since made.
  struct Stats {
    uint64_t gets_shared = 0;
    uint64_t gets_as_payload = 0;
    // Blocks copied into the put region, and those of them split over several copy lanes.
    uint64_t blocks_copied = 0;
    uint64_t blocks_split = 0;
  };
  Stats stats() const;
  std::string why() const;
  // The put region's copy lanes (options' copy_lanes, or its default).
  int copy_lanes() const;
  // Whether blocks and gets move directly between this process's memory and the daemon's
  // buffers (registered as the connection's peer and the daemon proved it may read this
  // process's memory); decided at the first transfer.
  bool direct();

  // Copies `keys` and `values` (host memory) into the put region and posts `block` naming
  // them; the completion finishes when the daemon acknowledged it. With one copy lane the copy
  // is done when this returns; with more it runs on the copy threads after, so `keys` and
  // `values` must stay as they are until the completion finishes (as in direct mode, where the
  // daemon reads them). Either way blocks are posted in the order SendBlock was called, each
  // only when all its bytes are in place.
  // MemoryNotServed when the block does not fit the region or the region cannot be attached.
  absl::StatusOr<std::shared_ptr<Completion>> SendBlock(const wire::Block& block,
                                                        const MemoryRegion& keys,
                                                        const MemoryRegion& values,
                                                        absl::Time deadline);
  // A get into `dst` (host memory of `capacity` bytes) through the get region; the bytes
  // written. MemoryNotServed when the cache is larger than the region can be (the caller goes
  // over UCX), else as UcxClient::GetInto.
  absl::StatusOr<uint64_t> GetInto(const GetRequest& request, void* dst, uint64_t capacity,
                                   absl::Time deadline);
  // A get into a new host buffer, its size not known beforehand, as one request (a daemon of
  // protocol minor >= 3, Get::or_payload): direct mode writes the cache into a fresh reservation
  // of this process's address space (max_get_region_bytes of it, pages made as written), else
  // the daemon writes it into the get region and it is copied out; a cache larger than that
  // room comes back as the reply's payload over UCX in the same request (and the get region
  // grows for the next one, within both ends' bounds). MemoryNotServed where the channel cannot
  // serve it (an older daemon, a region that cannot be attached): the caller goes over UCX.
  absl::StatusOr<FetchedCache> Get(const GetRequest& request, absl::Time deadline);

 private:
  absl::Status EnsurePutRegion(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(put_mu_);
  // direct() by `deadline`: DeadlineExceeded when the daemon does not answer in time (left
  // undecided).
  absl::StatusOr<bool> Direct(absl::Time deadline);
  absl::StatusOr<std::shared_ptr<Completion>> SendDirect(const wire::Block& block,
                                                         const MemoryRegion& keys,
                                                         const MemoryRegion& values);
  void Release(uint64_t offset);
  void Unusable(const absl::Status& why);
  // The put region's copy lanes, and their threads (none with one lane).
  const int lanes_;
  std::unique_ptr<CopyPool> pool_;
  // A block being copied into the put region (shm_link.cc).
  struct Outgoing;
  // `block`'s copy is complete: posts every block at the front of outgoing_ whose copy is.
  void Copied(const std::shared_ptr<Outgoing>& block);
  std::atomic<uint64_t> blocks_copied_{0}, blocks_split_{0};

  UcxClient* const client_;
  const ShmChannelOptions options_;
  mutable absl::Mutex state_mu_;
  absl::Status broken_ ABSL_GUARDED_BY(state_mu_);
  enum class DirectMode { kUntried, kYes, kNo };
  DirectMode direct_ ABSL_GUARDED_BY(state_mu_) = DirectMode::kUntried;

  // The put region as a ring of blocks in flight, in posting order.
  struct Slot {
    uint64_t offset;
    uint64_t bytes;
    bool done;
  };
  absl::Mutex put_mu_;
  std::unique_ptr<ShmRegion> put_ ABSL_GUARDED_BY(put_mu_);
  std::deque<Slot> slots_ ABSL_GUARDED_BY(put_mu_);
  // Blocks placed in the ring and not yet posted, in SendBlock's order; whether a thread is
  // posting them now (one at a time keeps the order).
  std::deque<std::shared_ptr<Outgoing>> outgoing_ ABSL_GUARDED_BY(put_mu_);
  bool posting_ ABSL_GUARDED_BY(put_mu_) = false;

  absl::StatusOr<FetchedCache> GetDirect(const GetRequest& request, absl::Time deadline);
  // (Re)attaches the get region when it is smaller than `want` bytes (bounded by both ends).
  absl::Status EnsureGetRegion(uint64_t want, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(get_mu_);

  std::atomic<uint64_t> gets_shared_{0}, gets_as_payload_{0};
  absl::Mutex get_mu_;  // one get at a time
  std::unique_ptr<ShmRegion> get_ ABSL_GUARDED_BY(get_mu_);
  // The size the get region should have for Get (the largest cache it had to send as a
  // payload), within the bounds.
  uint64_t get_hint_ ABSL_GUARDED_BY(get_mu_) = 0;
};

// The link over a connection's ShmChannel. Register: host memory while the channel is usable.
// Post: a send is one put block (as UcxLink's; completes on the daemon's acknowledgement); a
// receive is a get into the one region, done when Post returns.
class ShmLink final : public PayloadLink {
 public:
  explicit ShmLink(ShmChannel* channel) : channel_(channel) {}
  LinkKind kind() const override { return LinkKind::kShm; }
  absl::StatusOr<Registration> Register(const MemoryRegion& region) override;
  absl::StatusOr<std::shared_ptr<Completion>> Post(const Transfer& transfer) override;

 private:
  ShmChannel* const channel_;
};

}  // namespace transport
}  // namespace kvcomp

#endif  // KVCOMP_TRANSPORT_SHM_LINK_H_
