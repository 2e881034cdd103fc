// The kvcomp C++ SDK: what a serving engine links to push KV caches to kvcompd (prefill) and
// fetch them back (decode).
//
// Endpoints and sharding: a Client talks to one or more kvcompd instances. Each cache key is
// placed by rendezvous (highest-random-weight) hashing of (tenant, model, key) over the
// endpoints; with replicas = R the R highest-ranked endpoints each store a copy. When an
// endpoint is down, writes go to the next endpoints in the key's ranking (the survivors) and
// reads try the ranking in order, so a cache stays readable while any copy's endpoint is up.
// An endpoint that fails is skipped for `down_for` and then tried again.
//
// Pools found through DNS: an endpoint "dns:///NAME:DATA_PORT[,CONTROL_PORT]" stands for every
// address NAME resolves to (IPv4 and IPv6), each a kvcompd listening on those ports -- the
// chart's headless Service has one record per ready daemon. Names are resolved at Connect,
// every `dns_refresh_interval`, and soon after a connection to a member fails, so daemons that
// join or leave are used or dropped without restarting the client. Members are ranked by their
// data address ("10.0.0.7:7420"), so only the keys that a joining or leaving member ranks
// first move. A DNS server that does not answer leaves the last known members in place; a name
// that the DNS says has no address leaves no members, and calls then fail with Unavailable
// saying so until it has some again.
//
// Connections: a Client opens one data-plane connection per endpoint it uses, when first
// needed, and a new one after that connection fails (reconnecting). Every connection of the
// process, of all its Clients, is a UCX endpoint on one UCX context and worker shared by all
// (one per distinct ucx_overrides), made at the first connection and kept until the process
// exits: reconnecting, or making and dropping Clients, creates and closes endpoints only, so a
// process may reconnect without bound. One progress thread serves them all. A fork() while no
// Client is connected drops the worker (the child may then connect; one forked while a Client
// is connected cannot use UCX).
//
// Threads: every method is thread-safe; a Client may be shared by all threads of a process.
// A PutStream belongs to one thread at a time.
//
// Ownership: inputs are read from caller memory during the call (no copies are kept); outputs
// are returned by value or written into caller buffers that the caller owns.
//
// Errors (absl::Status, never exceptions): InvalidArgument for bad arguments (shapes that do
// not match the layout, an invalid key or policy), NotFound when no endpoint has the cache,
// Unauthenticated/PermissionDenied for refused credentials, Unavailable when no endpoint can
// be reached, DeadlineExceeded when the request timeout (or a lookup's or get's deadline)
// passes, ResourceExhausted for quotas, FailedPrecondition naming what answered when an address
// is not a kvcompd port (an HTTP server, a kvcompd control port given as a data port, ...),
// and the server's status otherwise.
#ifndef KVCOMP_CLIENT_CLIENT_H_
#define KVCOMP_CLIENT_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/core/policy.h"

namespace kvcomp {
namespace client {

// One kvcompd: its UCX data address and, for Stats and control calls, its Thrift address.
struct EndpointAddress {
  std::string data;     // "host:port" or "[v6]:port" of the UCX listener
  std::string control;  // "host:port" of the Thrift control port; empty: no control calls
  // Parses "data" or "data,control" (e.g. "127.0.0.1:7420,127.0.0.1:7421").
  static absl::StatusOr<EndpointAddress> Parse(absl::string_view text);
};

struct ClientOptions {
  std::string tenant;  // empty: "default"
  std::string token;   // per-tenant credential; empty for an open daemon
  // Copies of each cache, on distinct endpoints (at most the number of endpoints). Default 1.
  int replicas = 1;
  // Establishing a connection (UCX endpoint + hello). Default 5 s.
  absl::Duration connect_timeout = absl::Seconds(5);
  // One request to one endpoint, server-side busy retries included. Default 60 s.
  absl::Duration request_timeout = absl::Seconds(60);
  // Deadline of one LookupPrefix call as a whole (every endpoint asked, connecting included):
  // a daemon that does not answer in time (stalled, overloaded) makes the call fail with
  // DeadlineExceeded instead of holding the caller. Default 1 s.
  absl::Duration lookup_timeout = absl::Seconds(1);
  // Deadline of one read as a whole: Get, GetBytes, GetDecoded, GetInto, Lookup (every endpoint
  // of the key's ranking tried, retries and connecting included) and GetChunks /
  // GetChunkBytes. Default 10 s. A call's ReadOptions::timeout replaces it (and lookup_timeout).
  absl::Duration get_timeout = absl::Seconds(10);
  // Attempts per endpoint for a request failing with Unavailable/DeadlineExceeded/Busy before
  // moving on, with exponential backoff from initial_backoff up to max_backoff. Defaults 2,
  // 20 ms, 1 s.
  int attempts_per_endpoint = 2;
  absl::Duration initial_backoff = absl::Milliseconds(20);
  absl::Duration max_backoff = absl::Seconds(1);
  // How long an endpoint that failed to connect or dropped is skipped. Default 2 s.
  absl::Duration down_for = absl::Seconds(2);
  // Largest block payload sent (K plus V); the server's limit wins if smaller. Default 8 MiB.
  uint64_t max_block_bytes = uint64_t{8} << 20;
  // UCX transport settings (UCX_TLS and so on) for this client's workers; empty: environment.
  std::vector<std::pair<std::string, std::string>> ucx_overrides;
  // Move host puts' blocks and GetInto's cache through same-host shared memory where a daemon
  // offers it and runs on this host (docs/protocol.md, "Shared memory"); false keeps them on
  // UCX. Default true.
  bool shared_memory = true;
  // Through shared memory, let the daemon copy a put's blocks straight out of this process's
  // memory and a get's cache straight into it where the kernel allows it (one copy; direct
  // mode); false: always through the memory regions this client passes it (a copy at each
  // end). Default true.
  bool shm_direct = true;
  // Threads that copy put blocks into this client's shared put region when the regions carry
  // them (not in direct mode): several blocks at once, a block of 512 KiB or more split over
  // them; 1 copies each block on the calling thread. 0: one per 4 CPUs this process may run
  // on, 1 to 4 (as kvcompd's data_plane.shm_copy_lanes). At most 16. Default 0.
  uint32_t shm_copy_lanes = 0;
  // DNS servers that resolve "dns:///" endpoints: "ip[:port]" or "[ipv6]:port", comma-separated
  // (e.g. "127.0.0.1:5353"). Empty (default): the system's, from /etc/resolv.conf, whose search
  // domains apply either way; /etc/hosts is read first either way.
  std::string dns_server;
  // How often "dns:///" endpoints are resolved again: zero (only at Connect and after a member
  // fails) or in [100 ms, 24 h]. Default 5 s (the TTL Kubernetes' DNS gives a headless
  // Service's records). Connect answers InvalidArgument for any option out of its range:
  // replicas [1, 64], attempts_per_endpoint [1, 100], max_block_bytes [4 KiB, 1 GiB],
  // connect_timeout [1 ms, 1 h], request_timeout [1 ms, 24 h], max_backoff [0, 10 min],
  // initial_backoff [0, max_backoff], down_for [0, 1 h], shm_copy_lanes [0, 16].
  absl::Duration dns_refresh_interval = absl::Seconds(5);
};

// One layer's K (or V) in host memory: [num_kv_heads, num_tokens, head_dim], dense, of the
// layout's dtype.
struct LayerData {
  const void* keys = nullptr;
  const void* values = nullptr;
};

struct PutResult {
  uint64_t original_bytes = 0;  // uncompressed K and V
  uint64_t stored_bytes = 0;    // the compressed cache as stored
  uint64_t total_kept = 0;      // kept tokens over all heads
  std::vector<std::string> endpoints;  // data addresses that acknowledged a copy
  // Device puts (PutDevice): "nccl" when the payload went over the GPU channel, "ucx" when it
  // went through host memory over the data plane; empty for host puts.
  std::string path;
  // GPU channel puts: seconds the payload's transfer took on the caller's stream.
  double transfer_seconds = 0;
};

// One layer's K and V in CUDA device memory, [num_kv_heads, num_tokens, head_dim] dense each,
// of the layout's dtype; all layers on one device.
struct DeviceLayerData {
  const void* keys = nullptr;
  const void* values = nullptr;
};
// Where a dense get writes one layer's K and V (device memory, the same shapes).
struct DeviceLayerOut {
  void* keys = nullptr;
  void* values = nullptr;
};

// What a device get delivered.
struct DeviceGetResult {
  size_t bytes = 0;     // written into the caller's memory
  std::string path;     // "nccl" or "ucx"
  double transfer_seconds = 0;  // GPU channel: the payload's transfer on the caller's stream
};

// The client's GPU channel counters (docs/protocol.md, "GPU channel"): how device puts and
// gets travelled, and the last reason a channel could not be used.
struct GpuChannelStats {
  uint64_t nccl_puts = 0;
  uint64_t nccl_gets = 0;
  uint64_t fallback_puts = 0;  // device puts sent through host memory over UCX
  uint64_t fallback_gets = 0;
  uint64_t ipc_puts = 0;  // device puts copied on the device over CUDA IPC (daemon on this GPU)
  uint64_t ipc_gets = 0;
  uint64_t channels_opened = 0;
  uint64_t channel_failures = 0;  // channels closed after a failed transfer
  std::string last_fallback_reason;
};

struct LookupResult {
  KvLayout layout;
  std::string endpoint;  // data address that answered
  std::string tier;      // "device", "host" or "disk"
  uint64_t original_tokens = 0;
  uint64_t total_kept = 0;
  uint64_t original_bytes = 0;
  uint64_t stored_bytes = 0;
  KeyCodec key_codec = KeyCodec::kRaw;
  ValueCodec value_codec = ValueCodec::kRaw;
};

struct EndpointStats {
  std::string endpoint;
  absl::Status status;  // why the numbers are missing, when not OK
  uint64_t caches = 0;          // this tenant's caches there
  uint64_t original_bytes = 0;  // this tenant's, uncompressed
  uint64_t stored_bytes = 0;    // this tenant's, as stored
  uint64_t queue_depth = 0;
};

// A KVSplice calibration on a daemon (its control plane's Calibrate): the daemon fits a value
// projection for (tenant, model) from up to `max_caches` caches it stores with raw values, and
// uses it for later puts whose policy asks for an orthogonal value codec.
struct CalibrateOptions {
  // orthogonal, orthogonal_int8, orthogonal_int4 (a KVSplice projection), or pq (the model's pq
  // calibration: the calibrated basis codec's keys' and values' bases, at key_bits / value_bits)
  std::string value_codec = "orthogonal_int8";
  uint32_t rank = 0;          // > 0: this rank for every layer (KVSplice)
  double error_budget = 0.0;  // rank 0: per-layer ranks meeting this relative value error
  uint32_t max_caches = 64;
  uint32_t key_bits = 3;      // pq: bits per key element (1..8)
  uint32_t value_bits = 2;    // pq: bits per value element (1..8)
};

struct CalibrateResult {
  std::string endpoint;
  absl::Status status;  // this endpoint's outcome
  uint64_t projection_version = 0;
  uint32_t rank = 0;                  // the largest per-layer rank
  std::vector<uint32_t> layer_ranks;  // the rank of each layer
  double achieved_error = 0.0;
  uint64_t caches_used = 0;
};

// Per call settings of a read (a get or a lookup).
struct ReadOptions {
  // The deadline of this call as a whole (every endpoint tried, retries and connecting
  // included): when no daemon has answered by then (stalled, overloaded, unreachable), the call
  // fails with DeadlineExceeded. Zero: the client's (ClientOptions::lookup_timeout for
  // LookupPrefix, get_timeout for the others). Otherwise in [1 ms, 24 h] (InvalidArgument).
  absl::Duration timeout = absl::ZeroDuration();
};

struct PutOptions {
  // The policy; empty: the tenant's default on the daemon.
  std::optional<CompressionPolicy> policy;
  // Compress block by block as blocks arrive (streaming prefill; PutStream only).
  bool block_wise = false;
};

// A put in progress, fed layer by layer (or token range by token range) as prefill produces
// the cache. Destroying an uncommitted stream aborts it (no half cache is ever visible).
class PutStream {
 public:
  virtual ~PutStream() = default;
  // Sends tokens [token_begin, token_begin + num_tokens) of `layer`: `keys` and `values` are
  // [num_kv_heads, num_tokens, head_dim] dense host arrays of the layout's dtype.
  virtual absl::Status Append(uint32_t layer, uint64_t token_begin, uint64_t num_tokens,
                              const void* keys, const void* values) = 0;
  // Sends a whole layer (all tokens).
  absl::Status AppendLayer(uint32_t layer, const void* keys, const void* values);
  // Stores the cache; returns what was stored. The stream is spent afterwards.
  virtual absl::StatusOr<PutResult> Commit() = 0;
  // Forgets the put on every endpoint. Idempotent.
  virtual absl::Status Abort() = 0;
  virtual const KvLayout& layout() const = 0;
  virtual uint64_t num_tokens() const = 0;
};

// A put from device memory fed one layer at a time as the engine produces it
// (Client::OpenDevicePutStream). Over an NCCL channel each layer's K and V are sent on the
// given stream when appended (after the work queued there), so the transfer overlaps the
// engine's later layers; otherwise (CUDA IPC, or host memory over UCX) they are taken at
// Commit. Either way a layer's memory must stay as it was until Commit returns. Destroying an
// uncommitted stream aborts the put (nothing is stored). One thread at a time.
class DevicePutStream {
 public:
  virtual ~DevicePutStream() = default;
  // Layer `layer`'s K and V: layers in order 0, 1, ... (InvalidArgument otherwise).
  virtual absl::Status AppendLayer(uint32_t layer, const DeviceLayerData& data, void* stream) = 0;
  // Stores the cache once every layer was appended (FailedPrecondition otherwise).
  virtual absl::StatusOr<PutResult> Commit() = 0;
  // "nccl" while layers go over the GPU channel as appended, else "ipc" or "ucx" (at Commit).
  virtual std::string path() const = 0;
};

// A dense get handed back one layer at a time (Client::OpenDeviceGetStream): over an NCCL
// channel the layers arrive in order on a stream of the SDK, and WaitLayer orders a caller's
// stream after one layer's arrival, so decode can start on layer 0 while later layers arrive.
// Otherwise (CUDA IPC, host memory) every layer is in place when the stream opens.
class DeviceGetStream {
 public:
  virtual ~DeviceGetStream() = default;
  // Makes `stream` wait (on the device, no host wait) until layer `layer` is in place.
  virtual absl::Status WaitLayer(uint32_t layer, void* stream) = 0;
  // Waits until every layer is in place (also ordered on the stream the get was opened with)
  // and ends the transfer. Destroying an unfinished stream finishes it.
  virtual absl::StatusOr<DeviceGetResult> Finish() = 0;
};

class Client {
 public:
  // Validates the options and endpoints and connects lazily (the first request to each
  // endpoint connects). Each endpoint is "host:port[,control_host:port]" or
  // "dns:///NAME:DATA_PORT[,CONTROL_PORT]"; the two kinds may be mixed. InvalidArgument for
  // malformed addresses or options (a malformed dns_server included). With `connect_now`, also
  // connects to the endpoints until one answers, and fails with the first endpoint's error when
  // none can be reached, or with Unavailable when the DNS names resolve to no address.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const std::vector<std::string>& endpoints, const ClientOptions& options = {},
      bool connect_now = true);
  virtual ~Client() = default;

  // Pushes a whole cache: `layers` holds layout.num_layers entries. Returns when every copy is
  // stored per the daemons' durability setting (at least one copy; fewer than `replicas` when
  // endpoints are down, as PutResult::endpoints says).
  virtual absl::StatusOr<PutResult> Put(absl::string_view model_id, absl::string_view key,
                                        const KvLayout& layout, uint64_t num_tokens,
                                        const std::vector<LayerData>& layers,
                                        const PutOptions& options = {}) = 0;
  // Starts a streamed put.
  virtual absl::StatusOr<std::unique_ptr<PutStream>> OpenPutStream(
      absl::string_view model_id, absl::string_view key, const KvLayout& layout,
      uint64_t num_tokens, const PutOptions& options = {}) = 0;

  // The compressed cache as stored (parsed and validated).
  // Reads end within their deadline (ReadOptions::timeout, else ClientOptions::get_timeout).
  virtual absl::StatusOr<CompressedCache> Get(absl::string_view model_id, absl::string_view key,
                                              const ReadOptions& read = {}) = 0;
  // The encoded bytes as stored (docs/format.md), unparsed.
  virtual absl::StatusOr<std::string> GetBytes(absl::string_view model_id,
                                               absl::string_view key,
                                               const ReadOptions& read = {}) = 0;
  // The kept tokens decoded by the daemon to the input dtype (raw codecs), parsed.
  virtual absl::StatusOr<CompressedCache> GetDecoded(absl::string_view model_id,
                                                     absl::string_view key,
                                                     const ReadOptions& read = {}) = 0;
  // The encoded bytes into caller memory `dst` of `capacity` bytes (host memory, or CUDA
  // device memory when `device` is set and UCX is CUDA-aware; otherwise Unimplemented).
  // Returns the bytes written; OutOfRange when the cache is larger.
  virtual absl::StatusOr<size_t> GetInto(absl::string_view model_id, absl::string_view key,
                                         void* dst, size_t capacity, bool device = false,
                                         const ReadOptions& read = {}) = 0;

  virtual absl::StatusOr<LookupResult> Lookup(absl::string_view model_id, absl::string_view key,
                                              const ReadOptions& read = {}) = 0;
  // Deletes every copy. NotFound when no endpoint had it.
  virtual absl::Status Delete(absl::string_view model_id, absl::string_view key) = 0;
  // Per endpoint statistics (Thrift control calls; endpoints without a control address report
  // Unimplemented in their status).
  virtual std::vector<EndpointStats> Stats() = 0;
  // Calibrates on every endpoint (each daemon learns from the caches it stores, so each has its
  // own projection version). One result per endpoint; endpoints without a control address
  // report Unimplemented. The call itself fails only with InvalidArgument (bad options).
  virtual absl::StatusOr<std::vector<CalibrateResult>> Calibrate(
      absl::string_view model_id, const CalibrateOptions& options) = 0;

  // Prefix and chunk reuse (docs/protocol.md, "Prefix and chunk reuse"). An engine stores a
  // prompt's cache as one cache per chunk of tokens (a Put per chunk, compressed on its own)
  // under keys it already computes: chained block hashes, chunk i's key naming the whole prefix
  // up to chunk i. Each chunk is placed by its own key's ranking, like any cache, so the chunks
  // of one prefix spread over the pool. Both calls below group `keys` by the endpoint each ranks
  // first and ask every endpoint involved once, in parallel, over its control address (one
  // Thrift request per endpoint per 1024 keys); an endpoint that cannot be reached is replaced
  // for its keys by the next endpoint of each key's ranking, and a key no endpoint can answer
  // for counts as missing. FailedPrecondition when a member has no control address;
  // InvalidArgument for an invalid key; the daemons' errors (Unauthenticated...) otherwise.
  // When no endpoint answers at all (every one down, stalled past the deadline, or not a
  // kvcompd control port), the call fails with that error instead of reporting a miss.
  // LookupPrefix returns within ClientOptions::lookup_timeout, GetChunks within get_timeout,
  // or either within the call's ReadOptions::timeout when given.
  //
  // How many leading `keys` of `model_id` this tenant has stored (0 for an empty list).
  virtual absl::StatusOr<size_t> LookupPrefix(absl::string_view model_id,
                                              const std::vector<std::string>& keys,
                                              const ReadOptions& read = {}) = 0;
  // The caches of the leading `keys` stored, in key order (as many as LookupPrefix would count,
  // fewer if one goes missing meanwhile): the stored bytes, parsed, or with `decoded` the kept
  // tokens decoded by the daemons to the input dtype (as GetDecoded). Chunks compose: their
  // token ranges follow each other and the moments of a run are the sum of its chunks'.
  virtual absl::StatusOr<std::vector<CompressedCache>> GetChunks(
      absl::string_view model_id, const std::vector<std::string>& keys, bool decoded = false,
      const ReadOptions& read = {}) = 0;
  // As GetChunks, unparsed (docs/format.md).
  virtual absl::StatusOr<std::vector<std::string>> GetChunkBytes(
      absl::string_view model_id, const std::vector<std::string>& keys, bool decoded = false,
      const ReadOptions& read = {}) = 0;

  // --- Device memory (docs/protocol.md, "GPU channel") ---
  // A put from CUDA device memory. `stream` is the caller's cudaStream_t (null: the legacy
  // default stream): the payload is read on it, after the work queued there before the call
  // (the producer's kernels), and nothing synchronises the device. The daemon ranked first is
  // asked for a GPU channel (NCCL, negotiated over the control plane; the channel is kept per
  // endpoint and device for later calls); where none can be had (no NCCL here or there, no
  // control address, the daemon on this GPU, the peer not reachable, more than one replica)
  // the payload is copied to host memory on `stream` and put over UCX, counted in
  // GpuStats().fallback_puts and logged once per endpoint and reason. InvalidArgument for
  // host pointers or pointers on different devices; FailedPrecondition without a CUDA driver.
  virtual absl::StatusOr<PutResult> PutDevice(absl::string_view model_id, absl::string_view key,
                                              const KvLayout& layout, uint64_t num_tokens,
                                              const std::vector<DeviceLayerData>& layers,
                                              void* stream, const PutOptions& options = {});
  // A cache that kept every token (ratio 0) as dense K and V, written into `layers` (device
  // memory of `layout` and `num_tokens`, which must match the cache's: InvalidArgument) on
  // `stream`: ordered after the work queued there, and work queued after the call sees the
  // data. FailedPrecondition for a cache that evicted tokens or encodes them (get it instead).
  virtual absl::StatusOr<DeviceGetResult> GetKvIntoDevice(
      absl::string_view model_id, absl::string_view key, const KvLayout& layout,
      uint64_t num_tokens, const std::vector<DeviceLayerOut>& layers, void* stream);
  // The cache's bytes as stored (docs/format.md), or decoded, into device memory `dst` of
  // `capacity` bytes on `stream`. OutOfRange when larger.
  virtual absl::StatusOr<DeviceGetResult> GetIntoDevice(absl::string_view model_id,
                                                        absl::string_view key, void* dst,
                                                        size_t capacity, void* stream,
                                                        bool decoded = false);
  // Negotiates (or reuses) the GPU channel to `endpoint` (a data address of this client's
  // members) for CUDA device `device`: OK when NCCL will carry payloads, else why not (the
  // reason device calls fall back with).
  virtual absl::Status ProbeGpuChannel(const std::string& endpoint, int device);
  virtual GpuChannelStats GpuStats() const;
  // Layer by layer (DevicePutStream, DeviceGetStream above): a put whose layers are on CUDA
  // device `device`, and a dense get into `layers` (as GetKvIntoDevice) ordered after `stream`.
  virtual absl::StatusOr<std::unique_ptr<DevicePutStream>> OpenDevicePutStream(
      absl::string_view model_id, absl::string_view key, const KvLayout& layout,
      uint64_t num_tokens, int device, const PutOptions& options = {});
  virtual absl::StatusOr<std::unique_ptr<DeviceGetStream>> OpenDeviceGetStream(
      absl::string_view model_id, absl::string_view key, const KvLayout& layout,
      uint64_t num_tokens, const std::vector<DeviceLayerOut>& layers, void* stream);

  // The endpoints in the order a key's reads and writes try them (rendezvous ranking over the
  // current members: empty while a DNS pool has none).
  virtual std::vector<std::string> Ranking(absl::string_view model_id,
                                           absl::string_view key) const = 0;
};

}  // namespace client
}  // namespace kvcomp

#endif  // KVCOMP_CLIENT_CLIENT_H_
