// The kvcomp data-plane wire protocol, version 1.0: the messages that travel as UCX (ucp) active
// messages between a client and kvcompd. Described byte by byte in docs/protocol.md.
//
// Every message is one UCX active message. Its AM header holds a *frame*: a fixed 32-byte,
// little-endian frame header followed by a message-specific body (at most kMaxFrameBytes in
// all). Bulk bytes (a block's K and V, a fetched cache) travel in the AM data part, which UCX
// sends eagerly or by rendezvous; the frame header says how many (payload_bytes).
//
// Encode* functions build a frame from a message struct. ParseFrame checks the frame header
// (magic, major version, sizes, CRC32C of header and body) and Decode* checks every field of a
// body (lengths, ranges, enums, no trailing bytes); neither ever reads out of bounds. Malformed
// input is InvalidArgument (bad field), DataLoss (truncated, checksum), FailedPrecondition (a
// major version this build does not speak) or Unimplemented (an unknown message type).
//
// Thread-safety: everything here is a pure function or a value type.
#ifndef KVCOMP_TRANSPORT_PROTOCOL_H_
#define KVCOMP_TRANSPORT_PROTOCOL_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/core/policy.h"

namespace kvcomp {
namespace transport {
namespace wire {

inline constexpr uint32_t kMagic = 0x5057564B;  // "KVWP" in wire order
inline constexpr uint8_t kMajorVersion = 1;
// Minor 1 adds device payloads: hello-ok's server_flags (kServerCudaMemory, sent only to a
// client whose hello says minor >= 1) and block flag kBlockDevicePayload. Minor 2 adds
// same-host shared memory (kServerSharedMemory and its hello-ok fields, sent only to a client
// whose hello says minor >= 2; block flag kBlockSharedMemory; Get::shared and GetReply::shared).
// Minor 3 adds hello-ok's ucx_version (the server's UCX release, sent only to a client whose
// hello says minor >= 3) and Get::or_payload (a shared or direct get whose cache exceeds its
// capacity is answered with the cache as a payload instead of OutOfRange). Minor 4 adds block
// flag kBlockLinkPayload (the K and V move over a payload link negotiated outside the data plane,
// the GPU channel; the block's data part is the link's descriptor of the sender's memory), the
// link's seconds in a put-commit-ok after such blocks, the put-begin's link flag naming the
// channel, and typed error details in status
// replies to clients whose hello says minor >= 4. Minor 5 adds link gets (Get::link_channel:
// the cache moves over a payload link negotiated outside the data plane, the GPU channel; the
// get's data part is the link's descriptor of the caller's memory; the reply names the transfer
// and carries no payload).
inline constexpr uint8_t kMinorVersion = 5;
inline constexpr uint32_t kFrameHeaderBytes = 32;
// Largest frame (header + body). UCX 1.13 allows AM headers of about 8 KB with tcp and shared
// memory; servers and clients check their worker's limit at start. The largest message
// (a put-begin with the longest key and policy) needs about 2.3 KB.
inline constexpr uint32_t kMaxFrameBytes = 4096;
// Largest payload any message may announce (1 TiB); servers enforce a much smaller limit.
inline constexpr uint64_t kMaxPayloadBytes = uint64_t{1} << 40;
inline constexpr size_t kMaxTokenBytes = 2048;       // hello credentials
inline constexpr size_t kMaxNameBytes = 256;         // client and server names
inline constexpr size_t kMaxMessageBytes = 2048;     // error message text (longer is cut)
inline constexpr size_t kMaxPolicyBytes = 1024;      // policy TLV records

// UCX active-message ids: requests go client -> server, replies server -> client.
inline constexpr unsigned kAmIdRequest = 1;
inline constexpr unsigned kAmIdReply = 2;

// Message types (frame header byte 6). Never renumber.
enum class MessageType : uint8_t {
  kHello = 1,        // c->s: version (frame header), tenant, token
  kHelloOk = 2,      // s->c: accepted; server limits
  kPutBegin = 3,     // c->s: starts a put of one cache
  kBlock = 4,        // c->s: K and/or V of a layer range x token range; payload = K then V
  kPutCommit = 5,    // c->s: all blocks sent; store the cache
  kPutCommitOk = 6,  // s->c: stored (per the daemon's durability setting); what was stored
  kPutAbort = 7,     // c->s: forget a put
  kGet = 8,          // c->s: fetch a cache
  kGetReply = 9,     // s->c: payload = the cache bytes (format v1)
  kLookup = 10,      // c->s: does a cache exist, and what is it
  kLookupReply = 11,  // s->c: summary of the cache
  kDelete = 12,      // c->s: delete a cache
  kStatus = 13,      // s->c: OK or an error, for any request
  kBusy = 14,        // s->c: back-pressure; retry the request later
  kPing = 15,        // c->s: keep-alive; answered by kStatus OK
};
// Human-readable name ("hello", "block", ...), "unknown" for anything else.
absl::string_view MessageTypeName(MessageType type);
bool IsKnownMessageType(uint8_t value);

// Which bytes a get returns.
enum class Representation : uint8_t {
  kStored = 0,   // the compressed cache as stored (format v1, docs/format.md)
  kDecoded = 1,  // the kept tokens decoded to the input dtype: format v1 with raw codecs
};

// Which halves a block carries (bit set).
enum BlockParts : uint8_t {
  kPartKeys = 1,
  kPartValues = 2,
  kPartBoth = 3,
};

// Block flags (body byte 33).
enum BlockFlags : uint8_t {
  // The payload is sent from CUDA device memory over a CUDA-aware UCX: key_crc and value_crc
  // are 0 and not checked (the bytes never were in host memory to be summed; the transport's
  // links carry their integrity, docs/protocol.md). Only to a server that said
  // kServerCudaMemory.
  kBlockDevicePayload = 1,
  // The payload lies in the connection's shared put region (shm_link.h) at Block::shm_offset:
  // the frame announces no payload, key_crc and value_crc are 0 (the bytes never cross a
  // wire). Only to a server that said kServerSharedMemory.
  kBlockSharedMemory = 2,
  // The payload lies in the client's own memory (shm_link.h, direct mode): the keys at
  // Block::shm_offset, the values at Block::peer_values (addresses in the client's process);
  // no payload, no checksums. Only to a server that said kServerSharedMemory, on a connection
  // whose peer is registered.
  kBlockPeerMemory = 4,
  // The K and V move over a payload link the client and the server negotiated outside the
  // data plane (the GPU channel Block::link_channel, opened on the control plane): the frame's
  // data part is not the K and V but the link's descriptor of the client's memory
  // (Block::link_bytes of it: the CUDA IPC handles and offsets; empty over NCCL), and the
  // server posts the link's receive when the block arrives; no checksums (the link carries its
  // integrity). The client posts its side of the transfer after sending the block. Protocol
  // minor >= 4, only on a channel whose grant said so.
  kBlockLinkPayload = 8,
};
// The largest link descriptor a block may carry.
inline constexpr uint32_t kMaxLinkDescriptorBytes = 1 << 20;

// The fixed frame header. request_id pairs a reply with its request (the client chooses it;
// replies echo it; 0 in a reply means the request could not be parsed).
struct FrameHeader {
  uint8_t major = kMajorVersion;
  uint8_t minor = kMinorVersion;
  MessageType type = MessageType::kStatus;
  uint8_t flags = 0;  // reserved, 0
  uint64_t request_id = 0;
  uint64_t payload_bytes = 0;  // bytes of the AM data part
  uint32_t body_bytes = 0;     // bytes of the body after the header (frame = 32 + body_bytes)
};

// A frame checked by ParseFrame; `body` points into the caller's bytes.
struct Frame {
  FrameHeader header;
  absl::string_view body;
};

// ---- message bodies ----

struct Hello {
  std::string tenant;       // as in CacheKey (empty = "default")
  std::string token;        // credential, <= kMaxTokenBytes
  std::string client_name;  // free text for logs, <= kMaxNameBytes
};

// hello-ok server_flags (byte 2 of the body; 0 for a client whose hello said minor 0).
enum ServerFlags : uint8_t {
  // The server's UCX is CUDA-aware (cuda_copy / cuda_ipc) and it takes blocks sent from device
  // memory (kBlockDevicePayload): rendezvous payloads may land straight in its GPU memory.
  kServerCudaMemory = 1,
  // The server takes same-host shared memory (shm_link.h): hello-ok carries the Unix socket to
  // attach regions at and this connection's attach token.
  kServerSharedMemory = 2,
};

struct HelloOk {
  uint8_t server_major = kMajorVersion;
  uint8_t server_minor = kMinorVersion;
  uint8_t server_flags = 0;  // ServerFlags
  uint64_t max_payload_bytes = 0;   // largest block payload the server accepts
  uint64_t max_inflight_bytes = 0;  // bytes of unacknowledged blocks per connection
  std::string tenant;               // the tenant this connection acts for (normalised)
  std::string server_name;          // e.g. "kvcompd 0.1.0 host"
  // With kServerSharedMemory only: the abstract Unix socket name (without its leading NUL) where
  // this connection attaches shared regions, the connection's attach token (kShmTokenBytes
  // random bytes) and the largest region the server maps.
  std::string shm_socket;
  std::string shm_token;
  uint64_t shm_max_region_bytes = 0;
  // The server's UCX release (ucp_get_version), for a client whose hello says minor >= 3; all
  // zero from an older server or to an older client.
  uint8_t ucx_major = 0;
  uint8_t ucx_minor = 0;
  uint8_t ucx_release = 0;
};
inline constexpr size_t kShmTokenBytes = 16;

// Starts put `put_id` (chosen by the client, unique among its open puts on this connection).
// The tenant is the connection's authenticated tenant; it is not sent again.
struct PutBegin {
  uint64_t put_id = 0;
  KvLayout layout;
  uint64_t num_tokens = 0;  // tokens of the sequence, 1..KvLayout::kMaxTokens
  std::string model_id;
  std::string key;
  bool has_policy = false;  // false: the tenant's default policy
  // Decoded from its TLV records (format::DecodePolicyRecords); whether it suits the layout
  // (rank and groups against head_dim) is for the receiver to check.
  CompressionPolicy policy;
  bool block_wise = false;  // compress block by block as blocks arrive (streaming prefill)
  // Minor >= 4: the put's K and V come as a link block over this GPU channel (0: none); the
  // server places the put where the channel is.
  uint64_t link_channel = 0;
};

// Keys and/or values of layers [layer_begin, layer_end) x tokens [token_begin, token_end). Each
// half is laid out [layer][kv_head][token][head_dim] row-major in the layout's dtype, and the
// payload is K (if present) followed by V (if present). Blocks may come in any order.
struct Block {
  uint64_t put_id = 0;
  uint32_t layer_begin = 0;
  uint32_t layer_end = 0;
  uint64_t token_begin = 0;
  uint64_t token_end = 0;
  uint8_t parts = kPartBoth;  // BlockParts
  uint64_t key_bytes = 0;     // 0 when kPartKeys is absent
  uint64_t value_bytes = 0;   // 0 when kPartValues is absent
  uint32_t key_crc = 0;       // CRC32C of the key bytes (0 when absent)
  uint32_t value_crc = 0;     // CRC32C of the value bytes (0 when absent)
  uint8_t flags = 0;          // BlockFlags
  uint64_t shm_offset = 0;    // kBlockSharedMemory: the payload's offset in the put region;
                              // kBlockPeerMemory: the keys' address in the client
  uint64_t peer_values = 0;   // kBlockPeerMemory: the values' address in the client
  uint64_t link_channel = 0;  // kBlockLinkPayload: the link (GPU channel id)
  uint32_t link_bytes = 0;    // kBlockLinkPayload: the descriptor's bytes (the frame's data)
  bool link_layer_major = false;  // kBlockLinkPayload: regions in order K0, V0, K1, V1, ...
                                  // (else every layer's keys, then every layer's values)

  uint64_t payload_bytes() const { return key_bytes + value_bytes; }
  // The bytes of the frame's data part: the K and V, the link descriptor of a link block, or
  // none (shared or peer memory).
  uint64_t wire_bytes() const;
  // Bytes the half of one part should have under `layout`.
  uint64_t ExpectedPartBytes(const KvLayout& layout) const;
  // OK when the ranges lie within layout/num_tokens and the byte counts match them.
  absl::Status ValidateAgainst(const KvLayout& layout, uint64_t num_tokens) const;
  // Byte offsets in the payload of layer `layer`'s keys and values, [num_kv_heads][tokens]
  // [head_dim] each (a block that passed ValidateAgainst; layer_begin <= layer < layer_end).
  uint64_t KeyOffset(const KvLayout& layout, uint32_t layer) const;
  uint64_t ValueOffset(const KvLayout& layout, uint32_t layer) const;
};

struct PutCommit {
  uint64_t put_id = 0;
  uint64_t num_blocks = 0;  // blocks the client had acknowledged for this put
};

// What a stored cache is (commit and lookup replies).
struct CacheSummary {
  KvLayout layout;
  KeyCodec key_codec = KeyCodec::kRaw;
  ValueCodec value_codec = ValueCodec::kRaw;
  uint8_t tier = 0;  // storage tier holding it (daemon-defined: 0 device, 1 host, 2 disk)
  uint64_t original_tokens = 0;
  uint64_t total_kept = 0;
  uint64_t original_bytes = 0;  // uncompressed K and V
  uint64_t stored_bytes = 0;    // encoded cache
  // kPutCommitOk of a put whose blocks came over a link (kBlockLinkPayload, minor >= 4): the
  // nanoseconds those transfers took on the server's side; sent only when not 0 (so only to
  // clients that sent link blocks).
  uint64_t link_ns = 0;
};

struct PutAbort {
  uint64_t put_id = 0;
};

struct Get {
  Representation representation = Representation::kStored;
  std::string model_id;
  std::string key;
  // Shared memory (kServerSharedMemory): the server writes the cache into the connection's
  // shared get region at [shm_offset, shm_offset + shm_capacity) instead of a reply payload.
  bool shared = false;
  uint64_t shm_offset = 0;
  uint64_t shm_capacity = 0;
  // Direct mode: shm_offset is the address of the caller's destination in the client's
  // process (not the get region); the reply is as for `shared`.
  bool direct = false;
  // With `shared` or `direct` (minor >= 3): a cache larger than shm_capacity comes back as the
  // reply's payload (as a get without either flag) instead of OutOfRange, in the same request.
  bool or_payload = false;
  // Minor >= 5: the cache goes to the caller over payload link `link_channel` (a GPU channel
  // opened outside the data plane), not as the reply's payload: the stored or decoded bytes
  // whole, or (`link_dense`) the dense K and V, every layer's keys then every layer's values or
  // (`link_layer_major`) K0, V0, K1, V1, ...; at most `link_capacity` bytes. The frame's data
  // part is the link's descriptor of the caller's memory (`link_bytes` of it: CUDA IPC handles
  // and regions; empty over NCCL). Not with `shared` or `direct`.
  uint64_t link_channel = 0;
  uint64_t link_capacity = 0;
  bool link_dense = false;
  bool link_layer_major = false;
  uint32_t link_bytes = 0;
};

struct GetReply {
  Representation representation = Representation::kStored;
  bool has_crc = false;     // payload_crc is meaningful
  uint32_t payload_crc = 0;  // CRC32C of the payload
  // The cache was written into the shared get region (Get::shared): shm_bytes of it, no
  // payload, no checksum.
  bool shared = false;
  uint64_t shm_bytes = 0;
  // A link get's answer (Get::link_channel): the transfer of `link_payload_bytes` is posted on
  // the link (over NCCL the caller posts its receive now; over CUDA IPC the bytes are in the
  // caller's memory already, in `link_ns`); no payload, no checksum. `layout` and `num_tokens`
  // are the cache's (absent, num_layers 0, for bytes that are not a kvcomp cache).
  bool link = false;
  uint64_t link_payload_bytes = 0;
  KvLayout layout;
  uint64_t num_tokens = 0;
  uint64_t link_ns = 0;
};

struct Lookup {
  std::string model_id;
  std::string key;
};

struct Delete {
  std::string model_id;
  std::string key;
};

// A request's outcome. `code` is kvcomp::StatusCodeToWire(absl code).
struct StatusReply {
  uint16_t code = 0;
  std::string message;  // <= kMaxMessageBytes
  // The status's typed detail (kvcomp::ErrorDetailToWire: busy, link gone, memory not mappable,
  // ...), after the message; sent only when not 0, and only to clients whose hello said minor
  // >= 4.
  uint16_t detail = 0;
  absl::Status ToStatus() const;
  static StatusReply FromStatus(const absl::Status& status);
};

struct Busy {
  uint32_t retry_after_us = 0;  // suggested wait before retrying
  uint64_t inflight_bytes = 0;  // bytes in flight on this connection when refused
  uint64_t limit_bytes = 0;     // the connection's bound
};

struct Ping {};

// ---- frames ----

// Checks the frame header and CRC of `frame` (the AM header bytes) and that it announces
// `payload_bytes` (the AM data length). The returned body points into `frame`.
absl::StatusOr<Frame> ParseFrame(absl::string_view frame, uint64_t payload_bytes);
// Peeks the request id of a frame whose header is readable (for error replies to frames that
// fail ParseFrame); 0 when the header itself is unreadable.
uint64_t PeekRequestId(absl::string_view frame);

// Encoders: a complete frame (header + body) for `request_id`. payload_bytes is the data part
// that will travel with it (blocks and get replies; 0 otherwise).
std::string Encode(uint64_t request_id, const Hello& m);
std::string Encode(uint64_t request_id, const HelloOk& m);
std::string Encode(uint64_t request_id, const PutBegin& m);
std::string Encode(uint64_t request_id, const Block& m);  // payload = m.payload_bytes()
std::string Encode(uint64_t request_id, const PutCommit& m);
std::string Encode(uint64_t request_id, const CacheSummary& m);  // a kPutCommitOk
std::string EncodeLookupReply(uint64_t request_id, const CacheSummary& m);
std::string Encode(uint64_t request_id, const PutAbort& m);
std::string Encode(uint64_t request_id, const Get& m);  // payload = m.link_bytes
std::string Encode(uint64_t request_id, const GetReply& m, uint64_t payload_bytes);
std::string Encode(uint64_t request_id, const Lookup& m);
std::string Encode(uint64_t request_id, const Delete& m);
std::string Encode(uint64_t request_id, const StatusReply& m);
std::string Encode(uint64_t request_id, const Busy& m);
std::string Encode(uint64_t request_id, const Ping& m);

// Decoders: check frame.header.type and every field of the body. CacheSummary accepts both
// kPutCommitOk and kLookupReply.
absl::Status Decode(const Frame& frame, Hello* out);
absl::Status Decode(const Frame& frame, HelloOk* out);
absl::Status Decode(const Frame& frame, PutBegin* out);
absl::Status Decode(const Frame& frame, Block* out);
absl::Status Decode(const Frame& frame, PutCommit* out);
absl::Status Decode(const Frame& frame, CacheSummary* out);
absl::Status Decode(const Frame& frame, PutAbort* out);
absl::Status Decode(const Frame& frame, Get* out);
absl::Status Decode(const Frame& frame, GetReply* out);
absl::Status Decode(const Frame& frame, Lookup* out);
absl::Status Decode(const Frame& frame, Delete* out);
absl::Status Decode(const Frame& frame, StatusReply* out);
absl::Status Decode(const Frame& frame, Busy* out);
absl::Status Decode(const Frame& frame, Ping* out);

}  // namespace wire
}  // namespace transport
}  // namespace kvcomp

#endif  // KVCOMP_TRANSPORT_PROTOCOL_H_
