// Wire protocol v1: every message round-trips, and malformed frames and bodies (truncated, bad
// header, wrong sizes, checksum mismatch, unknown message, oversize, bad fields) are refused
// with a clear status, never read out of bounds (run under ASan in CI's sanitizer job).
#include "kvcomp/transport/protocol.h"

#include <cstring>
#include <random>
#include <string>

#include "gtest/gtest.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace transport {
namespace wire {
namespace {

Frame MustParse(const std::string& frame, uint64_t payload = 0) {
  absl::StatusOr<Frame> f = ParseFrame(frame, payload);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? *f : Frame{};
}

// Re-seals a frame after its bytes were edited (so the body checks, not the CRC, see them).
std::string Reseal(std::string f) {
  uint32_t crc = Crc32cExtend(0, f.data(), 28);
  crc = Crc32cExtend(crc, f.data() + kFrameHeaderBytes, f.size() - kFrameHeaderBytes);
  std::memcpy(&f[28], &crc, 4);
  return f;
}

// Sets the body length field and reseals.
std::string WithBody(std::string f, const std::string& body) {
  f.resize(kFrameHeaderBytes);
  f += body;
  const uint32_t n = static_cast<uint32_t>(body.size());
  std::memcpy(&f[24], &n, 4);
  return Reseal(f);
}

template <typename M>
M RoundTrip(const std::string& frame, uint64_t payload = 0) {
  M out;
  absl::Status s = Decode(MustParse(frame, payload), &out);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

PutBegin SampleBegin() {
  PutBegin b;
  b.put_id = 42;
  b.layout = KvLayout{32, 8, 32, 128, DType::kBF16};
  b.num_tokens = 32768;
  b.model_id = "meta-llama/Llama-3.1-8B";
  b.key = std::string("\x00\xff key", 6);
  b.has_policy = true;
  b.policy.scorer = Scorer::kKeyDiff;
  b.policy.ratio = 0.75;
  b.policy.value_codec = ValueCodec::kOrthogonalInt8;
  b.block_wise = true;
  return b;
}

TEST(ProtocolTest, FrameHeaderIsLittleEndianAndDocumented) {
  const std::string f = Encode(0x0102030405060708ull, Ping{});
  ASSERT_EQ(f.size(), kFrameHeaderBytes);
  EXPECT_EQ(f.substr(0, 4), "KVWP");
  EXPECT_EQ(f[4], 1);   // major
  EXPECT_EQ(f[5], wire::kMinorVersion);  // minor
  EXPECT_EQ(f[6], 15);  // ping
  EXPECT_EQ(static_cast<uint8_t>(f[8]), 0x08);  // request id, low byte first
  EXPECT_EQ(PeekRequestId(f), 0x0102030405060708ull);
}

TEST(ProtocolTest, HelloRoundTrip) {
  Hello h{"acme", "s3cret", "test"};
  Hello out = RoundTrip<Hello>(Encode(7, h));
  EXPECT_EQ(out.tenant, "acme");
  EXPECT_EQ(out.token, "s3cret");
  EXPECT_EQ(out.client_name, "test");
  HelloOk ok;
  ok.max_payload_bytes = 1 << 20;
  ok.max_inflight_bytes = 1 << 30;
  ok.tenant = "acme";
  ok.server_name = "kvcompd";
  HelloOk ok2 = RoundTrip<HelloOk>(Encode(7, ok));
  EXPECT_EQ(ok2.max_payload_bytes, ok.max_payload_bytes);
  EXPECT_EQ(ok2.max_inflight_bytes, ok.max_inflight_bytes);
  EXPECT_EQ(ok2.tenant, "acme");
  EXPECT_EQ(ok2.server_name, "kvcompd");
  EXPECT_EQ(ok2.ucx_major, 0);  // not said
  // The server's UCX release, in the bytes a 1.0-1.2 client reads as reserved.
  ok.ucx_major = 1;
  ok.ucx_minor = 13;
  ok.ucx_release = 1;
  const std::string f = Encode(7, ok);
  EXPECT_EQ(static_cast<uint8_t>(f[32 + 3]), 1);
  EXPECT_EQ(static_cast<uint8_t>(f[32 + 4]), 13);
  EXPECT_EQ(static_cast<uint8_t>(f[32 + 5]), 1);
  HelloOk ok3 = RoundTrip<HelloOk>(f);
  EXPECT_EQ(ok3.ucx_major, 1);
  EXPECT_EQ(ok3.ucx_minor, 13);
  EXPECT_EQ(ok3.ucx_release, 1);
}

TEST(ProtocolTest, PutBeginRoundTrip) {
  const PutBegin b = SampleBegin();
  PutBegin out = RoundTrip<PutBegin>(Encode(1, b));
  EXPECT_EQ(out.put_id, 42u);
  EXPECT_EQ(out.layout, b.layout);
  EXPECT_EQ(out.num_tokens, 32768u);
  EXPECT_EQ(out.model_id, b.model_id);
  EXPECT_EQ(out.key, b.key);
  EXPECT_TRUE(out.has_policy);
  EXPECT_EQ(out.policy, b.policy);
  EXPECT_TRUE(out.block_wise);

  PutBegin d = b;
  d.has_policy = false;
  d.block_wise = false;
  PutBegin out2 = RoundTrip<PutBegin>(Encode(1, d));
  EXPECT_FALSE(out2.has_policy);
  EXPECT_FALSE(out2.block_wise);
  EXPECT_EQ(out2.policy, CompressionPolicy());
}

TEST(ProtocolTest, BlockRoundTripAndValidation) {
  Block b;
  b.put_id = 3;
  b.layer_begin = 2;
  b.layer_end = 4;
  b.token_begin = 100;
  b.token_end = 164;
  b.parts = kPartBoth;
  const KvLayout lay{32, 8, 32, 128, DType::kBF16};
  b.key_bytes = b.value_bytes = b.ExpectedPartBytes(lay);
  EXPECT_EQ(b.key_bytes, 2u * 8 * 64 * 128 * 2);
  b.key_crc = 0x11223344;
  b.value_crc = 0x55667788;
  const std::string f = Encode(9, b);
  Block out = RoundTrip<Block>(f, b.payload_bytes());
  EXPECT_EQ(out.put_id, 3u);
  EXPECT_EQ(out.layer_begin, 2u);
  EXPECT_EQ(out.layer_end, 4u);
  EXPECT_EQ(out.token_begin, 100u);
  EXPECT_EQ(out.token_end, 164u);
  EXPECT_EQ(out.key_crc, 0x11223344u);
  EXPECT_EQ(out.value_crc, 0x55667788u);
  EXPECT_TRUE(out.ValidateAgainst(lay, 164).ok());
  EXPECT_EQ(out.ValidateAgainst(lay, 163).code(), absl::StatusCode::kInvalidArgument);
  KvLayout few = lay;
  few.num_layers = 3;
  EXPECT_EQ(out.ValidateAgainst(few, 1000).code(), absl::StatusCode::kInvalidArgument);
  out.key_bytes -= 2;
  EXPECT_EQ(out.ValidateAgainst(lay, 1000).code(), absl::StatusCode::kInvalidArgument);

  // Payload length disagreeing with the frame.
  EXPECT_EQ(ParseFrame(f, b.payload_bytes() - 1).status().code(), absl::StatusCode::kDataLoss);

  Block keys_only = b;
  keys_only.parts = kPartKeys;
  keys_only.value_bytes = 0;
  keys_only.value_crc = 0;
  Block ko = RoundTrip<Block>(Encode(1, keys_only), keys_only.payload_bytes());
  EXPECT_EQ(ko.parts, kPartKeys);
  EXPECT_EQ(ko.value_bytes, 0u);
}

TEST(ProtocolTest, BlockFieldsThatDisagreeAreRefused) {
  Block b;
  b.put_id = 1;
  b.layer_end = 1;
  b.token_end = 4;
  b.key_bytes = b.value_bytes = 16;
  auto decode = [](const Block& m) {
    Block out;
    const std::string bytes = Encode(1, m);
    absl::StatusOr<Frame> f = ParseFrame(bytes, m.payload_bytes());
    if (!f.ok()) return f.status();
    return Decode(*f, &out);
  };
  EXPECT_TRUE(decode(b).ok());
  Block empty_layers = b;
  empty_layers.layer_end = 0;
  EXPECT_EQ(decode(empty_layers).code(), absl::StatusCode::kInvalidArgument);
  Block empty_tokens = b;
  empty_tokens.token_begin = 4;
  EXPECT_EQ(decode(empty_tokens).code(), absl::StatusCode::kInvalidArgument);
  Block no_parts = b;
  no_parts.parts = 0;
  EXPECT_EQ(decode(no_parts).code(), absl::StatusCode::kInvalidArgument);
  Block bad_parts = b;
  bad_parts.parts = 7;
  EXPECT_EQ(decode(bad_parts).code(), absl::StatusCode::kInvalidArgument);
  Block missing_v = b;
  missing_v.parts = kPartKeys;  // but value_bytes > 0
  EXPECT_EQ(decode(missing_v).code(), absl::StatusCode::kInvalidArgument);
  Block stray_crc = b;
  stray_crc.parts = kPartKeys;
  stray_crc.value_bytes = 0;
  stray_crc.value_crc = 5;
  EXPECT_EQ(decode(stray_crc).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ProtocolTest, RepliesRoundTrip) {
  CacheSummary s;
  s.layout = KvLayout{4, 2, 8, 64, DType::kF16};
  s.key_codec = KeyCodec::kInt8;
  s.value_codec = ValueCodec::kOrthogonalInt4;
  s.tier = 2;
  s.original_tokens = 1000;
  s.total_kept = 4000;
  s.original_bytes = 123456;
  s.stored_bytes = 23456;
  for (const std::string& f : {Encode(5, s), EncodeLookupReply(5, s)}) {
    CacheSummary out = RoundTrip<CacheSummary>(f);
    EXPECT_EQ(out.layout, s.layout);
    EXPECT_EQ(out.key_codec, s.key_codec);
    EXPECT_EQ(out.value_codec, s.value_codec);
    EXPECT_EQ(out.tier, 2);
    EXPECT_EQ(out.original_tokens, 1000u);
    EXPECT_EQ(out.total_kept, 4000u);
    EXPECT_EQ(out.original_bytes, 123456u);
    EXPECT_EQ(out.stored_bytes, 23456u);
  }
  EXPECT_EQ(MustParse(Encode(5, s)).header.type, MessageType::kPutCommitOk);
  EXPECT_EQ(MustParse(EncodeLookupReply(5, s)).header.type, MessageType::kLookupReply);
  CacheSummary s4 = s;  // int4 keys (format 1.3) are a known codec
  s4.key_codec = KeyCodec::kInt4;
  EXPECT_EQ(RoundTrip<CacheSummary>(EncodeLookupReply(5, s4)).key_codec, KeyCodec::kInt4);

  GetReply g{Representation::kDecoded, true, 0xdeadbeef};
  GetReply go = RoundTrip<GetReply>(Encode(5, g, 100), 100);
  EXPECT_EQ(go.representation, Representation::kDecoded);
  EXPECT_TRUE(go.has_crc);
  EXPECT_EQ(go.payload_crc, 0xdeadbeefu);

  StatusReply st = StatusReply::FromStatus(absl::NotFoundError("no such cache"));
  StatusReply so = RoundTrip<StatusReply>(Encode(5, st));
  EXPECT_EQ(so.ToStatus(), absl::NotFoundError("no such cache"));
  EXPECT_TRUE(RoundTrip<StatusReply>(Encode(5, StatusReply{})).ToStatus().ok());
  // Long messages are cut, not refused.
  StatusReply longer = StatusReply::FromStatus(absl::InternalError(std::string(5000, 'x')));
  EXPECT_EQ(RoundTrip<StatusReply>(Encode(5, longer)).message.size(), kMaxMessageBytes);

  Busy b{250, 1000, 2000};
  Busy bo = RoundTrip<Busy>(Encode(5, b));
  EXPECT_EQ(bo.retry_after_us, 250u);
  EXPECT_EQ(bo.inflight_bytes, 1000u);
  EXPECT_EQ(bo.limit_bytes, 2000u);
}

TEST(ProtocolTest, KeyedRequestsRoundTrip) {
  Get g{Representation::kDecoded, "model", "key"};
  Get go = RoundTrip<Get>(Encode(1, g));
  EXPECT_EQ(go.representation, Representation::kDecoded);
  EXPECT_EQ(go.model_id, "model");
  EXPECT_EQ(go.key, "key");
  EXPECT_EQ(RoundTrip<Lookup>(Encode(1, Lookup{"m", "k"})).key, "k");
  EXPECT_EQ(RoundTrip<Delete>(Encode(1, Delete{"m", "k"})).model_id, "m");
  EXPECT_EQ(RoundTrip<PutCommit>(Encode(1, PutCommit{4, 9})).num_blocks, 9u);
  EXPECT_EQ(RoundTrip<PutAbort>(Encode(1, PutAbort{4})).put_id, 4u);
  // An empty key is refused.
  Lookup empty;
  empty.model_id = "m";
  Lookup out;
  EXPECT_EQ(Decode(MustParse(Encode(1, empty)), &out).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ProtocolTest, SharedMemoryFieldsRoundTripAndDisagreementsAreRefused) {
  HelloOk ok;
  ok.server_flags = kServerSharedMemory;
  ok.max_payload_bytes = 1;
  ok.tenant = "t";
  ok.shm_socket = "kvcompd-shm-1-00";
  ok.shm_token = std::string(kShmTokenBytes, '\x07');
  ok.shm_max_region_bytes = uint64_t{1} << 30;
  HelloOk oo = RoundTrip<HelloOk>(Encode(1, ok));
  EXPECT_EQ(oo.shm_socket, ok.shm_socket);
  EXPECT_EQ(oo.shm_token, ok.shm_token);
  EXPECT_EQ(oo.shm_max_region_bytes, ok.shm_max_region_bytes);
  // The fields travel only with the flag; a short token is refused.
  HelloOk plain = ok;
  plain.server_flags = 0;
  EXPECT_TRUE(RoundTrip<HelloOk>(Encode(1, plain)).shm_socket.empty());
  HelloOk short_token = ok;
  short_token.shm_token = "abc";
  HelloOk out;
  EXPECT_TRUE(absl::IsInvalidArgument(Decode(MustParse(Encode(1, short_token)), &out)));

  // A shared block announces no payload and names its offset.
  Block b;
  b.put_id = 3;
  b.layer_end = 1;
  b.token_end = 4;
  b.parts = kPartKeys;
  b.key_bytes = 512;
  b.flags = kBlockSharedMemory;
  b.shm_offset = (uint64_t{1} << 33) + 4096;
  const std::string f = Encode(2, b);
  EXPECT_EQ(MustParse(f).header.payload_bytes, 0u);
  Block bo = RoundTrip<Block>(f);
  EXPECT_EQ(bo.flags, kBlockSharedMemory);
  EXPECT_EQ(bo.shm_offset, b.shm_offset);
  EXPECT_EQ(bo.key_bytes, 512u);
  // Checksums, or the device flag beside it: refused.
  Block crc = b;
  crc.key_crc = 5;
  EXPECT_TRUE(absl::IsInvalidArgument(Decode(MustParse(Encode(2, crc)), &bo)));
  Block both = b;
  both.flags = kBlockSharedMemory | kBlockDevicePayload;
  EXPECT_TRUE(absl::IsInvalidArgument(Decode(MustParse(Encode(2, both)), &bo)));

  // A block in the client's own memory names both addresses.
  Block peer = b;
  peer.flags = kBlockPeerMemory;
  peer.shm_offset = 0x7f0000001000;
  peer.parts = kPartBoth;
  peer.value_bytes = 512;
  peer.peer_values = 0x7f0000100000;
  const std::string pf = Encode(2, peer);
  EXPECT_EQ(MustParse(pf).header.payload_bytes, 0u);
  Block po = RoundTrip<Block>(pf);
  EXPECT_EQ(po.flags, kBlockPeerMemory);
  EXPECT_EQ(po.shm_offset, peer.shm_offset);
  EXPECT_EQ(po.peer_values, peer.peer_values);
  Block two = peer;
  two.flags = kBlockPeerMemory | kBlockSharedMemory;
  EXPECT_TRUE(absl::IsInvalidArgument(Decode(MustParse(Encode(2, two)), &bo)));

  // A link block (minor 4): the frame's data part is the link's descriptor, not the K and V.
  Block link = b;
  link.flags = kBlockLinkPayload;
  link.parts = kPartBoth;
  link.value_bytes = 512;
  link.link_channel = 42;
  link.link_bytes = 144;
  link.link_layer_major = true;
  const std::string lf = Encode(3, link);
  EXPECT_EQ(MustParse(lf, 144).header.payload_bytes, 144u);
  Block lo = RoundTrip<Block>(lf, 144);
  EXPECT_EQ(lo.flags, kBlockLinkPayload);
  EXPECT_EQ(lo.link_channel, 42u);
  EXPECT_EQ(lo.link_bytes, 144u);
  EXPECT_TRUE(lo.link_layer_major);
  EXPECT_EQ(lo.payload_bytes(), 1024u);
  EXPECT_EQ(lo.wire_bytes(), 144u);
  for (auto bad : {+[](Block& m) { m.link_channel = 0; }, +[](Block& m) { m.key_crc = 9; },
                   +[](Block& m) { m.flags |= kBlockDevicePayload; },
                   +[](Block& m) { m.link_bytes = kMaxLinkDescriptorBytes + 1; }}) {
    Block m = link;
    bad(m);
    const std::string frame = Encode(3, m);
    EXPECT_TRUE(absl::IsInvalidArgument(Decode(MustParse(frame, m.wire_bytes()), &lo)));
  }

  // A put-begin naming the GPU channel its link block will use (minor 4).
  PutBegin linked;
  linked.put_id = 3;
  linked.layout = KvLayout{2, 2, 2, 64, DType::kBF16};
  linked.num_tokens = 8;
  linked.model_id = "m";
  linked.key = "k";
  linked.link_channel = 77;
  EXPECT_EQ(RoundTrip<PutBegin>(Encode(4, linked)).link_channel, 77u);
  linked.link_channel = 0;
  EXPECT_EQ(RoundTrip<PutBegin>(Encode(4, linked)).link_channel, 0u);

  // A status reply carries its typed detail after the message (minor 4); none when 0.
  const StatusReply typed = StatusReply::FromStatus(
      WithDetail(absl::NotFoundError("gone"), ErrorDetail::kLinkGone));
  EXPECT_EQ(typed.detail, ErrorDetailToWire(ErrorDetail::kLinkGone));
  const absl::Status back = RoundTrip<StatusReply>(Encode(6, typed)).ToStatus();
  EXPECT_TRUE(absl::IsNotFound(back));
  EXPECT_EQ(DetailOf(back), ErrorDetail::kLinkGone);
  EXPECT_EQ(RoundTrip<StatusReply>(Encode(6, StatusReply::FromStatus(absl::NotFoundError("x"))))
                .detail,
            0);
  // "gone" is 3 bytes longer than "x"; the detail 2 more.
  EXPECT_EQ(Encode(6, StatusReply::FromStatus(absl::NotFoundError("x"))).size() + 3 + 2,
            Encode(6, typed).size());

  // A commit of a put with link blocks says how long the links took; a lookup never does.
  CacheSummary sum;
  sum.layout = KvLayout{2, 2, 2, 64, DType::kBF16};
  sum.original_tokens = 4;
  EXPECT_EQ(RoundTrip<CacheSummary>(Encode(5, sum)).link_ns, 0u);
  sum.link_ns = 123456;
  EXPECT_EQ(RoundTrip<CacheSummary>(Encode(5, sum)).link_ns, 123456u);
  EXPECT_EQ(RoundTrip<CacheSummary>(EncodeLookupReply(5, sum)).link_ns, 0u);

  // A link get (minor 5): the frame's data part is the link's descriptor; its answer names the
  // transfer and carries no payload.
  Get lg;
  lg.representation = Representation::kDecoded;
  lg.model_id = "m";
  lg.key = "k";
  lg.link_channel = 9;
  lg.link_capacity = 1 << 20;
  lg.link_dense = true;
  lg.link_layer_major = true;
  lg.link_bytes = 300;
  const std::string lgf = Encode(8, lg);
  EXPECT_EQ(MustParse(lgf, 300).header.payload_bytes, 300u);
  Get lgo = RoundTrip<Get>(lgf, 300);
  EXPECT_EQ(lgo.link_channel, 9u);
  EXPECT_EQ(lgo.link_capacity, uint64_t{1} << 20);
  EXPECT_TRUE(lgo.link_dense);
  EXPECT_TRUE(lgo.link_layer_major);
  EXPECT_EQ(lgo.link_bytes, 300u);
  EXPECT_EQ(lgo.representation, Representation::kDecoded);
  for (auto bad : {+[](Get& m) { m.link_capacity = 0; },
                   +[](Get& m) { m.link_dense = false; },  // layer by layer of a stored get
                   +[](Get& m) { m.link_bytes = kMaxLinkDescriptorBytes + 1; },
                   +[](Get& m) { m.shared = true; }}) {
    Get m = lg;
    bad(m);
    const std::string frame = Encode(8, m);
    EXPECT_TRUE(absl::IsInvalidArgument(Decode(MustParse(frame, m.link_bytes), &lgo)));
  }
  GetReply lr;
  lr.link = true;
  lr.link_payload_bytes = 4096;
  lr.layout = KvLayout{2, 2, 2, 64, DType::kBF16};
  lr.num_tokens = 8;
  lr.link_ns = 777;
  GetReply lro = RoundTrip<GetReply>(Encode(8, lr, 4096));  // no payload travels
  EXPECT_TRUE(lro.link);
  EXPECT_EQ(lro.link_payload_bytes, 4096u);
  EXPECT_EQ(lro.layout, lr.layout);
  EXPECT_EQ(lro.num_tokens, 8u);
  EXPECT_EQ(lro.link_ns, 777u);
  lr.layout = KvLayout{};  // bytes that are not a kvcomp cache: no layout
  EXPECT_EQ(RoundTrip<GetReply>(Encode(8, lr, 0)).layout.num_layers, 0u);

  Get direct{Representation::kStored, "m", "k", false, 0x7f0000001000, 1 << 20, true};
  Get dout = RoundTrip<Get>(Encode(1, direct));
  EXPECT_TRUE(dout.direct);
  EXPECT_FALSE(dout.shared);
  EXPECT_EQ(dout.shm_offset, direct.shm_offset);

  Get g{Representation::kStored, "m", "k", true, 4096, 1 << 20};
  Get go = RoundTrip<Get>(Encode(1, g));
  EXPECT_TRUE(go.shared);
  EXPECT_EQ(go.shm_offset, 4096u);
  EXPECT_EQ(go.shm_capacity, uint64_t{1} << 20);
  EXPECT_FALSE(RoundTrip<Get>(Encode(1, Get{Representation::kStored, "m", "k"})).shared);
  EXPECT_FALSE(go.or_payload);
  // Or-payload (minor 3) rides with either flag, never alone.
  for (bool is_direct : {false, true}) {
    Get op = is_direct ? direct : g;
    op.or_payload = true;
    Get oo = RoundTrip<Get>(Encode(1, op));
    EXPECT_TRUE(oo.or_payload);
    EXPECT_EQ(oo.direct, is_direct);
    EXPECT_EQ(oo.shm_capacity, op.shm_capacity);
  }
  Get lone{Representation::kStored, "m", "k"};
  lone.or_payload = true;
  EXPECT_FALSE(RoundTrip<Get>(Encode(1, lone)).or_payload);  // not encoded without a flag
  std::string forged = Encode(1, lone);
  forged[32 + 1] = 8;  // the flags byte: or-payload alone
  Get fout;
  EXPECT_TRUE(absl::IsInvalidArgument(Decode(MustParse(Reseal(forged)), &fout)));

  GetReply r;
  r.shared = true;
  r.shm_bytes = 12345;
  const std::string rf = Encode(1, r, 999);  // a shared reply carries no payload
  EXPECT_EQ(MustParse(rf).header.payload_bytes, 0u);
  GetReply ro = RoundTrip<GetReply>(rf);
  EXPECT_TRUE(ro.shared);
  EXPECT_EQ(ro.shm_bytes, 12345u);
  GetReply with_crc = r;
  with_crc.has_crc = true;
  GetReply rout;
  EXPECT_TRUE(absl::IsInvalidArgument(Decode(MustParse(Encode(1, with_crc, 0)), &rout)));
}

TEST(ProtocolTest, MalformedFramesAreRefused) {
  const std::string good = Encode(3, Lookup{"m", "k"});
  // Truncated below the header, and in the body.
  for (size_t n : {size_t{0}, size_t{10}, size_t{31}}) {
    EXPECT_EQ(ParseFrame(good.substr(0, n), 0).status().code(), absl::StatusCode::kDataLoss) << n;
  }
  EXPECT_EQ(ParseFrame(good.substr(0, good.size() - 1), 0).status().code(),
            absl::StatusCode::kDataLoss);
  // Extra bytes after the announced body.
  EXPECT_EQ(ParseFrame(good + "x", 0).status().code(), absl::StatusCode::kDataLoss);
  // Bad magic.
  std::string bad = good;
  bad[0] = 'X';
  EXPECT_EQ(ParseFrame(bad, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PeekRequestId(bad), 0u);
  // Every single-bit flip in the header or body is caught (checksum or a field check).
  for (size_t i = 0; i < good.size() * 8; ++i) {
    std::string flipped = good;
    flipped[i / 8] ^= static_cast<char>(1 << (i % 8));
    EXPECT_FALSE(ParseFrame(flipped, 0).ok()) << "bit " << i;
  }
  // Future major version (resealed so only the version is wrong).
  std::string future = good;
  future[4] = 2;
  EXPECT_EQ(ParseFrame(Reseal(future), 0).status().code(), absl::StatusCode::kFailedPrecondition);
  // A newer minor version is accepted.
  std::string minor = good;
  minor[5] = 7;
  EXPECT_TRUE(ParseFrame(Reseal(minor), 0).ok());
  // Unknown message type.
  std::string unknown = good;
  unknown[6] = 99;
  EXPECT_EQ(ParseFrame(Reseal(unknown), 0).status().code(), absl::StatusCode::kUnimplemented);
  // Reserved flags.
  std::string flags = good;
  flags[7] = 1;
  EXPECT_EQ(ParseFrame(Reseal(flags), 0).status().code(), absl::StatusCode::kInvalidArgument);
  // Oversized frame and payload.
  std::string huge = WithBody(good, std::string(kMaxFrameBytes, 'a'));
  EXPECT_EQ(ParseFrame(huge, 0).status().code(), absl::StatusCode::kInvalidArgument);
  std::string big_payload = good;
  const uint64_t too_big = kMaxPayloadBytes + 1;
  std::memcpy(&big_payload[16], &too_big, 8);
  EXPECT_EQ(ParseFrame(Reseal(big_payload), too_big).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ProtocolTest, MalformedBodiesAreRefused) {
  const std::string good = Encode(3, SampleBegin());
  const Frame f = MustParse(good);
  const std::string body(f.body);
  PutBegin out;
  // Every truncation of the body.
  for (size_t n = 0; n < body.size(); ++n) {
    absl::Status s = Decode(MustParse(WithBody(good, body.substr(0, n))), &out);
    EXPECT_FALSE(s.ok()) << n;
  }
  // Trailing bytes.
  EXPECT_EQ(Decode(MustParse(WithBody(good, body + "z")), &out).code(),
            absl::StatusCode::kInvalidArgument);
  // Wrong decoder for the type.
  Hello h;
  EXPECT_EQ(Decode(f, &h).code(), absl::StatusCode::kInvalidArgument);
  // Field by field: put_id 0, num_tokens 0, bad dtype, bad head_dim, unknown flag.
  auto patched = [&](size_t off, const void* v, size_t n) {
    std::string b = body;
    std::memcpy(&b[off], v, n);
    return Decode(MustParse(WithBody(good, b)), &out);
  };
  const uint64_t zero = 0;
  EXPECT_EQ(patched(0, &zero, 8).code(), absl::StatusCode::kInvalidArgument);  // put_id
  EXPECT_EQ(patched(8, &zero, 8).code(), absl::StatusCode::kInvalidArgument);  // num_tokens
  const uint32_t dim = 100;
  EXPECT_EQ(patched(28, &dim, 4).code(), absl::StatusCode::kInvalidArgument);  // head_dim
  const uint8_t dtype = 9;
  EXPECT_EQ(patched(32, &dtype, 1).code(), absl::StatusCode::kInvalidArgument);
  const uint8_t flag = 0x80;
  EXPECT_EQ(patched(33, &flag, 1).code(), absl::StatusCode::kInvalidArgument);
  const uint8_t reserved = 1;
  EXPECT_EQ(patched(34, &reserved, 1).code(), absl::StatusCode::kInvalidArgument);
  // String longer than its limit (model id length 200 > 128).
  const uint16_t long_len = 200;
  EXPECT_FALSE(patched(36, &long_len, 2).ok());
  // Policy that does not validate (ratio 1.5).
  PutBegin bad = SampleBegin();
  bad.policy.ratio = 1.5;
  EXPECT_EQ(Decode(MustParse(Encode(1, bad)), &out).code(), absl::StatusCode::kInvalidArgument);
  // A message without payload announcing one.
  std::string with_payload = Encode(1, Lookup{"m", "k"});
  const uint64_t five = 5;
  std::memcpy(&with_payload[16], &five, 8);
  Lookup lo;
  EXPECT_EQ(Decode(MustParse(Reseal(with_payload), 5), &lo).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ProtocolTest, RandomBytesNeverCrash) {
  std::mt19937_64 rng(1);
  const std::string seeds[] = {Encode(1, SampleBegin()), Encode(1, Hello{"a", "b", "c"}),
                               Encode(1, Busy{1, 2, 3}), Encode(1, Get{})};
  for (int i = 0; i < 20000; ++i) {
    std::string f = seeds[i % 4];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) f[rng() % f.size()] = static_cast<char>(rng());
    if (rng() % 2) f.resize(rng() % (f.size() + 1));
    if (rng() % 2 && f.size() >= kFrameHeaderBytes) f = Reseal(f);
    absl::StatusOr<Frame> p = ParseFrame(f, 0);
    if (!p.ok()) continue;
    PutBegin a;
    Hello b;
    Busy c;
    Get d;
    (void)Decode(*p, &a);
    (void)Decode(*p, &b);
    (void)Decode(*p, &c);
    (void)Decode(*p, &d);
  }
}

}  // namespace
}  // namespace wire
}  // namespace transport
}  // namespace kvcomp
