// The GPU channel's negotiation against real kvcompd processes, where no GPU is needed: what a
// daemon without NCCL or a CUDA device answers (and why), the loader's messages for a missing
// or foreign NCCL library, authentication of every GPU channel call (counted), bad input
// refused before any channel is looked up, channels that are not the caller's reading as
// absent (on the control plane and for a data-plane put's link block), and the SDK's negotiation saying why it falls back; the
// same for the CUDA IPC mode of a client on the daemon's GPU (malformed handles and chunks,
// a daemon without CUDA) and the layer-by-layer calls. The transfers themselves run on GPU
// machines (gpu_channel_gpu_test.cc).
#include <fstream>
#include <utility>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "integration/kvcompd_process.h"
#include "kvcomp/client/client.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/client.h"

namespace kvcomp {
namespace {

using client::Client;
using client::ClientOptions;
using testing::ControlClient;
using testing::KvcompdProcess;
using testing::MakeAuth;
using testing::TempDir;

constexpr int64_t kTokens = 16;
constexpr int64_t kPayload = 2 * 2 * 2 * kTokens * 64 * 2;  // K+V, 2 layers, 2 heads, f16

class GpuChannelTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> flags = {}, std::vector<std::string> env = {}) {
    std::ofstream(dir_.path() + "/tokens.yaml") << "alpha: secret-a\nbeta: secret-b\n";
    flags.push_back("--auth.token_file=" + dir_.path() + "/tokens.yaml");
    daemon_ = std::make_unique<KvcompdProcess>(KVCOMPD_PATH, dir_.path() + "/d", flags);
    for (const std::string& e : env) daemon_->SetEnv(e);
    ASSERT_TRUE(daemon_->Start()) << daemon_->Log();
  }
  rpc::Auth Alpha() const { return MakeAuth("alpha", "secret-a"); }
  rpc::Auth Beta() const { return MakeAuth("beta", "secret-b"); }
  int control_port() const { return daemon_->ports().control; }

  TempDir dir_;
  std::unique_ptr<KvcompdProcess> daemon_;
};

TEST_F(GpuChannelTest, DaemonWithoutNcclRefusesTheChannelAndSaysWhy) {
  // Where NCCL exists but no GPU does, the daemon says that instead; either way no channel.
  Start({}, {"KVCOMP_NCCL_LIBRARY=/nonexistent/libnccl.so.2"});
  ControlClient c(control_port());
  rpc::GpuChannelRequest req;
  req.device_uuid = std::string(16, '\x01');
  rpc::GpuChannelResponse r;
  c->OpenGpuChannel(r, Alpha(), req);
  EXPECT_EQ(r.status.code, rpc::StatusCode::FAILED_PRECONDITION) << r.status.message;
  EXPECT_TRUE(absl::StrContains(r.status.message, "no GPU channel")) << r.status.message;
  EXPECT_TRUE(absl::StrContains(r.status.message, "/nonexistent/libnccl.so.2"))
      << r.status.message;
  EXPECT_EQ(r.channel_id, 0);
  EXPECT_TRUE(r.nccl_unique_id.empty());
  EXPECT_TRUE(absl::StrContains(daemon_->Log(), "no GPU channel")) << daemon_->Log();
  // The data plane is untouched: the daemon is healthy and serves.
  rpc::HealthResponse h;
  c->Health(h, Alpha());
  EXPECT_TRUE(h.ready);
}

TEST_F(GpuChannelTest, ALibraryThatIsNotNcclIsNamed) {
  Start({}, {"KVCOMP_NCCL_LIBRARY=libz.so.1"});
  ControlClient c(control_port());
  rpc::GpuChannelRequest req;
  req.device_uuid = std::string(16, '\x01');
  rpc::GpuChannelResponse r;
  c->OpenGpuChannel(r, Alpha(), req);
  EXPECT_EQ(r.status.code, rpc::StatusCode::FAILED_PRECONDITION) << r.status.message;
  EXPECT_TRUE(absl::StrContains(r.status.message, "libz.so.1 is not a usable NCCL"))
      << r.status.message;
}

TEST_F(GpuChannelTest, TurnedOffByConfiguration) {
  Start({"--data_plane.gpu_channel=false"});
  ControlClient c(control_port());
  rpc::GpuChannelRequest req;
  req.device_uuid = std::string(16, '\x01');
  rpc::GpuChannelResponse r;
  c->OpenGpuChannel(r, Alpha(), req);
  EXPECT_EQ(r.status.code, rpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(r.status.message, "data_plane.gpu_channel")) << r.status.message;
}

TEST_F(GpuChannelTest, EveryCallAuthenticatesAndFailuresAreCounted) {
  Start();
  ControlClient c(control_port());
  const rpc::Auth bad = MakeAuth("alpha", "wrong");
  const rpc::Auth nobody = MakeAuth("", "");
  for (const rpc::Auth& auth : {bad, nobody}) {
    rpc::GpuChannelRequest req;
    req.device_uuid = std::string(16, '\x01');
    rpc::GpuChannelResponse open;
    c->OpenGpuChannel(open, auth, req);
    EXPECT_EQ(open.status.code, rpc::StatusCode::UNAUTHENTICATED);
    rpc::GpuCloseResponse close;
    c->CloseGpuChannel(close, auth, 1);
    EXPECT_EQ(close.status.code, rpc::StatusCode::UNAUTHENTICATED);
  }
  const std::string m = testing::HttpGet(daemon_->ports().metrics, "/metrics").body;
  EXPECT_EQ(testing::MetricValue(m, "kvcomp_auth_failures_total{plane=\"control\"}"), 4) << m;
}

TEST_F(GpuChannelTest, BadInputIsRefusedBeforeAnyChannelIsLookedUp) {
  Start();
  ControlClient c(control_port());
  {
    rpc::GpuChannelRequest req;
    req.device_uuid = "short";
    rpc::GpuChannelResponse r;
    c->OpenGpuChannel(r, Alpha(), req);
    EXPECT_EQ(r.status.code, rpc::StatusCode::INVALID_ARGUMENT) << r.status.message;
  }
  // A well-formed request on a channel that is not the caller's (none is open here, and another
  // tenant's reads the same): NOT_FOUND with the typed detail LINK_GONE (the SDK reopens on the
  // detail, not the message), for every call that names a channel.
  const auto link_gone = [](const rpc::Status& st) {
    return st.__isset.detail && st.detail == ErrorDetailToWire(ErrorDetail::kLinkGone);
  };
  for (const rpc::Auth& auth : {Alpha(), Beta()}) {
    rpc::GpuCloseResponse cl;
    c->CloseGpuChannel(cl, auth, 7);
    EXPECT_EQ(cl.status.code, rpc::StatusCode::NOT_FOUND);
    EXPECT_TRUE(link_gone(cl.status)) << cl.status.message;
  }
  // Nothing was stored or left open by any of it.
  rpc::StatsResponse st;
  c->Stats(st, Alpha());
  EXPECT_EQ(st.caches, 0);
  EXPECT_EQ(st.puts_in_progress, 0);
}

// A data-plane put whose block names a GPU channel (wire::kBlockLinkPayload) that is not the
// caller's (none is open on a daemon without a GPU, and another tenant's reads the same):
// NOT_FOUND with the typed detail LINK_GONE on the data plane's status reply; a link block that
// is not the whole cache, INVALID_ARGUMENT. Nothing is stored.
TEST_F(GpuChannelTest, ALinkBlockNamingNoChannelOfTheCallersIsLinkGone) {
  Start();
  for (const auto& [tenant, token] : {std::pair<std::string, std::string>{"alpha", "secret-a"},
                                      {"beta", "secret-b"}}) {
    auto conn = transport::UcxClient::Connect(
        transport::Endpoint{"127.0.0.1", static_cast<uint16_t>(daemon_->ports().data)}, tenant,
        token);
    ASSERT_TRUE(conn.ok()) << conn.status();
    transport::wire::PutBegin begin;
    begin.model_id = "m";
    begin.key = "k1";
    begin.layout = KvLayout{2, 2, 4, 64, DType::kF16};
    begin.num_tokens = kTokens;
    // A put-begin naming the channel is refused the same way before anything is opened.
    transport::wire::PutBegin linked = begin;
    linked.link_channel = 7;
    const absl::Status no_channel = (*conn)->PutBegin(linked).status();
    EXPECT_EQ(no_channel.code(), absl::StatusCode::kNotFound) << no_channel;
    EXPECT_EQ(DetailOf(no_channel), ErrorDetail::kLinkGone) << no_channel;
    absl::StatusOr<uint64_t> id = (*conn)->PutBegin(begin);
    ASSERT_TRUE(id.ok()) << id.status();
    transport::wire::Block b;
    b.put_id = *id;
    b.layer_end = 2;
    b.token_end = kTokens;
    b.parts = transport::wire::kPartBoth;
    b.key_bytes = b.value_bytes = kPayload / 2;
    b.flags = transport::wire::kBlockLinkPayload;
    b.link_channel = 7;
    auto send = [&](const transport::wire::Block& block) {
      absl::Notification n;
      absl::Status out;
      (*conn)->SendLinkBlockAsync(block, "", [&](absl::Status s) {
        out = std::move(s);
        n.Notify();
      });
      n.WaitForNotification();
      return out;
    };
    const absl::Status gone = send(b);
    EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound) << gone;
    EXPECT_EQ(DetailOf(gone), ErrorDetail::kLinkGone) << gone;
    transport::wire::Block half = b;
    half.layer_end = 1;
    half.key_bytes = half.value_bytes = kPayload / 4;
    EXPECT_EQ(send(half).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE((*conn)->PutAbort(*id).ok());
  }
  ControlClient c(control_port());
  rpc::StatsResponse st;
  c->Stats(st, Alpha());
  EXPECT_EQ(st.caches, 0);
  EXPECT_EQ(st.puts_in_progress, 0);
}

// A data-plane get naming a GPU channel (wire::Get::link_channel) that is not the caller's
// (none is open on a daemon without a GPU, and another tenant's reads the same): NOT_FOUND with
// the typed detail LINK_GONE, with or without a link descriptor (one larger than a frame comes
// as the get's data part); a link get the wire does not allow (layer by layer of a stored get),
// INVALID_ARGUMENT. A cache the caller holds changes nothing: no channel, no transfer.
TEST_F(GpuChannelTest, ALinkGetNamingNoChannelOfTheCallersIsLinkGone) {
  Start();
  for (const auto& [tenant, token] : {std::pair<std::string, std::string>{"alpha", "secret-a"},
                                      {"beta", "secret-b"}}) {
    auto conn = transport::UcxClient::Connect(
        transport::Endpoint{"127.0.0.1", static_cast<uint16_t>(daemon_->ports().data)}, tenant,
        token);
    ASSERT_TRUE(conn.ok()) << conn.status();
    if (tenant == "alpha") {  // alpha's cache k1 is stored; beta's get of it reads as absent
      transport::wire::PutBegin begin;
      begin.model_id = "m";
      begin.key = "k1";
      begin.layout = KvLayout{2, 2, 4, 64, DType::kF16};
      begin.num_tokens = kTokens;
      absl::StatusOr<uint64_t> id = (*conn)->PutBegin(begin);
      ASSERT_TRUE(id.ok()) << id.status();
      std::vector<uint8_t> kv(kPayload, 1);
      transport::wire::Block b;
      b.put_id = *id;
      b.layer_end = 2;
      b.token_end = kTokens;
      b.parts = transport::wire::kPartBoth;
      b.key_bytes = b.value_bytes = kPayload / 2;
      ASSERT_TRUE((*conn)->SendBlock(b, kv.data(), kv.data() + kPayload / 2).ok());
      ASSERT_TRUE((*conn)->PutCommit(*id, 1).ok());
    }
    transport::wire::Get g;
    g.model_id = "m";
    g.key = "k1";
    g.link_channel = 7;
    g.link_capacity = kPayload;
    g.link_dense = true;
    for (const std::string& descriptor : {std::string(), std::string(10000, 'd')}) {
      absl::StatusOr<transport::wire::GetReply> r =
          (*conn)->GetOverLink(g, descriptor, absl::InfiniteFuture());
      EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
      EXPECT_EQ(DetailOf(r.status()), ErrorDetail::kLinkGone) << r.status();
    }
    transport::wire::Get stored_by_layer = g;
    stored_by_layer.link_dense = false;
    stored_by_layer.link_layer_major = true;
    const absl::Status bad =
        (*conn)->GetOverLink(stored_by_layer, "", absl::InfiniteFuture()).status();
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
    // The connection serves on.
    EXPECT_TRUE((*conn)->Ping().ok());
  }
  ControlClient c(control_port());
  rpc::StatsResponse st;
  c->Stats(st, Alpha());
  EXPECT_EQ(st.caches, 1);
  EXPECT_EQ(st.puts_in_progress, 0);
}

TEST_F(GpuChannelTest, IpcModeNegotiationAndBadInput) {
  Start();
  ControlClient c(control_port());
  // A malformed interprocess event is refused before anything else is looked at.
  {
    rpc::GpuChannelRequest req;
    req.device_uuid = std::string(16, 'u');
    req.__set_ipc_event("short");
    rpc::GpuChannelResponse r;
    c->OpenGpuChannel(r, Alpha(), req);
    EXPECT_EQ(r.status.code, rpc::StatusCode::INVALID_ARGUMENT) << r.status.message;
    // Unauthenticated: refused as every other call, whatever it offers.
    c->OpenGpuChannel(r, MakeAuth("alpha", "wrong"), req);
    EXPECT_EQ(r.status.code, rpc::StatusCode::UNAUTHENTICATED);
    // A well-formed offer to a daemon without a CUDA device: no channel of either mode, why.
    req.__set_ipc_event(std::string(64, 'e'));
    c->OpenGpuChannel(r, Alpha(), req);
    EXPECT_EQ(r.status.code, rpc::StatusCode::FAILED_PRECONDITION) << r.status.message;
    EXPECT_TRUE(absl::StrContains(r.status.message, "no GPU channel")) << r.status.message;
    EXPECT_EQ(r.channel_id, 0);
    EXPECT_FALSE(r.__isset.mode);
  }
  rpc::StatsResponse st;
  c->Stats(st, Alpha());
  EXPECT_EQ(st.caches, 0);
  EXPECT_EQ(st.puts_in_progress, 0);
}

TEST_F(GpuChannelTest, LayerByLayerCallsCheckTheirInput) {
  Start();
  const std::string data = daemon_->data_endpoint();
  const std::string control = "127.0.0.1:" + std::to_string(control_port());
  ClientOptions o;
  o.tenant = "alpha";
  o.token = "secret-a";
  o.ucx_overrides = {{"TLS", "tcp"}};
  auto c = Client::Connect({data + "," + control}, o);
  ASSERT_TRUE(c.ok()) << c.status();
  KvLayout layout;
  layout.num_layers = 2;
  layout.num_kv_heads = 2;
  layout.num_q_heads = 4;
  layout.head_dim = 64;
  layout.dtype = DType::kF16;
  // A layout that does not validate, and no tokens: refused before anything else.
  KvLayout wrong = layout;
  wrong.head_dim = 100;
  EXPECT_EQ((*c)->OpenDevicePutStream("m", "k", wrong, kTokens, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*c)->OpenDevicePutStream("m", "k", layout, 0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*c)->OpenDevicePutStream("m", "", layout, kTokens, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  // This machine has no CUDA driver: a clear refusal, never host memory taken for device memory.
  auto put = (*c)->OpenDevicePutStream("m", "k", layout, kTokens, 0);
  ASSERT_FALSE(put.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(put.status())) << put.status();
  std::vector<uint8_t> host(static_cast<size_t>(kPayload));
  std::vector<client::DeviceLayerOut> out(2, {host.data(), host.data()});
  auto get = (*c)->OpenDeviceGetStream("m", "k", layout, kTokens, out, nullptr);
  ASSERT_FALSE(get.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(get.status()) || absl::IsInvalidArgument(get.status()))
      << get.status();
  std::vector<client::DeviceLayerOut> one(1, {host.data(), host.data()});
  EXPECT_EQ((*c)->OpenDeviceGetStream("m", "k", layout, kTokens, one, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(GpuChannelTest, ClientNegotiationSaysWhyItFallsBack) {
  Start();
  const std::string data = daemon_->data_endpoint();
  const std::string control = "127.0.0.1:" + std::to_string(control_port());
  ClientOptions o;
  o.tenant = "alpha";
  o.token = "secret-a";
  o.ucx_overrides = {{"TLS", "tcp"}};
  {
    // Without a control address there is nowhere to negotiate.
    auto c = Client::Connect({data}, o);
    ASSERT_TRUE(c.ok()) << c.status();
    absl::Status s = (*c)->ProbeGpuChannel(data, 0);
    EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "no control address")) << s;
  }
  auto c = Client::Connect({data + "," + control}, o);
  ASSERT_TRUE(c.ok()) << c.status();
  // This machine has no NCCL (or no GPU): the probe says so, and device calls refuse host memory
  // rather than guess.
  absl::Status s = (*c)->ProbeGpuChannel(data, 0);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.message(), "NCCL") || absl::StrContains(s.message(), "CUDA"))
      << s;
  std::vector<uint8_t> host(static_cast<size_t>(kPayload));
  KvLayout layout;
  layout.num_layers = 2;
  layout.num_kv_heads = 2;
  layout.num_q_heads = 4;
  layout.head_dim = 64;
  layout.dtype = DType::kF16;
  std::vector<client::DeviceLayerData> layers(2, {host.data(), host.data()});
  auto put = (*c)->PutDevice("m", "k1", layout, kTokens, layers, nullptr);
  ASSERT_FALSE(put.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(put.status()) || absl::IsInvalidArgument(put.status()))
      << put.status();
  EXPECT_EQ((*c)->ProbeGpuChannel("127.0.0.1:1", 0).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvcomp
