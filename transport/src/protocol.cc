#include "kvcomp/transport/protocol.h"

#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvcomp/core/byte_coder.h"
#include "kvcomp/core/cache_key.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace transport {
namespace wire {
namespace {

// Frame header offsets (docs/protocol.md).
constexpr size_t kOffMagic = 0;
constexpr size_t kOffMajor = 4;
constexpr size_t kOffMinor = 5;
constexpr size_t kOffType = 6;
constexpr size_t kOffFlags = 7;
constexpr size_t kOffRequestId = 8;
constexpr size_t kOffPayload = 16;
constexpr size_t kOffBodyBytes = 24;
constexpr size_t kOffCrc = 28;

constexpr uint8_t kPutFlagBlockWise = 1;
constexpr uint8_t kPutFlagHasPolicy = 2;
constexpr uint8_t kPutFlagLink = 4;  // minor 4: link_channel follows the policy
constexpr uint8_t kGetFlagHasCrc = 1;
constexpr uint8_t kGetFlagShared = 2;
constexpr uint8_t kGetFlagDirect = 4;
constexpr uint8_t kGetFlagOrPayload = 8;
constexpr uint8_t kGetFlagLink = 16;  // minor 5: a link get / its answer

using Writer = byte_coder::ByteWriter;
using byte_coder::LoadLe;
using byte_coder::StoreLe;

// Bounds-checked reading of a body; errors read "protocol: <message type>: ...".
class Reader : public byte_coder::ByteReader {
 public:
  Reader(absl::string_view body, MessageType type)
      : ByteReader(body, "protocol", MessageTypeName(type)) {}
};

std::string MakeFrame(MessageType type, uint64_t request_id, uint64_t payload_bytes,
                  absl::string_view body) {
  std::string f(kFrameHeaderBytes, '\0');
  auto put = [&f](size_t off, auto v) { StoreLe(f.data(), off, v); };
  put(kOffMagic, kMagic);
  put(kOffMajor, kMajorVersion);
  put(kOffMinor, kMinorVersion);
  put(kOffType, static_cast<uint8_t>(type));
  put(kOffFlags, uint8_t{0});
  put(kOffRequestId, request_id);
  put(kOffPayload, payload_bytes);
  put(kOffBodyBytes, static_cast<uint32_t>(body.size()));
  f.append(body.data(), body.size());
  uint32_t crc = Crc32cExtend(0, f.data(), kOffCrc);
  crc = Crc32cExtend(crc, f.data() + kFrameHeaderBytes, body.size());
  put(kOffCrc, crc);
  return f;
}

absl::Status ExpectType(const Frame& frame, MessageType want) {
  if (frame.header.type == want) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("protocol: expected a ", MessageTypeName(want),
                                                 " message, got ",
                                                 MessageTypeName(frame.header.type)));
}

absl::Status ExpectNoPayload(const Frame& frame) {
  if (frame.header.payload_bytes == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("protocol: %s carries no payload, %u bytes announced",
                      MessageTypeName(frame.header.type), frame.header.payload_bytes));
}

// Model id and key of a cache (the tenant comes from the connection).
void PutKey(Writer& w, absl::string_view model_id, absl::string_view key) {
  w.Str(model_id);
  w.Str(key);
}
void GetKey(Reader& r, std::string* model_id, std::string* key) {
  *model_id = r.Str("model_id", CacheKey::kMaxModelBytes);
  *key = r.Str("key", CacheKey::kMaxKeyBytes);
  if (!r.ok()) return;
  CacheKey k{"default", *model_id, *key};
  if (absl::Status s = k.Validate(); !s.ok()) {
    r.Fail(absl::InvalidArgumentError(r.Prefix(s.message())));
  }
}

std::string Cut(absl::string_view s, size_t max) {
  return std::string(s.substr(0, std::min(s.size(), max)));
}

void PutLayout(Writer& w, const KvLayout& l) {
  w.Put<uint32_t>(l.num_layers);
  w.Put<uint32_t>(l.num_kv_heads);
  w.Put<uint32_t>(l.num_q_heads);
  w.Put<uint32_t>(l.head_dim);
  w.Put<uint8_t>(static_cast<uint8_t>(l.dtype));
}
KvLayout GetLayout(Reader& r) {
  KvLayout l;
  l.num_layers = r.Get<uint32_t>("num_layers");
  l.num_kv_heads = r.Get<uint32_t>("num_kv_heads");
  l.num_q_heads = r.Get<uint32_t>("num_q_heads");
  l.head_dim = r.Get<uint32_t>("head_dim");
  const uint8_t dtype = r.Get<uint8_t>("dtype");
  if (!r.ok()) return l;
  if (!IsValidDType(dtype)) {
    r.Fail(absl::InvalidArgumentError(r.Prefix(absl::StrFormat("unknown dtype %u", dtype))));
    return l;
  }
  l.dtype = static_cast<DType>(dtype);
  if (absl::Status s = l.Validate(); !s.ok()) {
    r.Fail(absl::InvalidArgumentError(r.Prefix(s.message())));
  }
  return l;
}

void PutSummary(Writer& w, const CacheSummary& m) {
  PutLayout(w, m.layout);
  w.Put<uint8_t>(static_cast<uint8_t>(m.key_codec));
  w.Put<uint8_t>(static_cast<uint8_t>(m.value_codec));
  w.Put<uint8_t>(m.tier);
  w.Put<uint64_t>(m.original_tokens);
  w.Put<uint64_t>(m.total_kept);
  w.Put<uint64_t>(m.original_bytes);
  w.Put<uint64_t>(m.stored_bytes);
}

}  // namespace

absl::string_view MessageTypeName(MessageType type) {
  switch (type) {
    case MessageType::kHello:
      return "hello";
    case MessageType::kHelloOk:
      return "hello-ok";
    case MessageType::kPutBegin:
      return "put-begin";
    case MessageType::kBlock:
      return "block";
    case MessageType::kPutCommit:
      return "put-commit";
    case MessageType::kPutCommitOk:
      return "put-commit-ok";
    case MessageType::kPutAbort:
      return "put-abort";
    case MessageType::kGet:
      return "get";
    case MessageType::kGetReply:
      return "get-reply";
    case MessageType::kLookup:
      return "lookup";
    case MessageType::kLookupReply:
      return "lookup-reply";
    case MessageType::kDelete:
      return "delete";
    case MessageType::kStatus:
      return "status";
    case MessageType::kBusy:
      return "busy";
    case MessageType::kPing:
      return "ping";
  }
  return "unknown";
}

bool IsKnownMessageType(uint8_t value) {
  return value >= static_cast<uint8_t>(MessageType::kHello) &&
         value <= static_cast<uint8_t>(MessageType::kPing);
}

// ---- Block ----

uint64_t Block::wire_bytes() const {
  if (flags & (kBlockSharedMemory | kBlockPeerMemory)) return 0;
  if (flags & kBlockLinkPayload) return link_bytes;
  return payload_bytes();
}

uint64_t Block::ExpectedPartBytes(const KvLayout& layout) const {
  if (layer_end <= layer_begin || token_end <= token_begin) return 0;
  return uint64_t{layer_end - layer_begin} * layout.LayerBytes(token_end - token_begin);
}

uint64_t Block::KeyOffset(const KvLayout& layout, uint32_t layer) const {
  return uint64_t{layer - layer_begin} * layout.LayerBytes(token_end - token_begin);
}

uint64_t Block::ValueOffset(const KvLayout& layout, uint32_t layer) const {
  return key_bytes + KeyOffset(layout, layer);
}

absl::Status Block::ValidateAgainst(const KvLayout& layout, uint64_t num_tokens) const {
  if (layer_end > layout.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "block: layers [%u, %u) beyond the layout's %u layers", layer_begin, layer_end,
        layout.num_layers));
  }
  if (token_end > num_tokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "block: tokens [%u, %u) beyond the put's %u tokens", token_begin, token_end, num_tokens));
  }
  const uint64_t want = ExpectedPartBytes(layout);
  if ((parts & kPartKeys) && key_bytes != want) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "block: %u key bytes, layers [%u, %u) x tokens [%u, %u) of %s need %u", key_bytes,
        layer_begin, layer_end, token_begin, token_end, layout.DebugString(), want));
  }
  if ((parts & kPartValues) && value_bytes != want) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "block: %u value bytes, layers [%u, %u) x tokens [%u, %u) of %s need %u", value_bytes,
        layer_begin, layer_end, token_begin, token_end, layout.DebugString(), want));
  }
  return absl::OkStatus();
}

// ---- StatusReply ----

absl::Status StatusReply::ToStatus() const {
  const absl::StatusCode c = StatusCodeFromWire(code);
  if (c == absl::StatusCode::kOk) return absl::OkStatus();
  return WithDetail(absl::Status(c, message), ErrorDetailFromWire(detail));
}

StatusReply StatusReply::FromStatus(const absl::Status& status) {
  StatusReply r;
  r.code = StatusCodeToWire(status.code());
  r.message = Cut(status.message(), kMaxMessageBytes);
  r.detail = ErrorDetailToWire(DetailOf(status));
  return r;
}

// ---- frames ----

absl::StatusOr<Frame> ParseFrame(absl::string_view frame, uint64_t payload_bytes) {
  if (frame.size() < kFrameHeaderBytes) {
    return absl::DataLossError(absl::StrFormat(
        "protocol: frame of %u bytes is shorter than the %u-byte header", frame.size(),
        kFrameHeaderBytes));
  }
  auto get = [&frame](size_t off, auto* v) {
    *v = LoadLe<std::remove_pointer_t<decltype(v)>>(frame.data(), off);
  };
  uint32_t magic, body_bytes, crc;
  uint8_t type, flags;
  Frame f;
  get(kOffMagic, &magic);
  get(kOffMajor, &f.header.major);
  get(kOffMinor, &f.header.minor);
  get(kOffType, &type);
  get(kOffFlags, &flags);
  get(kOffRequestId, &f.header.request_id);
  get(kOffPayload, &f.header.payload_bytes);
  get(kOffBodyBytes, &body_bytes);
  get(kOffCrc, &crc);
  if (magic != kMagic) {
    return absl::InvalidArgumentError(
        absl::StrFormat("protocol: bad magic 0x%08x (want 0x%08x)", magic, kMagic));
  }
  if (frame.size() > kMaxFrameBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "protocol: frame of %u bytes exceeds the %u-byte limit", frame.size(), kMaxFrameBytes));
  }
  if (uint64_t{body_bytes} + kFrameHeaderBytes != frame.size()) {
    return absl::DataLossError(absl::StrFormat(
        "protocol: frame announces a %u-byte body, %u bytes present", body_bytes,
        frame.size() - kFrameHeaderBytes));
  }
  const uint32_t want = Crc32cExtend(Crc32cExtend(0, frame.data(), kOffCrc),
                                     frame.data() + kFrameHeaderBytes, body_bytes);
  if (crc != want) {
    return absl::DataLossError(absl::StrFormat(
        "protocol: frame checksum mismatch (0x%08x stored, 0x%08x computed)", crc, want));
  }
  if (f.header.major != kMajorVersion) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "protocol: version %u.%u not supported (this side speaks %u.%u)", f.header.major,
        f.header.minor, kMajorVersion, kMinorVersion));
  }
  if (!IsKnownMessageType(type)) {
    return absl::UnimplementedError(absl::StrFormat("protocol: unknown message type %u", type));
  }
  if (flags != 0) {
    return absl::InvalidArgumentError(absl::StrFormat("protocol: reserved flags 0x%02x set",
                                                      flags));
  }
  f.header.type = static_cast<MessageType>(type);
  f.header.flags = flags;
  f.header.body_bytes = body_bytes;
  if (f.header.payload_bytes > kMaxPayloadBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "protocol: payload of %u bytes exceeds the protocol limit", f.header.payload_bytes));
  }
  if (f.header.payload_bytes != payload_bytes) {
    return absl::DataLossError(absl::StrFormat(
        "protocol: %s announces %u payload bytes, %u arrived", MessageTypeName(f.header.type),
        f.header.payload_bytes, payload_bytes));
  }
  f.body = frame.substr(kFrameHeaderBytes);
  return f;
}

uint64_t PeekRequestId(absl::string_view frame) {
  if (frame.size() < kFrameHeaderBytes) return 0;
  if (LoadLe<uint32_t>(frame.data(), kOffMagic) != kMagic) return 0;
  return LoadLe<uint64_t>(frame.data(), kOffRequestId);
}

// ---- encoders ----

std::string Encode(uint64_t request_id, const Hello& m) {
  Writer w;
  w.Str(Cut(m.tenant, CacheKey::kMaxTenantBytes));
  w.Str(Cut(m.token, kMaxTokenBytes));
  w.Str(Cut(m.client_name, kMaxNameBytes));
  return MakeFrame(MessageType::kHello, request_id, 0, w.Take());
}

std::string Encode(uint64_t request_id, const HelloOk& m) {
  Writer w;
  w.Put<uint8_t>(m.server_major);
  w.Put<uint8_t>(m.server_minor);
  w.Put<uint8_t>(m.server_flags);
  w.Put<uint8_t>(m.ucx_major);
  w.Put<uint8_t>(m.ucx_minor);
  w.Put<uint8_t>(m.ucx_release);
  w.Zeros(2);
  w.Put<uint64_t>(m.max_payload_bytes);
  w.Put<uint64_t>(m.max_inflight_bytes);
  w.Str(Cut(m.tenant, CacheKey::kMaxTenantBytes));
  w.Str(Cut(m.server_name, kMaxNameBytes));
  if (m.server_flags & kServerSharedMemory) {
    w.Str(Cut(m.shm_socket, kMaxNameBytes));
    w.Str(Cut(m.shm_token, kShmTokenBytes));
    w.Put<uint64_t>(m.shm_max_region_bytes);
  }
  return MakeFrame(MessageType::kHelloOk, request_id, 0, w.Take());
}

std::string Encode(uint64_t request_id, const PutBegin& m) {
  Writer w;
  w.Put<uint64_t>(m.put_id);
  w.Put<uint64_t>(m.num_tokens);
  PutLayout(w, m.layout);
  uint8_t flags = 0;
  if (m.block_wise) flags |= kPutFlagBlockWise;
  if (m.has_policy) flags |= kPutFlagHasPolicy;
  if (m.link_channel != 0) flags |= kPutFlagLink;
  w.Put<uint8_t>(flags);
  w.Zeros(2);
  PutKey(w, Cut(m.model_id, CacheKey::kMaxModelBytes), Cut(m.key, CacheKey::kMaxKeyBytes));
  const std::string policy = m.has_policy ? format::EncodePolicyRecords(m.policy) : "";
  w.Put<uint16_t>(static_cast<uint16_t>(policy.size()));
  w.Raw(policy);
  if (m.link_channel != 0) w.Put<uint64_t>(m.link_channel);
  return MakeFrame(MessageType::kPutBegin, request_id, 0, w.Take());
}

std::string Encode(uint64_t request_id, const Block& m) {
  Writer w;
  w.Put<uint64_t>(m.put_id);
  w.Put<uint32_t>(m.layer_begin);
  w.Put<uint32_t>(m.layer_end);
  w.Put<uint64_t>(m.token_begin);
  w.Put<uint64_t>(m.token_end);
  w.Put<uint8_t>(m.parts);
  w.Put<uint8_t>(m.flags);
  w.Zeros(2);
  w.Put<uint32_t>(m.key_crc);
  w.Put<uint32_t>(m.value_crc);
  w.Zeros(4);
  w.Put<uint64_t>(m.key_bytes);
  w.Put<uint64_t>(m.value_bytes);
  const bool shared = (m.flags & (kBlockSharedMemory | kBlockPeerMemory)) != 0;
  if (shared) w.Put<uint64_t>(m.shm_offset);
  if (m.flags & kBlockPeerMemory) w.Put<uint64_t>(m.peer_values);
  if (m.flags & kBlockLinkPayload) {
    w.Put<uint64_t>(m.link_channel);
    w.Put<uint32_t>(m.link_bytes);
    w.Put<uint8_t>(m.link_layer_major ? 1 : 0);
    w.Zeros(3);
  }
  return MakeFrame(MessageType::kBlock, request_id, m.wire_bytes(), w.Take());
}

std::string Encode(uint64_t request_id, const PutCommit& m) {
  Writer w;
  w.Put<uint64_t>(m.put_id);
  w.Put<uint64_t>(m.num_blocks);
  return MakeFrame(MessageType::kPutCommit, request_id, 0, w.Take());
}

std::string Encode(uint64_t request_id, const CacheSummary& m) {
  Writer w;
  PutSummary(w, m);
  if (m.link_ns != 0) w.Put<uint64_t>(m.link_ns);
  return MakeFrame(MessageType::kPutCommitOk, request_id, 0, w.Take());
}

std::string EncodeLookupReply(uint64_t request_id, const CacheSummary& m) {
  Writer w;
  PutSummary(w, m);
  return MakeFrame(MessageType::kLookupReply, request_id, 0, w.Take());
}

std::string Encode(uint64_t request_id, const PutAbort& m) {
  Writer w;
  w.Put<uint64_t>(m.put_id);
  return MakeFrame(MessageType::kPutAbort, request_id, 0, w.Take());
}

std::string Encode(uint64_t request_id, const Get& m) {
  Writer w;
  w.Put<uint8_t>(static_cast<uint8_t>(m.representation));
  uint8_t flags = m.direct ? kGetFlagDirect : (m.shared ? kGetFlagShared : 0);
  if (flags != 0 && m.or_payload) flags |= kGetFlagOrPayload;
  if (m.link_channel != 0) flags |= kGetFlagLink;
  w.Put<uint8_t>(flags);
  w.Zeros(2);
  PutKey(w, Cut(m.model_id, CacheKey::kMaxModelBytes), Cut(m.key, CacheKey::kMaxKeyBytes));
  if (m.shared || m.direct) {
    w.Put<uint64_t>(m.shm_offset);
    w.Put<uint64_t>(m.shm_capacity);
  }
  if (m.link_channel != 0) {
    w.Put<uint64_t>(m.link_channel);
    w.Put<uint64_t>(m.link_capacity);
    w.Put<uint8_t>(m.link_dense ? 1 : 0);
    w.Put<uint8_t>(m.link_layer_major ? 1 : 0);
    w.Zeros(2);
    w.Put<uint32_t>(m.link_bytes);
  }
  return MakeFrame(MessageType::kGet, request_id, m.link_channel != 0 ? m.link_bytes : 0,
                   w.Take());
}

std::string Encode(uint64_t request_id, const GetReply& m, uint64_t payload_bytes) {
  Writer w;
  w.Put<uint8_t>(static_cast<uint8_t>(m.representation));
  w.Put<uint8_t>((m.has_crc ? kGetFlagHasCrc : 0) | (m.shared ? kGetFlagShared : 0) |
                 (m.link ? kGetFlagLink : 0));
  w.Zeros(2);
  w.Put<uint32_t>(m.has_crc ? m.payload_crc : 0);
  if (m.shared) w.Put<uint64_t>(m.shm_bytes);
  if (m.link) {
    w.Put<uint64_t>(m.link_payload_bytes);
    w.Put<uint64_t>(m.num_tokens);
    w.Put<uint64_t>(m.link_ns);
    w.Put<uint8_t>(m.layout.num_layers != 0 ? 1 : 0);
    if (m.layout.num_layers != 0) PutLayout(w, m.layout);
  }
  return MakeFrame(MessageType::kGetReply, request_id,
                   m.shared || m.link ? 0 : payload_bytes, w.Take());
}

std::string Encode(uint64_t request_id, const Lookup& m) {
  Writer w;
  PutKey(w, Cut(m.model_id, CacheKey::kMaxModelBytes), Cut(m.key, CacheKey::kMaxKeyBytes));
  return MakeFrame(MessageType::kLookup, request_id, 0, w.Take());
}

std::string Encode(uint64_t request_id, const Delete& m) {
  Writer w;
  PutKey(w, Cut(m.model_id, CacheKey::kMaxModelBytes), Cut(m.key, CacheKey::kMaxKeyBytes));
  return MakeFrame(MessageType::kDelete, request_id, 0, w.Take());
}

std::string Encode(uint64_t request_id, const StatusReply& m) {
  Writer w;
  w.Put<uint16_t>(m.code);
  w.Str(Cut(m.message, kMaxMessageBytes));
  if (m.detail != 0) w.Put<uint16_t>(m.detail);
  return MakeFrame(MessageType::kStatus, request_id, 0, w.Take());
}

std::string Encode(uint64_t request_id, const Busy& m) {
  Writer w;
  w.Put<uint32_t>(m.retry_after_us);
  w.Zeros(4);
  w.Put<uint64_t>(m.inflight_bytes);
  w.Put<uint64_t>(m.limit_bytes);
  return MakeFrame(MessageType::kBusy, request_id, 0, w.Take());
}

std::string Encode(uint64_t request_id, const Ping&) {
  return MakeFrame(MessageType::kPing, request_id, 0, "");
}

// ---- decoders ----

absl::Status Decode(const Frame& f, Hello* out) {
  KVCOMP_RETURN_IF_ERROR(ExpectType(f, MessageType::kHello));
  KVCOMP_RETURN_IF_ERROR(ExpectNoPayload(f));
  Reader r(f.body, f.header.type);
  out->tenant = r.Str("tenant", CacheKey::kMaxTenantBytes);
  out->token = r.Str("token", kMaxTokenBytes);
  out->client_name = r.Str("client_name", kMaxNameBytes);
  if (r.ok() && !out->tenant.empty()) {
    CacheKey k{out->tenant, "m", "k"};
    if (absl::Status s = k.Validate(); !s.ok()) {
      r.Fail(absl::InvalidArgumentError(r.Prefix(s.message())));
    }
  }
  return r.Finish();
}

absl::Status Decode(const Frame& f, HelloOk* out) {
  KVCOMP_RETURN_IF_ERROR(ExpectType(f, MessageType::kHelloOk));
  KVCOMP_RETURN_IF_ERROR(ExpectNoPayload(f));
  Reader r(f.body, f.header.type);
  out->server_major = r.Get<uint8_t>("server_major");
  out->server_minor = r.Get<uint8_t>("server_minor");
  out->server_flags = r.Get<uint8_t>("server_flags");
  out->ucx_major = r.Get<uint8_t>("ucx_major");
  out->ucx_minor = r.Get<uint8_t>("ucx_minor");
  out->ucx_release = r.Get<uint8_t>("ucx_release");
  r.Skip(2, "reserved");
  out->max_payload_bytes = r.Get<uint64_t>("max_payload_bytes");
  out->max_inflight_bytes = r.Get<uint64_t>("max_inflight_bytes");
  out->tenant = r.Str("tenant", CacheKey::kMaxTenantBytes);
  out->server_name = r.Str("server_name", kMaxNameBytes);
  if (r.ok() && (out->server_flags & kServerSharedMemory)) {
    out->shm_socket = r.Str("shm_socket", kMaxNameBytes);
    out->shm_token = r.Str("shm_token", kShmTokenBytes);
    out->shm_max_region_bytes = r.Get<uint64_t>("shm_max_region_bytes");
    if (r.ok() && (out->shm_socket.empty() || out->shm_token.size() != kShmTokenBytes)) {
      r.Fail(absl::InvalidArgumentError(
          r.Prefix("shared memory offered without a socket name or a full attach token")));
    }
  }
  return r.Finish();
}

absl::Status Decode(const Frame& f, PutBegin* out) {
  KVCOMP_RETURN_IF_ERROR(ExpectType(f, MessageType::kPutBegin));
  KVCOMP_RETURN_IF_ERROR(ExpectNoPayload(f));
  Reader r(f.body, f.header.type);
  out->put_id = r.Get<uint64_t>("put_id");
  out->num_tokens = r.Get<uint64_t>("num_tokens");
  out->layout = GetLayout(r);
  const uint8_t flags = r.Get<uint8_t>("flags");
  r.Skip(2, "reserved");
  GetKey(r, &out->model_id, &out->key);
  const uint16_t policy_bytes = r.Get<uint16_t>("policy_bytes");
  const std::string policy = r.Bytes(policy_bytes, "policy");
  out->link_channel = r.ok() && (flags & kPutFlagLink) ? r.Get<uint64_t>("link_channel") : 0;
  if (!r.ok()) return r.Finish();
  if ((flags & kPutFlagLink) && out->link_channel == 0) {
    r.Fail(absl::InvalidArgumentError(r.Prefix("the link flag names link_channel 0")));
  }
  if (out->put_id == 0) r.Fail(absl::InvalidArgumentError(r.Prefix("put_id 0 is reserved")));
  if (out->num_tokens == 0 || out->num_tokens > KvLayout::kMaxTokens) {
    r.Fail(absl::InvalidArgumentError(r.Prefix(absl::StrFormat(
        "num_tokens %u out of range [1, %u]", out->num_tokens, KvLayout::kMaxTokens))));
  }
  if (flags & ~(kPutFlagBlockWise | kPutFlagHasPolicy | kPutFlagLink)) {
    r.Fail(absl::InvalidArgumentError(r.Prefix(absl::StrFormat("unknown flags 0x%02x", flags))));
  }
  out->block_wise = (flags & kPutFlagBlockWise) != 0;
  out->has_policy = (flags & kPutFlagHasPolicy) != 0;
  if (!out->has_policy && policy_bytes != 0) {
    r.Fail(absl::InvalidArgumentError(r.Prefix("policy bytes without the has-policy flag")));
  }
  if (policy_bytes > kMaxPolicyBytes) {
    r.Fail(absl::InvalidArgumentError(
        r.Prefix(absl::StrFormat("policy of %u bytes exceeds %u", policy_bytes, kMaxPolicyBytes))));
  }
  if (out->has_policy && r.ok()) {
    // The records must decode; whether the policy suits the layout is the receiver's to check
    // where the request enters it (kvcompd: once, with the tenant's default policy).
    absl::StatusOr<CompressionPolicy> p = format::DecodePolicyRecords(policy);
    if (!p.ok()) {
      r.Fail(absl::InvalidArgumentError(r.Prefix(p.status().message())));
    } else {
      out->policy = *std::move(p);
    }
  } else if (!out->has_policy) {
    out->policy = CompressionPolicy();
  }
  return r.Finish();
}

absl::Status Decode(const Frame& f, Block* out) {
  KVCOMP_RETURN_IF_ERROR(ExpectType(f, MessageType::kBlock));
  Reader r(f.body, f.header.type);
  out->put_id = r.Get<uint64_t>("put_id");
  out->layer_begin = r.Get<uint32_t>("layer_begin");
  out->layer_end = r.Get<uint32_t>("layer_end");
  out->token_begin = r.Get<uint64_t>("token_begin");
  out->token_end = r.Get<uint64_t>("token_end");
  out->parts = r.Get<uint8_t>("parts");
  out->flags = r.Get<uint8_t>("flags");
  r.Skip(2, "reserved");
  out->key_crc = r.Get<uint32_t>("key_crc");
  out->value_crc = r.Get<uint32_t>("value_crc");
  r.Skip(4, "reserved");
  out->key_bytes = r.Get<uint64_t>("key_bytes");
  out->value_bytes = r.Get<uint64_t>("value_bytes");
  const bool shared = r.ok() && (out->flags & (kBlockSharedMemory | kBlockPeerMemory)) != 0;
  out->shm_offset = shared ? r.Get<uint64_t>("shm_offset") : 0;
  out->peer_values =
      r.ok() && (out->flags & kBlockPeerMemory) ? r.Get<uint64_t>("peer_values") : 0;
  uint8_t order = 0;
  if (r.ok() && (out->flags & kBlockLinkPayload)) {
    out->link_channel = r.Get<uint64_t>("link_channel");
    out->link_bytes = r.Get<uint32_t>("link_bytes");
    order = r.Get<uint8_t>("link_order");
    r.Skip(3, "reserved");
  }
  KVCOMP_RETURN_IF_ERROR(r.Finish());
  auto bad = [&r](const std::string& what) { return absl::InvalidArgumentError(r.Prefix(what)); };
  if (out->layer_begin >= out->layer_end || out->layer_end > KvLayout::kMaxLayers) {
    return bad(absl::StrFormat("bad layer range [%u, %u)", out->layer_begin, out->layer_end));
  }
  if (out->token_begin >= out->token_end || out->token_end > KvLayout::kMaxTokens) {
    return bad(absl::StrFormat("bad token range [%u, %u)", out->token_begin, out->token_end));
  }
  if (out->parts == 0 || out->parts > kPartBoth) {
    return bad(absl::StrFormat("bad parts %u (1 keys, 2 values, 3 both)", out->parts));
  }
  const bool has_k = out->parts & kPartKeys, has_v = out->parts & kPartValues;
  if (has_k != (out->key_bytes > 0) || has_v != (out->value_bytes > 0)) {
    return bad(absl::StrFormat("parts %u disagree with key_bytes %u / value_bytes %u", out->parts,
                               out->key_bytes, out->value_bytes));
  }
  if ((!has_k && out->key_crc != 0) || (!has_v && out->value_crc != 0)) {
    return bad("checksum of an absent part must be zero");
  }
  if (out->flags &
      ~(kBlockDevicePayload | kBlockSharedMemory | kBlockPeerMemory | kBlockLinkPayload)) {
    return bad(absl::StrFormat("unknown block flags 0x%02x", out->flags));
  }
  if (__builtin_popcount(out->flags) > 1) {
    return bad("a block is a device payload, in shared memory, in the peer's memory or over a "
               "link: one");
  }
  if (out->flags & kBlockLinkPayload) {
    if (out->link_channel == 0) return bad("a link block names link_channel 0");
    if (order > 1) return bad(absl::StrFormat("bad link_order %u (0 or 1)", order));
    if (out->link_bytes > kMaxLinkDescriptorBytes) {
      return bad(absl::StrFormat("link descriptor of %u bytes (at most %u)", out->link_bytes,
                                 kMaxLinkDescriptorBytes));
    }
    if (out->key_crc != 0 || out->value_crc != 0) {
      return bad("a link payload carries no checksums (key_crc and value_crc must be zero)");
    }
    out->link_layer_major = order == 1;
  }
  if (shared && (out->key_crc != 0 || out->value_crc != 0)) {
    return bad("a shared-memory payload carries no checksums (key_crc and value_crc must be "
               "zero)");
  }
  if ((out->flags & kBlockDevicePayload) && (out->key_crc != 0 || out->value_crc != 0)) {
    return bad("a device payload carries no checksums (key_crc and value_crc must be zero)");
  }
  if (out->key_bytes > kMaxPayloadBytes || out->value_bytes > kMaxPayloadBytes ||
      out->wire_bytes() != f.header.payload_bytes) {
    if (out->flags & kBlockLinkPayload) {
      return bad(absl::StrFormat("link_bytes %u != payload %u", out->link_bytes,
                                 f.header.payload_bytes));
    }
    return bad(absl::StrFormat("key_bytes %u + value_bytes %u != payload %u", out->key_bytes,
                               out->value_bytes, f.header.payload_bytes));
  }
  return absl::OkStatus();
}

absl::Status Decode(const Frame& f, PutCommit* out) {
  KVCOMP_RETURN_IF_ERROR(ExpectType(f, MessageType::kPutCommit));
  KVCOMP_RETURN_IF_ERROR(ExpectNoPayload(f));
  Reader r(f.body, f.header.type);
  out->put_id = r.Get<uint64_t>("put_id");
  out->num_blocks = r.Get<uint64_t>("num_blocks");
  return r.Finish();
}

absl::Status Decode(const Frame& f, CacheSummary* out) {
  if (f.header.type != MessageType::kPutCommitOk && f.header.type != MessageType::kLookupReply) {
    return ExpectType(f, MessageType::kLookupReply);
  }
  KVCOMP_RETURN_IF_ERROR(ExpectNoPayload(f));
  Reader r(f.body, f.header.type);
  out->layout = GetLayout(r);
  const uint8_t kc = r.Get<uint8_t>("key_codec");
  const uint8_t vc = r.Get<uint8_t>("value_codec");
  out->tier = r.Get<uint8_t>("tier");
  out->original_tokens = r.Get<uint64_t>("original_tokens");
  out->total_kept = r.Get<uint64_t>("total_kept");
  out->original_bytes = r.Get<uint64_t>("original_bytes");
  out->stored_bytes = r.Get<uint64_t>("stored_bytes");
  out->link_ns = r.ok() && f.header.type == MessageType::kPutCommitOk && r.left() == 8
                     ? r.Get<uint64_t>("link_ns")
                     : 0;
  KVCOMP_RETURN_IF_ERROR(r.Finish());
  if (kc > kMaxKeyCodec || vc > kMaxValueCodec) {
    return absl::InvalidArgumentError(r.Prefix(absl::StrFormat("unknown codecs %u/%u", kc, vc)));
  }
  out->key_codec = static_cast<KeyCodec>(kc);
  out->value_codec = static_cast<ValueCodec>(vc);
  return absl::OkStatus();
}

absl::Status Decode(const Frame& f, PutAbort* out) {
  KVCOMP_RETURN_IF_ERROR(ExpectType(f, MessageType::kPutAbort));
  KVCOMP_RETURN_IF_ERROR(ExpectNoPayload(f));
  Reader r(f.body, f.header.type);
  out->put_id = r.Get<uint64_t>("put_id");
  return r.Finish();
}

absl::Status Decode(const Frame& f, Get* out) {
  KVCOMP_RETURN_IF_ERROR(ExpectType(f, MessageType::kGet));
  Reader r(f.body, f.header.type);
  const uint8_t rep = r.Get<uint8_t>("representation");
  const uint8_t flags = r.Get<uint8_t>("flags");
  r.Skip(2, "reserved");
  GetKey(r, &out->model_id, &out->key);
  out->shared = r.ok() && (flags & kGetFlagShared) != 0;
  out->direct = r.ok() && (flags & kGetFlagDirect) != 0;
  out->or_payload = r.ok() && (flags & kGetFlagOrPayload) != 0;
  if (out->shared || out->direct) {
    out->shm_offset = r.Get<uint64_t>("shm_offset");
    out->shm_capacity = r.Get<uint64_t>("shm_capacity");
  }
  uint8_t dense = 0, order = 0;
  if (r.ok() && (flags & kGetFlagLink)) {
    out->link_channel = r.Get<uint64_t>("link_channel");
    out->link_capacity = r.Get<uint64_t>("link_capacity");
    dense = r.Get<uint8_t>("link_form");
    order = r.Get<uint8_t>("link_order");
    r.Skip(2, "reserved");
    out->link_bytes = r.Get<uint32_t>("link_bytes");
  }
  KVCOMP_RETURN_IF_ERROR(r.Finish());
  if (flags & kGetFlagLink) {
    if ((flags & ~kGetFlagLink) != 0) {
      return absl::InvalidArgumentError(
          r.Prefix("a link get is not a shared-memory, direct or or-payload get"));
    }
    if (out->link_channel == 0 || out->link_capacity == 0) {
      return absl::InvalidArgumentError(r.Prefix("a link get names link_channel and capacity"));
    }
    if (dense > 1 || order > 1 || (order == 1 && dense == 0)) {
      return absl::InvalidArgumentError(r.Prefix(absl::StrFormat(
          "bad link_form %u / link_order %u (layer-major is for dense gets)", dense, order)));
    }
    if (out->link_bytes > kMaxLinkDescriptorBytes || out->link_bytes != f.header.payload_bytes) {
      return absl::InvalidArgumentError(r.Prefix(absl::StrFormat(
          "link_bytes %u (at most %u) != payload %u", out->link_bytes, kMaxLinkDescriptorBytes,
          f.header.payload_bytes)));
    }
    out->link_dense = dense == 1;
    out->link_layer_major = order == 1;
  } else {
    KVCOMP_RETURN_IF_ERROR(ExpectNoPayload(f));
  }
  if ((flags & ~(kGetFlagShared | kGetFlagDirect | kGetFlagOrPayload | kGetFlagLink)) ||
      (flags & (kGetFlagShared | kGetFlagDirect)) == (kGetFlagShared | kGetFlagDirect)) {
    return absl::InvalidArgumentError(r.Prefix(absl::StrFormat("unknown flags 0x%02x", flags)));
  }
  if (out->or_payload && !out->shared && !out->direct) {
    return absl::InvalidArgumentError(
        r.Prefix("the or-payload flag without the shared-memory or direct flag"));
  }
  if (rep > static_cast<uint8_t>(Representation::kDecoded)) {
    return absl::InvalidArgumentError(r.Prefix(absl::StrFormat("unknown representation %u", rep)));
  }
  out->representation = static_cast<Representation>(rep);
  return absl::OkStatus();
}

absl::Status Decode(const Frame& f, GetReply* out) {
  KVCOMP_RETURN_IF_ERROR(ExpectType(f, MessageType::kGetReply));
  Reader r(f.body, f.header.type);
  const uint8_t rep = r.Get<uint8_t>("representation");
  const uint8_t flags = r.Get<uint8_t>("flags");
  r.Skip(2, "reserved");
  out->payload_crc = r.Get<uint32_t>("payload_crc");
  out->shared = r.ok() && (flags & kGetFlagShared) != 0;
  out->shm_bytes = out->shared ? r.Get<uint64_t>("shm_bytes") : 0;
  out->link = r.ok() && (flags & kGetFlagLink) != 0;
  if (out->link) {
    out->link_payload_bytes = r.Get<uint64_t>("link_payload_bytes");
    out->num_tokens = r.Get<uint64_t>("num_tokens");
    out->link_ns = r.Get<uint64_t>("link_ns");
    if (r.Get<uint8_t>("has_layout") != 0 && r.ok()) out->layout = GetLayout(r);
  }
  KVCOMP_RETURN_IF_ERROR(r.Finish());
  if (out->link && (out->shared || f.header.payload_bytes != 0 || (flags & kGetFlagHasCrc))) {
    return absl::InvalidArgumentError(
        r.Prefix("a link get's answer carries no payload and no checksum"));
  }
  if (rep > static_cast<uint8_t>(Representation::kDecoded)) {
    return absl::InvalidArgumentError(r.Prefix(absl::StrFormat("unknown representation %u", rep)));
  }
  if (out->shared && (f.header.payload_bytes != 0 || (flags & kGetFlagHasCrc))) {
    return absl::InvalidArgumentError(
        r.Prefix("a get written into shared memory carries no payload and no checksum"));
  }
  if (flags & ~(kGetFlagHasCrc | kGetFlagShared | kGetFlagLink)) {
    return absl::InvalidArgumentError(r.Prefix(absl::StrFormat("unknown flags 0x%02x", flags)));
  }
  out->representation = static_cast<Representation>(rep);
  out->has_crc = (flags & kGetFlagHasCrc) != 0;
  if (!out->has_crc && out->payload_crc != 0) {
    return absl::InvalidArgumentError(r.Prefix("payload_crc set without the has-crc flag"));
  }
  return absl::OkStatus();
}

absl::Status Decode(const Frame& f, Lookup* out) {
  KVCOMP_RETURN_IF_ERROR(ExpectType(f, MessageType::kLookup));
  KVCOMP_RETURN_IF_ERROR(ExpectNoPayload(f));
  Reader r(f.body, f.header.type);
  GetKey(r, &out->model_id, &out->key);
  return r.Finish();
}

absl::Status Decode(const Frame& f, Delete* out) {
  KVCOMP_RETURN_IF_ERROR(ExpectType(f, MessageType::kDelete));
  KVCOMP_RETURN_IF_ERROR(ExpectNoPayload(f));
  Reader r(f.body, f.header.type);
  GetKey(r, &out->model_id, &out->key);
  return r.Finish();
}

absl::Status Decode(const Frame& f, StatusReply* out) {
  KVCOMP_RETURN_IF_ERROR(ExpectType(f, MessageType::kStatus));
  KVCOMP_RETURN_IF_ERROR(ExpectNoPayload(f));
  Reader r(f.body, f.header.type);
  out->code = r.Get<uint16_t>("code");
  out->message = r.Str("message", kMaxMessageBytes);
  out->detail = r.ok() && r.left() == 2 ? r.Get<uint16_t>("detail") : 0;
  return r.Finish();
}

absl::Status Decode(const Frame& f, Busy* out) {
  KVCOMP_RETURN_IF_ERROR(ExpectType(f, MessageType::kBusy));
  KVCOMP_RETURN_IF_ERROR(ExpectNoPayload(f));
  Reader r(f.body, f.header.type);
  out->retry_after_us = r.Get<uint32_t>("retry_after_us");
  r.Skip(4, "reserved");
  out->inflight_bytes = r.Get<uint64_t>("inflight_bytes");
  out->limit_bytes = r.Get<uint64_t>("limit_bytes");
  return r.Finish();
}

absl::Status Decode(const Frame& f, Ping*) {
  KVCOMP_RETURN_IF_ERROR(ExpectType(f, MessageType::kPing));
  KVCOMP_RETURN_IF_ERROR(ExpectNoPayload(f));
  Reader r(f.body, f.header.type);
  return r.Finish();
}

}  // namespace wire
}  // namespace transport
}  // namespace kvcomp
