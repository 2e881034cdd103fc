// kvcomp control plane, version 1. Served by kvcompd with Thrift's nonblocking server:
// framed transport, binary protocol (TFramedTransport + TBinaryProtocol), optionally over TLS.
//
// Every call takes an Auth first; the daemon answers every call with a response whose `status`
// says what happened (calls never throw application exceptions). With tokens configured, a
// missing or wrong token is UNAUTHENTICATED and counted in kvcomp_auth_failures_total{plane=
// "control"}. A tenant only ever sees its own caches: another tenant's key reads as NOT_FOUND,
// exactly like a missing one. In open single-tenant mode (no tokens) every call is tenant
// "default" whatever the Auth says.
//
// Generate a client: thrift --gen cpp|py service/thrift/kvcomp.thrift

namespace cpp kvcomp.rpc
namespace py kvcomp_rpc

const i32 PROTOCOL_VERSION = 1

// absl's canonical codes (stable numbers); back-pressure is UNAVAILABLE with Status.detail 1.
enum StatusCode {
  OK = 0,
  CANCELLED = 1,
  UNKNOWN = 2,
  INVALID_ARGUMENT = 3,
  DEADLINE_EXCEEDED = 4,
  NOT_FOUND = 5,
  ALREADY_EXISTS = 6,
  PERMISSION_DENIED = 7,
  RESOURCE_EXHAUSTED = 8,
  FAILED_PRECONDITION = 9,
  ABORTED = 10,
  OUT_OF_RANGE = 11,
  UNIMPLEMENTED = 12,
  INTERNAL = 13,
  UNAVAILABLE = 14,
  DATA_LOSS = 15,
  UNAUTHENTICATED = 16,
}

// `detail` is what a caller decides on beyond the code (kvcomp::ErrorDetail's numbers: 1 busy,
// retry later; 2 the GPU channel named is gone, open another; 3 the offered memory cannot be
// mapped here, move the bytes another way; 4 the caller's own deadline, never sent by a daemon;
// 5 a tier's disk is full, writes resume when space returns); absent or 0 for none. Never match
// `message`.
struct Status {
  1: StatusCode code = StatusCode.OK,
  2: string message = "",
  3: optional i16 detail,
}

// Credentials sent with every call.
struct Auth {
  1: string tenant = "",  // empty = "default"
  2: string token = "",
}

struct Layout {
  1: i32 num_layers,
  2: i32 num_kv_heads,
  3: i32 num_q_heads,
  4: i32 head_dim,
  5: string dtype,  // "f32", "f16", "bf16"
}

// kvcomp::CompressionPolicy, field by field (enums by name, as in the YAML configuration). Its
// fields, ids and defaults follow core/include/kvcomp/core/policy_fields.def (ctest
// policy_fields_check compares them; service/src/policy_rpc.cc maps them).
struct Policy {
  1: string scorer = "manifold",
  2: double ratio = 0.5,
  3: i64 token_budget = 0,
  4: string head_budget = "uniform",
  5: double alpha_safeguard = 0.2,
  6: i64 n_sink = 4,
  7: i64 n_recent = 0,
  8: bool protect = true,
  9: i64 window = 4096,
  10: i64 snapkv_window = 64,
  11: i64 snapkv_pool = 5,
  12: i64 seed = 0,  // a uint64: its bit pattern (from 2^63 up it reads as negative here)
  13: i64 block_size = 0,
  14: bool moments = true,
  15: bool moment_aware = false,
  16: string key_codec = "raw",
  17: string value_codec = "none",
  18: i64 rank = 0,
  19: i64 group_size = 32,
  20: bool gamma_aware = true,
  21: double value_outlier_factor = 4.0,
  22: double value_raw_fraction = 0.02,
  // Share of each head's budget kept recent, in [0, 1). Unset means 0 (what clients from before
  // the field or before its default changed meant); a new policy's default is 0.75
  // (core/include/kvcomp/core/policy_absent.def).
  23: double recent_fraction = 0.0,
  24: i64 key_bits = 3,
  25: i64 value_bits = 2,
}

struct HealthResponse {
  1: Status status,
  2: bool live,     // the process serves requests
  3: bool ready,    // it takes new work (stores open, not draining)
  4: bool draining, // SIGTERM received: finishing in-flight work
  5: double uptime_seconds,
}

struct TierStats {
  1: string tier,  // "device", "host", "disk"
  2: i64 entries,
  3: i64 stored_bytes,
  4: i64 capacity_bytes,
  5: i64 hits,
  6: i64 misses,
  7: i64 demotions,
  8: i64 evictions,
}

struct StatsResponse {
  1: Status status,
  // The calling tenant's caches.
  2: i64 caches,
  3: i64 original_bytes,
  4: i64 stored_bytes,
  // Daemon-wide.
  5: list<TierStats> tiers,
  6: i64 queue_depth,
  7: i64 puts_in_progress,
  8: i64 puts_total,
  9: i64 gets_total,
  10: i64 errors_total,
}

struct CacheRef {
  1: string model_id,
  2: binary key,
}

struct LookupResponse {
  1: Status status,       // NOT_FOUND when absent (or another tenant's)
  2: string tier,         // where it is now
  3: i64 original_bytes,  // uncompressed K+V
  4: i64 stored_bytes,    // compressed, as stored
  5: i64 original_tokens,
  6: i64 kept_tokens,     // over all heads
  7: Layout layout,
  8: string key_codec,
  9: string value_codec,
}

struct DeleteResponse {
  1: Status status,  // NOT_FOUND when absent (or another tenant's)
}

struct ListResponse {
  1: Status status,
  2: list<CacheRef> caches,
  3: binary next_cursor,  // empty when done
}

struct PolicyResponse {
  1: Status status,
  2: Policy policy,
  3: bool is_default,  // no policy set for this tenant/model: the daemon's default_policy
}

struct CalibrateRequest {
  1: string model_id,
  2: string value_codec = "orthogonal_int8",
  3: i64 rank = 0,             // 0 = pick by error_budget
  4: double error_budget = 0,  // relative value reconstruction error, when rank is 0
  5: i64 max_caches = 64,      // stored caches of this tenant/model to calibrate on
  6: i32 key_bits = 3,         // value_codec "pq": bits per key element the keys' basis is fitted at
  7: i32 value_bits = 2,       // value_codec "pq": the same for the values' basis
}

struct CalibrateResponse {
  1: Status status,  // FAILED_PRECONDITION when no stored raw-value cache of the model exists
  2: i64 projection_version,  // value_codec "pq": the pq calibration's version
  3: i64 rank,  // the largest layer's
  4: double achieved_error,
  5: i64 caches_used,
  6: list<i32> layer_ranks,  // the latent rank each layer's values are encoded at
}

struct ServerInfoResponse {
  1: Status status,
  2: string version,
  3: i32 control_protocol_version,
  4: i32 data_protocol_version,
  5: string backend,       // "cpu (16 threads)", "cuda:0 NVIDIA H100 ..."
  6: bool multi_tenant,    // false: open single-tenant daemon
  7: string data_address,  // UCX listener, host:port
  8: i32 metrics_port,
  9: string durability,
  10: i64 max_put_bytes,
  11: i64 max_block_bytes,
  12: list<string> tiers,
}

// A cache the store quarantined: its bytes failed their checksum (at open or on a read), so it
// is never served; it stays aside until purged.
struct QuarantinedEntry {
  1: string model_id,  // "" when the stored key does not decode (open mode only)
  2: binary key,       // the cache key; the raw encoded store key when it does not decode
  3: string reason,    // what failed
}

struct ListQuarantinedResponse {
  1: Status status,
  2: list<QuarantinedEntry> entries,  // the calling tenant's, in store key order
  3: binary next_cursor,              // pass it back for the next page; empty when done
}

struct PurgeQuarantinedResponse {
  1: Status status,  // NOT_FOUND when no such entry is quarantined (or it is another tenant's)
  2: i64 purged,     // entries removed
}

// Prefix reuse: engines key a prompt's caches by chained block hashes (chunk i's key names the
// whole prefix up to chunk i) and store one cache per chunk of tokens. A request carries at most
// MAX_PREFIX_KEYS keys (the control plane's frame bound); clients split longer runs.
const i32 MAX_PREFIX_KEYS = 1024

struct LookupPrefixResponse {
  1: Status status,
  2: i32 held,  // how many leading keys this tenant has stored here, in order (0..len(keys))
}

struct GetChunksResponse {
  1: Status status,
  // The caches of the leading keys held, in key order, as stored (docs/format.md) or decoded;
  // stops at the first key not held, or once the bytes gathered pass max_bytes (at least one
  // cache whenever the first is held), so len(caches) <= len(keys).
  2: list<binary> caches,
  // True when it stopped for max_bytes or a failure after the first cache (busy serve queue,
  // unreadable entry): keys after the caches returned may still be held; ask again for them.
  3: bool truncated,
}

// GPU channel (docs/protocol.md, "GPU channel"): a client whose KV cache lives in GPU memory asks
// for a two-rank NCCL communicator between its GPU and the daemon's; the calls below carry the
// NCCL unique id (or, on the daemon's own GPU, a CUDA IPC event); puts and gets over the channel
// are data-plane requests that name it (docs/protocol.md), and NCCL or CUDA IPC carries only the
// payload. A channel belongs to the tenant that opened it: every call and every data-plane
// request that names it checks the caller's tenant (another tenant's channel reads as
// NOT_FOUND). One transfer at a time per channel.
struct GpuChannelRequest {
  1: i32 nccl_version,       // the client's NCCL version code (e.g. 22703); 0: no NCCL
  2: binary device_uuid,     // the client's CUDA device, 16 bytes (the same GPU as the daemon's
                             // cannot form a communicator: CUDA IPC, below, or FAILED_PRECONDITION)
  // CUDA IPC for a client on the daemon's own GPU: the handle (64 bytes) of an interprocess
  // event of the client's, recorded on the caller's stream before each transfer; the daemon's
  // copies wait for it. Set when the client can map memory over CUDA IPC.
  3: optional binary ipc_event,
  // True: the client sends its puts over the data plane, each put's K and V as one link block
  // that names the channel (data-plane protocol 1.4, docs/protocol.md). A daemon that takes
  // puts only that way refuses a channel to a client that does not say so (FAILED_PRECONDITION:
  // the client then uses the data plane's own links).
  4: optional bool data_plane_puts,
  // True: the client sends its gets over the data plane too, each a get that names the channel
  // (data-plane protocol 1.5). A daemon that serves channel gets only that way refuses a channel
  // to a client that does not say so (FAILED_PRECONDITION, as for data_plane_puts).
  5: optional bool data_plane_gets,
}

struct GpuChannelResponse {
  // UNAVAILABLE or FAILED_PRECONDITION: no GPU channel on this daemon (no CUDA device, no NCCL,
  // disabled, the client's own GPU); the message says why. The client then uses the data plane.
  1: Status status,
  2: i64 channel_id,
  3: binary nccl_unique_id,  // 128 bytes: the daemon is rank 0, the client joins as rank 1
  4: i32 nccl_version,       // the daemon's
  5: i32 daemon_device,      // CUDA ordinal of the daemon's GPU
  6: i64 max_transfer_bytes, // largest payload of one transfer
  7: i32 transfer_timeout_ms,
  8: optional string mode,   // "nccl" (unset: nccl) or "ipc" (same GPU: CUDA IPC, no unique id)
  9: optional bool data_plane_puts,  // the daemon takes this channel's puts as link blocks
                                     // (unset: an older daemon, which the client does not use)
  10: optional bool data_plane_gets, // the daemon serves this channel's gets as data-plane gets
                                     // (unset: an older daemon, which the client does not use)
}

struct GpuCloseResponse {
  1: Status status,
}


service KvcompControl {
  HealthResponse Health(1: Auth auth),
  StatsResponse Stats(1: Auth auth),
  LookupResponse Lookup(1: Auth auth, 2: CacheRef ref),
  DeleteResponse Delete(1: Auth auth, 2: CacheRef ref),
  // The tenant's caches, optionally of one model, in key order; cursor from the last response.
  ListResponse List(1: Auth auth, 2: string model_id, 3: binary cursor, 4: i32 limit),
  // model_id "" = the tenant's default for every model without its own.
  PolicyResponse GetPolicy(1: Auth auth, 2: string model_id),
  PolicyResponse SetPolicy(1: Auth auth, 2: string model_id, 3: Policy policy),
  CalibrateResponse Calibrate(1: Auth auth, 2: CalibrateRequest request),
  ServerInfoResponse ServerInfo(1: Auth auth),
  // The calling tenant's quarantined caches (every entry in open single-tenant mode, including
  // any whose stored key does not decode), a page at a time: at most `limit` entries (<= 0:
  // 1000; at most 10000) after `cursor` (empty: from the first), each reason cut at 1 KiB.
  ListQuarantinedResponse ListQuarantined(1: Auth auth, 2: binary cursor, 3: i32 limit),
  // Removes quarantined entries for good (durably): the one named by `ref` (a key that does not
  // decode: model_id "" and the raw key from ListQuarantined), or with `all` every entry
  // ListQuarantined lists for the caller (`ref` ignored).
  PurgeQuarantinedResponse PurgeQuarantined(1: Auth auth, 2: CacheRef ref, 3: bool all),
  // How many leading `keys` of `model_id` the calling tenant has stored on this daemon (another
  // tenant's read as absent). INVALID_ARGUMENT for an invalid key or more than MAX_PREFIX_KEYS.
  LookupPrefixResponse LookupPrefix(1: Auth auth, 2: string model_id, 3: list<binary> keys),
  // The leading caches of `keys` held here, in one request; `decoded` as the data plane's decoded
  // representation (the daemon decodes KVSplice latents and int8 keys to the input dtype).
  // max_bytes <= 0: 64 MiB.
  GetChunksResponse GetChunks(1: Auth auth, 2: string model_id, 3: list<binary> keys,
                              4: bool decoded, 5: i64 max_bytes),
  // GPU channel (docs/protocol.md). Opens a channel: the daemon starts forming the
  // communicator as rank 0 and the client joins with the returned id.
  GpuChannelResponse OpenGpuChannel(1: Auth auth, 2: GpuChannelRequest request),
  // Tears the channel down (its communicator destroyed). NOT_FOUND when not the caller's.
  GpuCloseResponse CloseGpuChannel(1: Auth auth, 2: i64 channel_id),
}
