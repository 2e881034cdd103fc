// UcxClient: one authenticated UCX connection to one kvcompd (docs/protocol.md). The SDK
// (kvcomp::client) builds sharding, replicas and reconnection on top of it.
//
// Connections: every client of a process with the same UCX settings (ClientOptions::ucx,
// poll_spin, max_busy_backoff) shares one UCX context and one worker, made at the first Connect
// and kept until the process exits; a connection is an endpoint on that worker, created by
// Connect and closed by Close. Reconnecting (a new Connect after a failure) creates endpoints
// only, never contexts or workers (GetUcxClientStats counts them). fork(): a worker that no
// client holds is destroyed before the fork (made again at the next Connect), so a child forked
// while no client is open may connect; in a child forked while one is open Connect fails with
// FailedPrecondition (UCX's async thread is not inherited).
//
// Threads: the shared worker is driven by one progress thread. Every method is thread-safe;
// several threads may run requests at once, on one client or several, including blocks of the
// same put (pipelining: keep several SendBlockAsync in flight for throughput). Synchronous
// methods block the caller until the reply, the request timeout or the connection failing.
// Callbacks (SendBlockAsync's `done`) run on the progress thread, which all the process's
// clients share: keep them short; synchronous calls and Connect made there fail with
// FailedPrecondition (they would wait for the thread they run on).
//
// Errors: the server's status as sent (code and message); Unavailable when the connection is
// lost or closed (the client stays unusable: connect again); DeadlineExceeded when a request
// outlives request_timeout; Busy replies are retried inside the client (after the server's
// suggested wait, growing, until request_timeout) and surface as kvcomp::BusyError only if
// retrying runs out of time.
//
// Memory: block payloads are read from caller memory without a copy; the caller keeps it
// valid until the call returns (sync) or `done` runs (async). Host payloads carry their CRC32C
// (computed here). Device payloads (MemoryType::kCuda) are sent straight out of GPU memory
// where both sides negotiated them (DevicePayloads(): this UCX and the server's are CUDA-aware);
// they carry no CRC32C (wire::kBlockDevicePayload). GetInto receives into host memory, or
// device memory when this UCX is CUDA-aware (QueryUcxCapabilities().cuda_memory).
#ifndef KVCOMP_TRANSPORT_CLIENT_H_
#define KVCOMP_TRANSPORT_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvcomp/transport/buffer.h"
#include "kvcomp/transport/protocol.h"
#include "kvcomp/transport/ucx.h"

namespace kvcomp {
namespace transport {

struct ClientOptions {
  // Time to establish the UCX endpoint and complete hello. Default 5 s.
  absl::Duration connect_timeout = absl::Seconds(5);
  // Time any one request may take, busy retries included. Default 30 s.
  absl::Duration request_timeout = absl::Seconds(30);
  // Longest wait between busy retries (the first is the server's suggestion). Default 20 ms.
  absl::Duration max_busy_backoff = absl::Milliseconds(20);
  // As ServerOptions::poll_spin, for the client's progress thread. Default 200 us.
  absl::Duration poll_spin = absl::Microseconds(200);
  // Name sent in hello, for the server's logs. Default "kvcomp-client".
  std::string client_name = "kvcomp-client";
  // Say hello at Connect. False only for tests of unauthenticated traffic. Default true.
  bool send_hello = true;
  // Move payloads through same-host shared memory where the server offers it (shm_link.h);
  // false keeps every payload on UCX. Default true.
  bool shared_memory = true;
  // The shared put region (blocks in flight) and the largest shared get region, bytes.
  uint64_t shm_put_region_bytes = uint64_t{64} << 20;
  uint64_t shm_max_get_region_bytes = uint64_t{1} << 30;
  // Let the server copy straight between this process's memory and its buffers where the
  // kernel allows it (shm_link.h, direct mode); false: always through the regions. Default true.
  bool shm_direct = true;
  // Threads that copy blocks into the shared put region when the regions carry them (not in
  // direct mode): several blocks at once, a block of at least 512 KiB split over them; 1: on
  // the sending thread (ShmChannelOptions::copy_lanes). 0: one per 4 CPUs this process may run
  // on, 1 to 4 (as kvcompd's data_plane.shm_copy_lanes); at most 16.
  uint32_t shm_copy_lanes = 0;
  UcxConfig ucx;
};

// A reply as received by SendRawForTesting.
struct RawReply {
  wire::FrameHeader header;
  std::string body;
  size_t payload_bytes = 0;
  // The reply's status: a kStatus reply's code and message, kvcomp::BusyError for kBusy, OK for
  // any other type.
  absl::Status status;
};

struct FetchedCache {
  Buffer bytes;  // the cache bytes (format v1), host memory
  wire::Representation representation = wire::Representation::kStored;
};

class ShmChannel;

// A get answered into shared memory (UcxClient::GetSharedAsync).
struct SharedGet {
  uint64_t bytes = 0;
  // The cache is in the get region at the offset asked (or, direct, at the caller's address);
  // false: the server sent it as a reply payload instead (a cache in device memory, or one
  // larger than the capacity asked with Get::or_payload), already written to the caller's `dst`,
  // or in `payload` when the get named none.
  bool in_region = true;
  Buffer payload;
};

class UcxClient {
 public:
  // Connects to `endpoint` and says hello with `tenant` and `token`. Unauthenticated or
  // PermissionDenied when the server refuses the credentials, FailedPrecondition for a protocol
  // version it does not speak, Unavailable or DeadlineExceeded when it cannot be reached.
  static absl::StatusOr<std::unique_ptr<UcxClient>> Connect(const Endpoint& endpoint,
                                                            absl::string_view tenant,
                                                            absl::string_view token,
                                                            const ClientOptions& options = {});
  virtual ~UcxClient() = default;

  // What the server said at hello (limits, effective tenant).
  virtual const wire::HelloOk& server_info() const = 0;
  // False once the connection failed or was closed.
  virtual bool connected() const = 0;
  // OK when blocks may be sent from CUDA device memory on this connection: this client's UCX
  // is CUDA-aware (cuda_copy / cuda_ipc) and the server said so of its own at hello
  // (wire::kServerCudaMemory). Otherwise FailedPrecondition saying which side lacks it: device
  // memory must then be staged through host memory.
  virtual absl::Status DevicePayloads() const = 0;
  // True when this client's UCX can send from and receive into CUDA memory (cuda_copy /
  // cuda_ipc), whatever the server's: enough for GetInto device memory.
  virtual bool LocalCudaMemory() const = 0;

  // Opens a put. begin.put_id == 0 picks a fresh id; returns the id used. begin.num_tokens,
  // layout and policy are validated locally first (InvalidArgument).
  virtual absl::StatusOr<uint64_t> PutBegin(const wire::PutBegin& begin) = 0;

  // Sends one block of put `block.put_id`: `keys` (block.key_bytes bytes, when parts has
  // kPartKeys) and `values` (block.value_bytes, when kPartValues). The client fills in the
  // CRCs. Returns the server's acknowledgement (the handler consumed the block).
  // `memory` kCuda: `keys`/`values` are CUDA device memory, sent without a host copy;
  // FailedPrecondition unless DevicePayloads() is OK. Device keys and values go as one block
  // only when adjacent (values == keys + key_bytes); send them as separate blocks otherwise.
  virtual absl::Status SendBlock(const wire::Block& block, const void* keys, const void* values,
                                 MemoryType memory = MemoryType::kHost) = 0;
  // As SendBlock, without waiting: `done` runs once on the client's progress thread (keep it
  // short) with the outcome. `keys`/`values` must stay valid until then.
  virtual void SendBlockAsync(const wire::Block& block, const void* keys, const void* values,
                              absl::AnyInvocable<void(absl::Status)> done,
                              MemoryType memory = MemoryType::kHost) = 0;

  // Commits put `put_id` after `num_blocks` acknowledged blocks; returns what was stored.
  virtual absl::StatusOr<wire::CacheSummary> PutCommit(uint64_t put_id, uint64_t num_blocks) = 0;
  // Abandons a put (the server forgets its blocks).
  virtual absl::Status PutAbort(uint64_t put_id) = 0;

  // Gets and lookups end by `deadline` when it comes before request_timeout does (the
  // caller's deadline for a whole call): DeadlineExceeded then, as for the request timeout.
  //
  // Fetches a cache into a new host buffer. NotFound when absent. Through same-host shared
  // memory where the connection has it (ShmChannel::Get: one request, the cache coming back
  // over UCX within it when it is larger than the room there), else over UCX.
  virtual absl::StatusOr<FetchedCache> Get(
      absl::string_view model_id, absl::string_view key,
      wire::Representation representation = wire::Representation::kStored,
      absl::Time deadline = absl::InfiniteFuture()) = 0;
  // Fetches into caller memory of `capacity` bytes; returns the bytes written. OutOfRange
  // (nothing written) when the cache is larger than `capacity`.
  virtual absl::StatusOr<size_t> GetInto(absl::string_view model_id, absl::string_view key,
                                         wire::Representation representation, void* dst,
                                         size_t capacity, MemoryType memory = MemoryType::kHost,
                                         absl::Time deadline = absl::InfiniteFuture()) = 0;

  virtual absl::StatusOr<wire::CacheSummary> Lookup(
      absl::string_view model_id, absl::string_view key,
      absl::Time deadline = absl::InfiniteFuture()) = 0;
  virtual absl::Status Delete(absl::string_view model_id, absl::string_view key) = 0;
  // Round trip to the server (keep-alive, health).
  virtual absl::Status Ping() = 0;

  // Sends `frame` (any bytes, used as the AM header) with `payload` (the AM data) and waits for
  // the reply to request id `request_id`, with no validation and no busy retry. For tests of
  // malformed traffic against a real server.
  virtual absl::StatusOr<RawReply> SendRawForTesting(uint64_t request_id, std::string frame,
                                                     absl::string_view payload) = 0;

  // Same-host shared memory (shm_link.h): this connection's channel when the server offered it
  // at hello (wire::kServerSharedMemory) and ClientOptions::shared_memory is set; nullptr
  // otherwise. Lives as long as this client.
  virtual ShmChannel* SharedMemory() = 0;
  // A block whose payload lies in this connection's shared put region at block.shm_offset
  // (kBlockSharedMemory), or in this process's memory at the addresses the block names
  // (kBlockPeerMemory); zero checksums. `done` as SendBlockAsync's; the memory stays valid and
  // unchanged until it runs.
  virtual void SendSharedBlockAsync(const wire::Block& block,
                                    absl::AnyInvocable<void(absl::Status)> done) = 0;
  // A block whose K and V move over the payload link block.link_channel (kBlockLinkPayload,
  // the GPU channel): `descriptor` (block.link_bytes is set from it) travels as the frame's
  // data part, the link's description of this process's memory. `done` as SendBlockAsync's,
  // with the server's answer once the link's transfer is complete and the block was taken.
  // Post this side of the link's transfer after calling this (the server posts its side when
  // the block arrives).
  virtual void SendLinkBlockAsync(const wire::Block& block, std::string descriptor,
                                  absl::AnyInvocable<void(absl::Status)> done) = 0;
  // A get whose cache moves over the payload link get.link_channel (wire::Get::link_channel,
  // the GPU channel): `descriptor` (get.link_bytes is set from it) travels as the frame's data
  // part, the link's description of this process's memory. The answer names the transfer
  // (wire::GetReply link fields): over NCCL post this side's receive after it; over CUDA IPC
  // the bytes are in place. FailedPrecondition when the server predates link gets (its hello
  // said minor < 5).
  virtual absl::StatusOr<wire::GetReply> GetOverLink(const wire::Get& get, std::string descriptor,
                                                     absl::Time deadline) = 0;
  // A get (get.shared or get.direct set) that the server writes into this connection's shared
  // get region (or the caller's memory); `dst`/`capacity` receive a reply the server sends as a
  // payload instead (a new buffer, SharedGet::payload, when `dst` is null). `done` runs once on
  // the progress thread. Returns the request's id (the server stamps it on its progress).
  virtual uint64_t GetSharedAsync(const wire::Get& get, void* dst, size_t capacity,
                              absl::Time deadline,
                              absl::AnyInvocable<void(absl::StatusOr<SharedGet>)> done) = 0;

  // Closes the connection (its endpoint; the shared worker stays); pending requests fail with
  // Unavailable. Waits up to 2 s for UCX to let go of the endpoint (it continues in the
  // background past that; on the progress thread it does not wait). Idempotent; the destructor
  // calls it.
  virtual void Close() = 0;
};

// Counts of the UCX resources this process's clients made, since the process started.
struct UcxClientStats {
  uint64_t contexts_created = 0;   // ucp contexts: one per distinct UCX setting
  uint64_t workers_created = 0;    // ucp workers (and progress threads): as many
  uint64_t workers_live = 0;       // workers not yet destroyed
  uint64_t endpoints_created = 0;  // one per successful Connect's endpoint
  uint64_t endpoints_open = 0;     // endpoints made and not yet completely closed
};
UcxClientStats GetUcxClientStats();

}  // namespace transport
}  // namespace kvcomp

#endif  // KVCOMP_TRANSPORT_CLIENT_H_
