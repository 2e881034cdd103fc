// Device payloads on the UCX data plane (docs/protocol.md, "CUDA-aware UCX"): what a server and
// a client negotiate at hello, and how device-memory claims are refused where the UCX in use
// has no CUDA transports. Runs against whatever UCX the test is linked with: Debian's 1.13
// (no CUDA) in the main build, the libucx-cu13 wheel's 1.22 in make test's second build, which
// has cuda_copy / cuda_ipc but finds no CUDA driver on a CPU machine, so it reports no CUDA
// memory either. On a machine where this UCX does have CUDA memory, the refusals are skipped
// and the negotiation is checked the other way round.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/transport/client.h"
#include "kvcomp/transport/protocol.h"
#include "kvcomp/transport/server.h"
#include "transport/memory_handler.h"

namespace kvcomp {
namespace transport {
namespace {

using ::kvcomp::testing::MemoryHandler;

KvLayout SmallLayout() {
  KvLayout l;
  l.num_layers = 2;
  l.num_kv_heads = 2;
  l.num_q_heads = 2;
  l.head_dim = 64;
  l.dtype = DType::kF16;
  return l;
}

// Re-seals a frame after its header bytes were changed (the frame CRC covers them).
std::string Reseal(std::string f) {
  uint32_t body_bytes;
  std::memcpy(&body_bytes, f.data() + 24, 4);
  const uint32_t crc = Crc32cExtend(Crc32cExtend(0, f.data(), 28), f.data() + 32, body_bytes);
  std::memcpy(f.data() + 28, &crc, 4);
  return f;
}

class CudaUcxTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // UCX's own choice of transports: naming some (UCX_TLS=tcp) would leave the CUDA ones out,
    // and the context would then rightly say it has no CUDA memory.
    ServerOptions so;
    absl::StatusOr<std::unique_ptr<UcxServer>> s = UcxServer::Start(so, &handler_);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    absl::StatusOr<UcxCapabilities> caps = QueryUcxCapabilities();
    ASSERT_TRUE(caps.ok()) << caps.status();
    caps_ = *caps;
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Stop();
  }
  absl::StatusOr<std::unique_ptr<UcxClient>> Connect(ClientOptions o = {}) {
    return UcxClient::Connect(Endpoint{"127.0.0.1", server_->port()}, "acme", "secret", o);
  }
  wire::PutBegin Begin() {
    wire::PutBegin b;
    b.layout = SmallLayout();
    b.num_tokens = 8;
    b.model_id = "m";
    b.key = "k";
    return b;
  }
  // A keys-only block of layer 0 over all tokens.
  wire::Block KeysBlock(uint64_t put_id) {
    wire::Block b;
    b.put_id = put_id;
    b.layer_begin = 0;
    b.layer_end = 1;
    b.token_begin = 0;
    b.token_end = 8;
    b.parts = wire::kPartKeys;
    b.key_bytes = SmallLayout().LayerBytes(8);
    return b;
  }

  MemoryHandler handler_{std::map<std::string, std::string>{{"acme", "secret"}}};
  std::unique_ptr<UcxServer> server_;
  UcxCapabilities caps_;
};

TEST(CudaUcxProtocolTest, FlagsRoundTrip) {
  wire::HelloOk ok;
  ok.server_flags = wire::kServerCudaMemory;
  ok.tenant = "acme";
  std::string f = wire::Encode(7, ok);
  absl::StatusOr<wire::Frame> frame = wire::ParseFrame(f, 0);
  ASSERT_TRUE(frame.ok()) << frame.status();
  EXPECT_EQ(frame->header.minor, wire::kMinorVersion);
  wire::HelloOk back;
  ASSERT_TRUE(wire::Decode(*frame, &back).ok());
  EXPECT_EQ(back.server_flags, wire::kServerCudaMemory);

  wire::Block b;
  b.put_id = 1;
  b.layer_begin = 0;
  b.layer_end = 1;
  b.token_begin = 0;
  b.token_end = 4;
  b.parts = wire::kPartKeys;
  b.key_bytes = 512;
  b.flags = wire::kBlockDevicePayload;
  f = wire::Encode(8, b);
  frame = wire::ParseFrame(f, 512);
  ASSERT_TRUE(frame.ok()) << frame.status();
  wire::Block bb;
  ASSERT_TRUE(wire::Decode(*frame, &bb).ok());
  EXPECT_EQ(bb.flags, wire::kBlockDevicePayload);

  // A device payload claims no checksum; unknown flags are refused.
  b.key_crc = 0x1234;
  f = wire::Encode(9, b);
  frame = wire::ParseFrame(f, 512);
  ASSERT_TRUE(frame.ok());
  absl::Status s = wire::Decode(*frame, &bb);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("no checksums"), absl::string_view::npos) << s;
  b.key_crc = 0;
  b.flags = 0x80;
  f = wire::Encode(10, b);
  frame = wire::ParseFrame(f, 512);
  ASSERT_TRUE(frame.ok());
  s = wire::Decode(*frame, &bb);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("unknown block flags"), absl::string_view::npos) << s;
}

// Hello-ok offers device payloads exactly when this UCX has CUDA memory; the client's
// DevicePayloads() says which side lacks it.
TEST_F(CudaUcxTest, NegotiatedAtHello) {
  EXPECT_EQ(server_->cuda_memory(), caps_.cuda_memory);
  EXPECT_EQ(server_->stats().cuda_memory, caps_.cuda_memory ? 1u : 0u);
  auto c = Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->server_info().server_minor, wire::kMinorVersion);
  const bool offered = ((*c)->server_info().server_flags & wire::kServerCudaMemory) != 0;
  EXPECT_EQ(offered, caps_.cuda_memory);
  absl::Status s = (*c)->DevicePayloads();
  if (caps_.cuda_memory) {
    EXPECT_TRUE(s.ok()) << s;
  } else {
    EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
    EXPECT_NE(s.message().find("no CUDA memory support"), absl::string_view::npos) << s;
  }
}

// A client of protocol minor 0 checks that hello-ok's reserved bytes are zero: it is never
// offered device payloads, whatever this UCX can do.
TEST_F(CudaUcxTest, MinorZeroClientGetsNoServerFlags) {
  ClientOptions o;
  o.send_hello = false;
  auto c = Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  wire::Hello hello{"acme", "secret", "old-client"};
  std::string frame = wire::Encode(5, hello);
  frame[5] = 0;  // minor 0
  absl::StatusOr<RawReply> r = (*c)->SendRawForTesting(5, Reseal(frame), "");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->header.type, wire::MessageType::kHelloOk) << r->status;
  ASSERT_GE(r->body.size(), 8u);
  for (int i = 2; i < 8; ++i) EXPECT_EQ(r->body[i], 0) << "hello-ok byte " << i;
}

// Device memory claimed where this UCX has no CUDA memory: the client refuses before sending,
// the put stays usable, and a block flagged as a device payload sent anyway is refused by the
// server (FailedPrecondition, counted) without its payload being taken.
TEST_F(CudaUcxTest, DeviceClaimsRefusedWithoutCudaUcx) {
  if (caps_.cuda_memory) GTEST_SKIP() << "this UCX has CUDA memory";
  auto c = Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<uint64_t> put = (*c)->PutBegin(Begin());
  ASSERT_TRUE(put.ok()) << put.status();
  const wire::Block b = KeysBlock(*put);
  std::vector<uint8_t> keys(b.key_bytes, 7);

  absl::Status s = (*c)->SendBlock(b, keys.data(), nullptr, MemoryType::kCuda);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("device memory"), absl::string_view::npos) << s;
  EXPECT_EQ(server_->stats().device_payload_blocks, 0u);

  // Receiving into device memory is refused the same way.
  absl::StatusOr<size_t> got = (*c)->GetInto("m", "k", wire::Representation::kStored,
                                             keys.data(), keys.size(), MemoryType::kCuda);
  EXPECT_TRUE(absl::IsFailedPrecondition(got.status())) << got.status();

  // The same block flagged as a device payload, straight onto the wire.
  wire::Block flagged = b;
  flagged.flags = wire::kBlockDevicePayload;
  const uint64_t before = server_->stats().rejected_by_code[static_cast<int>(
      absl::StatusCode::kFailedPrecondition)];
  absl::StatusOr<RawReply> r = (*c)->SendRawForTesting(
      900, wire::Encode(900, flagged),
      absl::string_view(reinterpret_cast<const char*>(keys.data()), keys.size()));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(absl::IsFailedPrecondition(r->status)) << r->status;
  EXPECT_NE(r->status.message().find("no CUDA memory support"), absl::string_view::npos)
      << r->status;
  EXPECT_EQ(server_->stats().rejected_by_code[static_cast<int>(
                absl::StatusCode::kFailedPrecondition)],
            before + 1);
  EXPECT_EQ(server_->stats().device_payload_blocks, 0u);

  // The put goes on over host memory, checksummed, and commits.
  ASSERT_TRUE((*c)->SendBlock(b, keys.data(), nullptr).ok());
  wire::Block v = b;
  v.parts = wire::kPartValues;
  v.value_bytes = v.key_bytes;
  v.key_bytes = 0;
  ASSERT_TRUE((*c)->SendBlock(v, nullptr, keys.data()).ok());
  wire::Block l1 = b;
  l1.layer_begin = 1;
  l1.layer_end = 2;
  l1.parts = wire::kPartBoth;
  l1.value_bytes = l1.key_bytes;
  std::vector<uint8_t> both(l1.payload_bytes(), 9);
  ASSERT_TRUE((*c)->SendBlock(l1, both.data(), both.data() + l1.key_bytes).ok());
  absl::StatusOr<wire::CacheSummary> sum = (*c)->PutCommit(*put, 3);
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_EQ(sum->original_tokens, 8u);
  EXPECT_EQ(server_->stats().blocks_into_device, 0u);
}

// Device keys and values that are not adjacent go as two blocks: one block refuses them
// (before anything is sent), also where device payloads are negotiated.
TEST_F(CudaUcxTest, DeviceBlockNeedsAdjacentParts) {
  if (!caps_.cuda_memory) GTEST_SKIP() << "this UCX has no CUDA memory";
  auto c = Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<uint64_t> put = (*c)->PutBegin(Begin());
  ASSERT_TRUE(put.ok()) << put.status();
  wire::Block b = KeysBlock(*put);
  b.parts = wire::kPartBoth;
  b.value_bytes = b.key_bytes;
  std::vector<uint8_t> k(b.key_bytes), v(b.value_bytes);
  absl::Status s = (*c)->SendBlock(b, k.data(), v.data(), MemoryType::kCuda);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
}

}  // namespace
}  // namespace transport
}  // namespace kvcomp
