// UcxServer: the data-plane server of kvcompd. It listens on a socket address (ucp_listener),
// accepts UCX endpoints, parses and validates every message of docs/protocol.md, keeps the state
// of each connection (authentication, open puts, bytes in flight) and calls a RequestHandler,
// which the daemon implements, for the work itself.
//
// Threads: one progress thread owns the UCX worker and every connection; all handler calls
// except the completion callbacks run on it, so handler methods must not block (hand heavy work
// such as compression to a pool and complete later). Completion callbacks (Done, CommitDone,
// GetDone, LookupDone) may be called from any thread, including inside the handler method
// itself, and must be called exactly once each (never dropped: the connection's pending work
// and in-flight bytes are released by them); the reply is queued to
// the progress thread, which the callback wakes. Callbacks may outlive the connection: a reply to
// a closed connection is dropped.
//
// Flow control and memory admission: a block is admitted before its buffer exists. Its payload
// bytes are reserved against max_buffered_bytes (all tenants) and the tenant's share of it; the
// reservation lasts as long as the block's Buffer, wherever the handler keeps it (until it is
// compressed, stored or dropped), so the bytes of block buffers alive never exceed
// max_buffered_bytes. Each connection also has a bound on bytes in flight (blocks received or
// being received and not yet completed by OnBlock's Done). A block that would exceed either is
// refused with a Busy reply before its payload is received; the client retries it. Nothing is
// queued without bound. Payloads above max_payload_bytes are refused with InvalidArgument.
//
// Per-tenant shares: one tenant may hold at most tenant_share of max_buffered_bytes, of
// max_open_puts and of max_connections (at least one block, one put, one connection), so one
// tenant's backlog leaves the rest to the others. Beyond its share a tenant's puts and blocks get
// Busy and its hellos ResourceExhausted.
//
// Connection admission: at most max_connections endpoints, of which at most
// max_pre_hello_connections without a successful hello: a new endpoint beyond either closes the
// oldest one still waiting for its hello (and is refused only when every endpoint has said
// hello). When the process's free file descriptors fall below fd_reserve the listener is closed
// (new connections are refused by the kernel, nothing spins) and endpoints waiting for hello are
// closed; it listens again, on the same port, once twice that many are free. UCX's own log lines
// are rate-limited per source line.
//
// Timeouts: a connection that sends no hello within hello_timeout, or no message within
// idle_timeout, is closed; a put with no block or commit for put_timeout is aborted
// (OnPutAbort, later blocks of it get NotFound). A client that disconnects or dies
// (UCX peer error handling) has its open puts aborted and OnDisconnect called.
#ifndef KVCOMP_TRANSPORT_SERVER_H_
#define KVCOMP_TRANSPORT_SERVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvcomp/transport/buffer.h"
#include "kvcomp/transport/protocol.h"
#include "kvcomp/transport/ucx.h"

namespace kvcomp {
namespace transport {

// Defaults of the flow-control bounds. kvcompd's data_plane options state the same defaults
// (every bound of ServerOptions; tests/transport/server_options_test.cc holds them equal).
inline constexpr uint64_t kDefaultMaxInflightBytes = uint64_t{1} << 30;  // per connection
inline constexpr uint64_t kDefaultMaxBufferedBytes = uint64_t{4} << 30;  // all connections

struct ServerOptions {
  // Address to listen on (IPv4/IPv6 literal). Default "127.0.0.1".
  std::string listen_address = "127.0.0.1";
  // TCP port of the UCX listener; 0 picks an ephemeral port (see UcxServer::port()). Default 0.
  uint16_t port = 0;
  // Largest block payload (K plus V bytes) accepted, bytes. Default 256 MiB.
  uint64_t max_payload_bytes = uint64_t{256} << 20;
  // Bound on bytes in flight per connection, bytes; must be >= max_payload_bytes.
  uint64_t max_inflight_bytes = kDefaultMaxInflightBytes;
  // Bytes of block buffers alive at once (admitted, not yet freed by the handler), all tenants;
  // must be >= max_payload_bytes. Default 4 GiB.
  uint64_t max_buffered_bytes = kDefaultMaxBufferedBytes;
  // Puts open at once (begun, not yet committed or aborted), all tenants. Default 256.
  uint32_t max_open_puts = 256;
  // Share of max_buffered_bytes, max_open_puts and max_connections one tenant may hold, in
  // (0, 1]; 1 = no per-tenant bound. Default 0.5.
  double tenant_share = 0.5;
  // Wait suggested to a client refused with Busy, microseconds. Default 200.
  uint32_t busy_retry_after_us = 200;
  // Most endpoints at once. Default 1024.
  uint32_t max_connections = 1024;
  // Most endpoints still waiting for their hello; a new one beyond it closes the oldest.
  // Default 64.
  uint32_t max_pre_hello_connections = 64;
  // A connection without a successful hello after this long is closed. Default 3 s.
  absl::Duration hello_timeout = absl::Seconds(3);
  // Free file descriptors below which the listener closes (it reopens at twice as many); 0 =
  // never. Default 64.
  uint32_t fd_reserve = 64;
  // Let the listener bind its port while connections of an earlier process are still in
  // TIME_WAIT or being torn down (UCX's TCP_CM_REUSEADDR), so a restart binds at once. Default
  // true.
  bool reuse_address = true;
  // A connection with no message for this long is closed. Default 10 min.
  absl::Duration idle_timeout = absl::Minutes(10);
  // A put with no block or commit for this long is aborted. Default 60 s.
  absl::Duration put_timeout = absl::Seconds(60);
  // The progress thread polls this long after the last event before sleeping on the worker's
  // event fd (lower latency and higher throughput for CPU time). Default 200 us.
  absl::Duration poll_spin = absl::Microseconds(200);
  // Verify each block's CRC32C before calling OnBlock (host payloads only; on the copy threads,
  // shm_copy_lanes, off the progress thread). Default true.
  bool verify_checksums = true;
  // Offer same-host shared memory (shm_link.h, docs/protocol.md "Shared memory") to clients
  // of protocol minor >= 2: payloads through regions the client maps and passes to the server
  // over an abstract Unix socket. Default true.
  bool shared_memory = true;
  // The largest shared region the server maps, bytes (a get larger than a client's get region
  // goes over UCX). Default 1 GiB.
  uint64_t shm_max_region_bytes = uint64_t{1} << 30;
  // Threads that copy shared-memory payloads and check received blocks' checksums: blocks out
  // of clients' memory and blocks' CRC32C (several at once, off the progress thread), and one
  // direct get into the client's memory split over them (each at least kShmMinLaneBytes);
  // 0 = one per 4 CPUs, 1 to 4 (ShmCopyLanes). Default 0.
  uint32_t shm_copy_lanes = 0;
  // Receives the lines the server has for operators (listener closed or reopened), on the
  // progress thread; keep it short. Empty = written to stderr.
  std::function<void(const std::string&)> report;
  // Server name sent in HelloOk. Default "kvcompd".
  std::string server_name = "kvcompd";
  // On a UCX release before 1.14: make connections on the device they are made on only
  // (UcxOneDeviceSettings, UCX_CM_USE_ALL_DEVICES=n), so that clients on UCX 1.14 or later can
  // connect; clients on the same release connect either way (this release's fall back to it),
  // those of earlier kvcomp releases on it only when false (UCX's defaults). No effect on 1.14
  // or later, nor over a UCX_CM_USE_ALL_DEVICES variable or `ucx` override. docs/protocol.md,
  // "UCX releases". Default false.
  bool ucx_interop = false;
  UcxConfig ucx;
};

// Who is asking: the connection and, after hello, its tenant.
struct Session {
  uint64_t connection_id = 0;  // unique per server lifetime
  std::string peer;            // "ip:port" of the client
  std::string tenant;          // authenticated tenant; empty before hello
};

// What a handler keeps for one open put. The transport holds it in the put's own record, from
// the OnPutBegin that attached it until the put ends (committed, aborted, timed out or its
// connection gone) and every completion of the put has run, so a put's state has one owner and
// the handler needs no table of open puts.
class PutHandle {
 public:
  virtual ~PutHandle() = default;
};

// An open put: the session, the client's put id and what put-begin said.
struct PutContext {
  Session session;
  uint64_t put_id = 0;
  const wire::PutBegin* begin = nullptr;  // valid during the handler call only
  // OnPutBegin only: where the handler may leave its state for the put (kept on success).
  std::unique_ptr<PutHandle>* attach = nullptr;
  // Every later call of the put: what OnPutBegin attached (nullptr if nothing).
  PutHandle* handle = nullptr;
};

struct GetResult {
  Buffer bytes;  // the cache bytes to send (host, or device memory when UCX is CUDA-aware)
  wire::Representation representation = wire::Representation::kStored;
};

using Done = absl::AnyInvocable<void(absl::Status)>;
using CommitDone = absl::AnyInvocable<void(absl::StatusOr<wire::CacheSummary>)>;
using GetDone = absl::AnyInvocable<void(absl::StatusOr<GetResult>)>;
using LookupDone = absl::AnyInvocable<void(absl::StatusOr<wire::CacheSummary>)>;
using LinkReceived = absl::AnyInvocable<void(absl::StatusOr<Buffer>)>;
using LinkSent = absl::AnyInvocable<void(absl::StatusOr<wire::GetReply>)>;

// What the daemon implements. Methods run on the progress thread and must return quickly;
// completions may come later from any thread. A status returned or completed with an error is
// sent to the client as a kStatus reply with the same code and message; BusyError(...) statuses
// become kBusy replies (the client retries).
class RequestHandler {
 public:
  virtual ~RequestHandler() = default;

  // Authenticates a connection. Returns the tenant it acts for (normally hello.tenant with ""
  // meaning "default"), or Unauthenticated / PermissionDenied. Other requests before a
  // successful hello are answered Unauthenticated without calling the handler.
  virtual absl::StatusOr<std::string> OnHello(const Session& session,
                                              const wire::Hello& hello) = 0;

  // Opens a put (the layout and num_tokens are validated, the policy's records decoded; whether
  // the policy suits the layout is the handler's to check). Return an error to refuse it
  // (InvalidArgument, AlreadyExists, ResourceExhausted, BusyError...). The handler may leave
  // its state for the put in *put.attach; later calls of the put find it in put.handle.
  virtual absl::Status OnPutBegin(const PutContext& put) = 0;

  // Optional: memory for a block's payload of `size` bytes (zero-copy: UCX receives straight
  // into it). The default allocates host memory. A device buffer is used only when UCX is
  // CUDA-aware (UcxServer::cuda_memory(); otherwise the block is refused FailedPrecondition);
  // its checksum is then left to the handler (block.key_crc / value_crc; a block flagged
  // wire::kBlockDevicePayload carries none). Called for rendezvous payloads only: eager (small)
  // payloads always land in host memory.
  virtual absl::StatusOr<Buffer> AllocateBlock(const PutContext& put, const wire::Block& block,
                                               size_t size) {
    return Buffer::Allocate(size);
  }

  // Optional: a block flagged wire::kBlockLinkPayload, whose K and V move over the payload link
  // block.link_channel that the client and the daemon negotiated outside the data plane (the
  // GPU channel). `descriptor` is the frame's data part (host memory): the link's description
  // of the client's memory. Post the link's receive into memory of the handler's and complete
  // `received` once the transfer is complete: with that memory (block.payload_bytes() of it,
  // keys then values), which the transport then hands to OnBlock as any block's payload, or
  // with the failure, which is the block's answer. Any thread, exactly once; it may outlive the
  // put (a put that ended meanwhile gets NotFound). The default refuses every link block.
  virtual void ReceiveOverLink(const PutContext& put, const wire::Block& block,
                               Buffer descriptor, LinkReceived received) {
    received(absl::FailedPreconditionError("this server takes no payload over links"));
  }

  // A block of an open put, received and (host memory) checksum-verified. `payload` holds the
  // key bytes then the value bytes. Call `done` once consumed; its bytes count against the
  // connection's in-flight bound until then. The client is acknowledged with done's status.
  virtual void OnBlock(const PutContext& put, const wire::Block& block, Buffer payload,
                       Done done) = 0;

  // All blocks acknowledged (the transport checked the count). Store the cache and complete
  // when it is stored as the durability setting requires.
  virtual void OnPutCommit(const PutContext& put, CommitDone done) = 0;

  // A put ends without commit: `reason` is Cancelled (client abort), DeadlineExceeded
  // (put_timeout), Unavailable (disconnect or server stop) or the commit's failure. Called
  // exactly once for every put whose OnPutBegin succeeded and whose commit did not succeed.
  virtual void OnPutAbort(const PutContext& put, const absl::Status& reason) = 0;

  // Optional: a get that names payload link get.link_channel (wire::Get::link_channel, the GPU
  // channel): the cache goes to the client over that link, not in the reply. `descriptor` is
  // the frame's data part (host memory; empty over NCCL): the link's description of the
  // client's memory. Post the link's send and complete `sent` once the client may post its side
  // (or, for a link that writes the client's memory itself, once it is written), with the
  // answer's link fields (link_payload_bytes, layout, num_tokens, link_ns), or with the
  // failure. Any thread, exactly once. The default refuses every link get.
  virtual void SendOverLink(const Session& session, const wire::Get& get, std::string descriptor,
                            LinkSent sent) {
    sent(absl::FailedPreconditionError("this server sends no cache over links"));
  }

  // Fetches a cache of the session's tenant. NotFound when absent (also for other tenants').
  // The transport computes the reply's CRC32C of host bytes on the thread that calls `done`.
  virtual void OnGet(const Session& session, const wire::Get& get, GetDone done) = 0;
  virtual void OnLookup(const Session& session, const wire::Lookup& lookup, LookupDone done) = 0;
  virtual void OnDelete(const Session& session, const wire::Delete& del, Done done) = 0;

  // The connection is gone (closed, failed, timed out or server stopping), after its puts were
  // aborted. Completion callbacks still pending for it are safe to call.
  virtual void OnDisconnect(const Session& session) {}
};

// absl::StatusCode values are 0..16.
inline constexpr int kNumStatusCodes = 17;

// Counters of the server, monotonic (except the gauges marked so). Thread-safe snapshot.
struct ServerStats {
  uint64_t connections_accepted = 0;
  uint64_t connections_rejected = 0;  // max_connections (all said hello), draining, UCX errors
  uint64_t connections_evicted = 0;   // closed to admit a newer one (no hello yet)
  uint64_t listener_pauses = 0;       // times the listener closed for lack of file descriptors
  uint64_t listener_paused = 0;       // gauge: 1 while the listener is closed
  uint64_t connections_open = 0;      // gauge
  uint64_t hello_rejected = 0;        // authentication failures
  uint64_t messages_received = 0;
  uint64_t malformed_messages = 0;    // frames or bodies that failed validation
  uint64_t bytes_received = 0;        // block payload bytes accepted
  uint64_t bytes_sent = 0;            // get payload bytes sent
  uint64_t busy_replies = 0;
  uint64_t checksum_failures = 0;
  uint64_t puts_begun = 0;
  uint64_t puts_committed = 0;
  uint64_t puts_aborted = 0;          // all reasons
  uint64_t puts_timed_out = 0;
  uint64_t connections_timed_out = 0;
  uint64_t inflight_bytes = 0;        // gauge, all connections
  // Errors the server answered itself, without the handler, by absl::StatusCode value:
  // malformed frames and bodies, checksum mismatches, blocks of wrong or oversized sizes or for
  // puts that are not open, requests before hello, commits and aborts of unknown puts, new puts
  // while draining. Statuses the handler returned are not counted here.
  uint64_t rejected_by_code[kNumStatusCodes] = {};
  // Busy replies for the per-connection in-flight bound (the server's own back-pressure; also
  // counted in busy_replies, which includes busy statuses from the handler).
  uint64_t inflight_busy_replies = 0;
  // Busy replies for max_buffered_bytes and max_open_puts (all tenants), and for a tenant's
  // share of them.
  uint64_t capacity_busy_replies = 0;
  uint64_t tenant_busy_replies = 0;
  uint64_t buffered_bytes = 0;  // gauge: bytes of admitted block buffers alive
  // Device memory (docs/protocol.md, "CUDA-aware UCX"). cuda_memory: gauge, 1 when this UCX
  // can receive into and send from CUDA memory (hello-ok offers device payloads), 0 when device
  // memory is staged through host memory.
  uint64_t cuda_memory = 0;
  uint64_t device_payload_blocks = 0;  // blocks a client sent from its device memory
  uint64_t blocks_into_device = 0;     // blocks received straight into device memory
  // Same-host shared memory (docs/protocol.md, "Shared memory"). shared_memory: gauge, 1 when
  // hello-ok offers it.
  uint64_t shared_memory = 0;
  uint64_t shm_regions_attached = 0;  // client regions mapped
  uint64_t shm_attach_refused = 0;    // attach requests refused (token, descriptor, size)
  uint64_t shm_blocks = 0;            // blocks read from a client's put region
  uint64_t shm_gets = 0;              // gets written into a client's get region
  uint64_t link_blocks = 0;           // blocks whose payload came over a link (GPU channel)
  uint64_t link_gets = 0;             // gets whose cache went over a link (GPU channel)
};

class UcxServer {
 public:
  // Creates the UCX context, worker and listener and starts the progress thread. `handler`
  // must outlive the server. Errors: InvalidArgument (options), Unavailable or Internal (UCX,
  // with UCX's message), e.g. the port is taken.
  static absl::StatusOr<std::unique_ptr<UcxServer>> Start(const ServerOptions& options,
                                                          RequestHandler* handler);
  virtual ~UcxServer() = default;

  // The bound port (the ephemeral one when options.port was 0) and "address:port".
  virtual uint16_t port() const = 0;
  // True when this server's UCX can receive into and send from CUDA device memory
  // (UCS_MEMORY_TYPE_CUDA: cuda_copy / cuda_ipc); AllocateBlock may then return device memory.
  virtual bool cuda_memory() const = 0;
  virtual std::string address() const = 0;

  // Graceful stop, step one: new connections and new puts are refused (Unavailable
  // "draining"); gets, lookups and open puts continue. Returns at once.
  virtual void Drain() = 0;
  // Waits until no put is open and no handler completion is pending, or `timeout` passes
  // (DeadlineExceeded).
  virtual absl::Status WaitIdle(absl::Duration timeout) = 0;
  // Closes the listener and every connection (open puts aborted, OnDisconnect called) and
  // joins the progress thread. Idempotent; the destructor calls it. Handler completions that
  // arrive afterwards are dropped.
  virtual void Stop() = 0;

  virtual ServerStats stats() const = 0;
};

}  // namespace transport
}  // namespace kvcomp

#endif  // KVCOMP_TRANSPORT_SERVER_H_
