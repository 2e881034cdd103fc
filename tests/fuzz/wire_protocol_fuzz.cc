// libFuzzer target for the UCX data-plane wire protocol (transport/src/protocol.cc): every
// decoder of bytes that arrive from a peer. Input: one selector byte, then
//   selector 1..15: 8 bytes of announced payload length (little-endian), then a body that is
//     wrapped in a valid frame header of that message type (right size and checksum), so the
//     mutations reach the body decoders instead of dying at the checksum;
//   any other selector: the rest is a whole raw frame (header included) for ParseFrame and
//     PeekRequestId, with the payload length the header announces.
// A parsed frame goes to every Decode overload (each must refuse other types with a status).
// What a decoder accepts must survive Encode -> ParseFrame -> Decode -> Encode unchanged, and a
// block that fits the put's layout must give payload offsets inside its payload. Any crash,
// sanitizer report, leak or abort is a finding.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kvcomp/core/crc32c.h"
#include "kvcomp/transport/protocol.h"

namespace {

namespace wire = kvcomp::transport::wire;

void Check(bool ok) {
  if (!ok) std::abort();
}

std::string WrapBody(uint8_t type, uint64_t request_id, uint64_t payload, const std::string& body) {
  std::string f(wire::kFrameHeaderBytes, '\0');
  const uint32_t magic = wire::kMagic;
  const uint32_t body_bytes = static_cast<uint32_t>(body.size());
  std::memcpy(&f[0], &magic, 4);
  f[4] = static_cast<char>(wire::kMajorVersion);
  f[5] = static_cast<char>(wire::kMinorVersion);
  f[6] = static_cast<char>(type);
  std::memcpy(&f[8], &request_id, 8);
  std::memcpy(&f[16], &payload, 8);
  std::memcpy(&f[24], &body_bytes, 4);
  f += body;
  uint32_t crc = kvcomp::Crc32cExtend(0, f.data(), 28);
  crc = kvcomp::Crc32cExtend(crc, f.data() + wire::kFrameHeaderBytes, body.size());
  std::memcpy(&f[28], &crc, 4);
  return f;
}

// Encode(m) must parse and decode back to a message that encodes to the same bytes.
template <typename M, typename EncodeFn>
void RoundTrip(const M& m, uint64_t payload, EncodeFn encode) {
  const std::string once = encode(m);
  auto frame = wire::ParseFrame(once, payload);
  Check(frame.ok());
  M again;
  Check(wire::Decode(*frame, &again).ok());
  Check(encode(again) == once);
}

template <typename M>
bool TryDecode(const wire::Frame& f, M* m) {
  absl::Status s = wire::Decode(f, m);
  return s.ok();
}

void DecodeAll(const wire::Frame& f) {
  const uint64_t id = f.header.request_id;
  const uint64_t payload = f.header.payload_bytes;
  auto enc = [id](const auto& m) { return wire::Encode(id, m); };
  if (wire::Hello m; TryDecode(f, &m)) {
    Check(f.header.type == wire::MessageType::kHello);
    RoundTrip(m, 0, enc);
  }
  if (wire::HelloOk m; TryDecode(f, &m)) RoundTrip(m, 0, enc);
  if (wire::PutBegin m; TryDecode(f, &m)) {
    Check(m.put_id != 0 && m.num_tokens >= 1 && m.layout.Validate().ok());
    if (m.has_policy) {
      // What kvcompd checks next; a status either way, never a crash.
      (void)m.policy.Validate();
      (void)m.policy.ValidateFor(m.layout.head_dim);
    }
    RoundTrip(m, 0, enc);
  }
  if (wire::Block m; TryDecode(f, &m)) {
    // A block in shared memory or the peer's memory names its bytes; its frame carries none.
    const bool shared = (m.flags & (wire::kBlockSharedMemory | wire::kBlockPeerMemory)) != 0;
    Check(shared ? payload == 0 : m.payload_bytes() == payload);
    RoundTrip(m, payload, enc);
    // Against a small put: offsets of an accepted block lie inside its payload.
    kvcomp::KvLayout layout;
    layout.num_layers = 4;
    layout.num_kv_heads = 2;
    layout.num_q_heads = 4;
    layout.head_dim = 8;
    layout.dtype = kvcomp::DType::kF16;
    if (m.ValidateAgainst(layout, 64).ok()) {
      const uint64_t part = m.ExpectedPartBytes(layout);
      for (uint32_t l = m.layer_begin; l < m.layer_end; ++l) {
        if (m.parts & wire::kPartKeys) Check(m.KeyOffset(layout, l) < m.key_bytes);
        if (m.parts & wire::kPartValues) {
          Check(m.ValueOffset(layout, l) >= m.key_bytes);
          Check(m.ValueOffset(layout, l) < m.key_bytes + part);
        }
      }
    }
  }
  if (wire::PutCommit m; TryDecode(f, &m)) RoundTrip(m, 0, enc);
  if (wire::CacheSummary m; TryDecode(f, &m)) {
    if (f.header.type == wire::MessageType::kLookupReply) {
      RoundTrip(m, 0, [id](const wire::CacheSummary& s) { return wire::EncodeLookupReply(id, s); });
    } else {
      RoundTrip(m, 0, enc);
    }
  }
  if (wire::PutAbort m; TryDecode(f, &m)) RoundTrip(m, 0, enc);
  if (wire::Get m; TryDecode(f, &m)) RoundTrip(m, 0, enc);
  if (wire::GetReply m; TryDecode(f, &m)) {
    RoundTrip(m, payload, [id, payload](const wire::GetReply& r) {
      return wire::Encode(id, r, payload);
    });
  }
  if (wire::Lookup m; TryDecode(f, &m)) RoundTrip(m, 0, enc);
  if (wire::Delete m; TryDecode(f, &m)) RoundTrip(m, 0, enc);
  if (wire::StatusReply m; TryDecode(f, &m)) {
    RoundTrip(m, 0, enc);
    (void)m.ToStatus();
  }
  if (wire::Busy m; TryDecode(f, &m)) RoundTrip(m, 0, enc);
  if (wire::Ping m; TryDecode(f, &m)) RoundTrip(m, 0, enc);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t selector = data[0];
  std::string frame;
  uint64_t payload = 0;
  if (wire::IsKnownMessageType(selector)) {
    if (size < 9) return 0;
    std::memcpy(&payload, data + 1, 8);
    frame = WrapBody(selector, 7, payload,
                     std::string(reinterpret_cast<const char*>(data + 9), size - 9));
  } else {
    frame.assign(reinterpret_cast<const char*>(data + 1), size - 1);
    if (frame.size() >= wire::kFrameHeaderBytes) std::memcpy(&payload, frame.data() + 16, 8);
  }
  (void)wire::PeekRequestId(frame);
  (void)wire::MessageTypeName(static_cast<wire::MessageType>(selector));
  auto parsed = wire::ParseFrame(frame, payload);
  if (!parsed.ok()) return 0;
  Check(parsed->body.size() == parsed->header.body_bytes);
  Check(wire::PeekRequestId(frame) == parsed->header.request_id);
  DecodeAll(*parsed);
  return 0;
}
