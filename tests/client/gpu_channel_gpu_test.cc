// GPU channel transfers on a GPU machine (label gpu; skipped without a CUDA device): device
// puts and gets through real kvcompd processes, byte for byte under a lossless policy (ratio 0,
// raw codecs), over NCCL between two GPUs and through host memory over UCX where no channel can
// be had (one GPU, or no NCCL at the daemon); a channel another tenant names; peers that die in
// the middle of a transfer (a client killed with half its payload sent, an NCCL peer killed
// after joining) leave nothing hanging; on one GPU, CUDA IPC; layer by layer. NCCL comes from KVCOMP_NCCL_LIBRARY or the usual places
// (kvcomp/transport/gpu_link.h); the daemons keep NVLink multicast off (NCCL_NVLS_ENABLE=0).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "integration/kvcompd_process.h"
#include "kvcomp/client/client.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/transport/client.h"
#include "kvcomp/transport/gpu_link.h"

namespace kvcomp {
namespace {

using client::Client;
using client::ClientOptions;
using client::DeviceLayerData;
using client::DeviceLayerOut;
using testing::KvcompdProcess;
using testing::TempDir;
using transport::GpuRuntime;
using transport::NcclLink;

int Devices() {
  auto rt = GpuRuntime::Get();
  return rt.ok() ? (*rt)->device_count() : 0;
}

#define REQUIRE_GPUS(n)                                                                 \
  do {                                                                                  \
    if (Devices() < (n)) GTEST_SKIP() << "needs " << (n) << " CUDA device(s)";          \
    if ((n) > 1 && !GpuRuntime::LoadNccl().ok())                                        \
      GTEST_SKIP() << "no NCCL: " << GpuRuntime::LoadNccl();                            \
  } while (0)

KvLayout Layout(uint32_t layers = 4) {
  KvLayout l;
  l.num_layers = layers;
  l.num_kv_heads = 8;
  l.num_q_heads = 32;
  l.head_dim = 128;
  l.dtype = DType::kBF16;
  return l;
}

CompressionPolicy Lossless() {
  CompressionPolicy p;
  p.ratio = 0;
  p.moments = false;
  return p;
}

// K and V of every layer in device memory of `device`, from finite random bf16 values.
class DeviceCache {
 public:
  DeviceCache(GpuRuntime* rt, int device, const KvLayout& layout, uint64_t tokens, uint32_t seed)
      : rt_(rt), layout_(layout), tokens_(tokens) {
    EXPECT_TRUE(rt->SetDevice(device).ok());
    const size_t layer = layout.LayerBytes(tokens);
    host_.resize(2 * layout.num_layers * layer);
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.f, 1.f);
    for (size_t i = 0; i + 1 < host_.size(); i += 2) {
      float f = dist(rng);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      const uint16_t bf = static_cast<uint16_t>(bits >> 16);
      std::memcpy(&host_[i], &bf, 2);
    }
    for (uint32_t i = 0; i < 2 * layout.num_layers; ++i) {
      auto p = rt->AllocDevice(layer);
      EXPECT_TRUE(p.ok()) << p.status();
      ptrs_.push_back(*p);
      EXPECT_TRUE(rt->CopyAsync(*p, &host_[i * layer], layer, GpuRuntime::Copy::kHostToDevice,
                                nullptr)
                      .ok());
    }
    EXPECT_TRUE(rt->WaitStream(nullptr, absl::Now() + absl::Seconds(30)).ok());
  }
  ~DeviceCache() {
    for (void* p : ptrs_) rt_->FreeDevice(p);
  }
  std::vector<DeviceLayerData> In() const {
    std::vector<DeviceLayerData> v;
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      v.push_back({ptrs_[l], ptrs_[layout_.num_layers + l]});
    }
    return v;
  }
  std::vector<DeviceLayerOut> Out() const {
    std::vector<DeviceLayerOut> v;
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      v.push_back({ptrs_[l], ptrs_[layout_.num_layers + l]});
    }
    return v;
  }
  // The device bytes now, K layers then V layers.
  std::string Read(void* stream) const {
    const size_t layer = layout_.LayerBytes(tokens_);
    std::string out(host_.size(), '\0');
    for (size_t i = 0; i < ptrs_.size(); ++i) {
      EXPECT_TRUE(rt_->CopyAsync(&out[i * layer], ptrs_[i], layer,
                                 GpuRuntime::Copy::kDeviceToHost, stream)
                      .ok());
    }
    EXPECT_TRUE(rt_->WaitStream(stream, absl::Now() + absl::Seconds(30)).ok());
    return out;
  }
  std::string Host() const { return std::string(host_.begin(), host_.end()); }
  // Writes `other`'s device bytes over these on `stream` (device to device).
  void CopyFrom(const DeviceCache& other, void* stream) {
    const size_t layer = layout_.LayerBytes(tokens_);
    for (size_t i = 0; i < ptrs_.size(); ++i) {
      EXPECT_TRUE(rt_->CopyAsync(ptrs_[i], other.ptrs_[i], layer,
                                 GpuRuntime::Copy::kDeviceToDevice, stream)
                      .ok());
    }
  }
  // Host memory view for the data plane's Put.
  std::vector<client::LayerData> HostLayers() const {
    const size_t layer = layout_.LayerBytes(tokens_);
    std::vector<client::LayerData> v;
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      v.push_back({&host_[l * layer], &host_[(layout_.num_layers + l) * layer]});
    }
    return v;
  }

 private:
  GpuRuntime* rt_;
  KvLayout layout_;
  uint64_t tokens_;
  std::vector<uint8_t> host_;
  std::vector<void*> ptrs_;
};

// A long queue of device work on `stream` (copies back and forth of 512 MiB, some hundreds of
// milliseconds): what the caller queues after it runs only when it is done.
void QueueLongWork(GpuRuntime* rt, void* stream, int rounds = 300) {
  const size_t bytes = size_t{512} << 20;
  auto a = rt->AllocDevice(bytes);
  auto b = rt->AllocDevice(bytes);
  ASSERT_TRUE(a.ok() && b.ok());
  for (int i = 0; i < rounds; ++i) {
    ASSERT_TRUE(rt->CopyAsync(i % 2 ? *a : *b, i % 2 ? *b : *a, bytes,
                              GpuRuntime::Copy::kDeviceToDevice, stream)
                    .ok());
  }
  // Freed once the stream is done with them (cuMemFree waits for the device).
  std::thread([rt, stream, pa = *a, pb = *b] {
    (void)rt->SetDevice(0);  // the tests' streams are on device 0
    (void)rt->WaitStream(stream, absl::Now() + absl::Seconds(120));
    rt->FreeDevice(pa);
    rt->FreeDevice(pb);
  }).detach();
}

class GpuChannelGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto rt = GpuRuntime::Get();
    if (rt.ok()) rt_ = *rt;
  }
  void StartDaemon(int device, std::vector<std::string> flags = {},
                   std::vector<std::string> env = {}) {
    std::ofstream(dir_.path() + "/tokens.yaml") << "alpha: secret-a\nbeta: secret-b\n";
    flags.push_back("--auth.token_file=" + dir_.path() + "/tokens.yaml");
    flags.push_back("--engine.cuda_device=" + std::to_string(device));
    flags.push_back("--data_plane.gpu_transfer_timeout_seconds=3");
    flags.push_back("--storage.durability=memory");
    daemon_ = std::make_unique<KvcompdProcess>(KVCOMPD_PATH, dir_.path() + "/d", flags);
    daemon_->SetEnv("NCCL_NVLS_ENABLE=0");
    for (const std::string& e : env) daemon_->SetEnv(e);
    ASSERT_TRUE(daemon_->Start()) << daemon_->Log();
  }
  std::string Control() const {
    return "127.0.0.1:" + std::to_string(daemon_->ports().control);
  }
  std::unique_ptr<Client> Connect(const std::string& tenant = "alpha",
                                  const std::string& token = "secret-a") {
    ClientOptions o;
    o.tenant = tenant;
    o.token = token;
    o.request_timeout = absl::Seconds(20);
    o.ucx_overrides = {{"TLS", "tcp"}};
    auto c = Client::Connect({daemon_->data_endpoint() + "," + Control()}, o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  void* NewStream(int device) {
    EXPECT_TRUE(rt_->SetDevice(device).ok());
    auto s = rt_->NewStream();
    EXPECT_TRUE(s.ok());
    return s.ok() ? *s : nullptr;
  }

  GpuRuntime* rt_ = nullptr;
  TempDir dir_;
  std::unique_ptr<KvcompdProcess> daemon_;
};

TEST_F(GpuChannelGpuTest, RoundTripOverNcclIsBitIdentical) {
  REQUIRE_GPUS(2);
  StartDaemon(1);
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->ProbeGpuChannel(daemon_->data_endpoint(), 0).ok())
      << c->ProbeGpuChannel(daemon_->data_endpoint(), 0) << "\n" << daemon_->Log();
  const KvLayout layout = Layout();
  const uint64_t tokens = 1000;  // not a multiple of any block size
  DeviceCache in(rt_, 0, layout, tokens, 1);
  void* stream = NewStream(0);
  client::PutOptions po;
  po.policy = Lossless();
  auto put = c->PutDevice("m", "k", layout, tokens, in.In(), stream, po);
  ASSERT_TRUE(put.ok()) << put.status() << "\n" << daemon_->Log();
  EXPECT_EQ(put->path, "nccl");
  EXPECT_GT(put->transfer_seconds, 0);
  EXPECT_EQ(put->original_bytes, layout.CacheBytes(tokens));

  // Dense K/V back into other device buffers, on the caller's stream.
  DeviceCache out(rt_, 0, layout, tokens, 2);
  auto got = c->GetKvIntoDevice("m", "k", layout, tokens, out.Out(), stream);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->path, "nccl");
  EXPECT_TRUE(out.Read(stream) == in.Host()) << "K/V differ after the NCCL round trip";

  // The stored bytes over NCCL are the bytes the data plane serves.
  auto bytes = c->GetBytes("m", "k");
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto buf = rt_->AllocDevice(bytes->size() + 4096);
  ASSERT_TRUE(buf.ok());
  auto raw = c->GetIntoDevice("m", "k", *buf, bytes->size() + 4096, stream);
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ(raw->path, "nccl");
  ASSERT_EQ(raw->bytes, bytes->size());
  std::string back(bytes->size(), '\0');
  ASSERT_TRUE(rt_->CopyAsync(back.data(), *buf, back.size(), GpuRuntime::Copy::kDeviceToHost,
                             stream).ok());
  ASSERT_TRUE(rt_->WaitStream(stream, absl::Now() + absl::Seconds(10)).ok());
  EXPECT_TRUE(back == *bytes);
  // Too small a buffer: OutOfRange, nothing sent, the channel still serves.
  auto small = c->GetIntoDevice("m", "k", *buf, 16, stream);
  EXPECT_EQ(small.status().code(), absl::StatusCode::kOutOfRange) << small.status();
  rt_->FreeDevice(*buf);

  // A second put on the same channel (cached), then the counters.
  auto put2 = c->PutDevice("m", "k2", layout, tokens, in.In(), stream, po);
  ASSERT_TRUE(put2.ok()) << put2.status();
  EXPECT_EQ(put2->path, "nccl");
  const client::GpuChannelStats st = c->GpuStats();
  EXPECT_EQ(st.nccl_puts, 2u);
  EXPECT_EQ(st.nccl_gets, 2u);
  EXPECT_EQ(st.fallback_puts, 0u);
  EXPECT_EQ(st.channels_opened, 1u);

  // A cache that evicted tokens has no dense form: FailedPrecondition, and the channel lives on.
  client::PutOptions lossy;
  lossy.policy = CompressionPolicy();  // manifold, ratio 0.5
  auto put3 = c->PutDevice("m", "evicted", layout, tokens, in.In(), stream, lossy);
  ASSERT_TRUE(put3.ok()) << put3.status();
  EXPECT_LT(put3->total_kept, uint64_t{layout.num_layers} * layout.num_kv_heads * tokens);
  auto dense = c->GetKvIntoDevice("m", "evicted", layout, tokens, out.Out(), stream);
  EXPECT_EQ(dense.status().code(), absl::StatusCode::kFailedPrecondition) << dense.status();
  // The lossy cache itself matches the one the data plane makes from the same bytes.
  auto host_put = c->Put("m", "evicted-host", layout, tokens, in.HostLayers(), lossy);
  ASSERT_TRUE(host_put.ok()) << host_put.status();
  EXPECT_EQ(host_put->total_kept, put3->total_kept);
  EXPECT_EQ(host_put->stored_bytes, put3->stored_bytes);
  // Wrong sizes from the caller: refused before anything is sent.
  auto wrong = c->GetKvIntoDevice("m", "k", Layout(2), tokens, out.Out(), stream);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument) << wrong.status();
  EXPECT_EQ(c->GpuStats().channel_failures, 0u);
}

// Layer by layer over NCCL: a put stream sends each layer as it is appended (here behind a long
// queue of work on the producer's stream), a get hands back one layer at a time; bit for bit.
TEST_F(GpuChannelGpuTest, LayerByLayerOverNcclIsBitIdentical) {
  REQUIRE_GPUS(2);
  StartDaemon(1);
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const KvLayout layout = Layout();
  const uint64_t tokens = 777;
  DeviceCache in(rt_, 0, layout, tokens, 31);
  DeviceCache src(rt_, 0, layout, tokens, 32);
  void* stream = NewStream(0);
  client::PutOptions po;
  po.policy = Lossless();
  auto ps = c->OpenDevicePutStream("m", "layers", layout, tokens, 0, po);
  ASSERT_TRUE(ps.ok()) << ps.status() << "\n" << daemon_->Log();
  EXPECT_EQ((*ps)->path(), "nccl");
  QueueLongWork(rt_, stream, 100);
  src.CopyFrom(in, stream);  // every layer written on the stream, behind the queue
  const std::vector<DeviceLayerData> layers = src.In();
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    ASSERT_TRUE((*ps)->AppendLayer(l, layers[l], stream).ok());
  }
  auto put = (*ps)->Commit();
  ASSERT_TRUE(put.ok()) << put.status() << "\n" << daemon_->Log();
  EXPECT_EQ(put->path, "nccl");
  EXPECT_GT(put->transfer_seconds, 0);

  DeviceCache out(rt_, 0, layout, tokens, 33);
  void* decode = NewStream(0);
  auto gs = c->OpenDeviceGetStream("m", "layers", layout, tokens, out.Out(), stream);
  ASSERT_TRUE(gs.ok()) << gs.status();
  ASSERT_TRUE((*gs)->WaitLayer(0, decode).ok());
  const size_t layer = layout.LayerBytes(tokens);
  std::string k0(layer, '\0');
  const std::vector<DeviceLayerOut> outs = out.Out();
  ASSERT_TRUE(rt_->CopyAsync(k0.data(), outs[0].keys, layer, GpuRuntime::Copy::kDeviceToHost,
                             decode).ok());
  ASSERT_TRUE(rt_->WaitStream(decode, absl::Now() + absl::Seconds(30)).ok());
  EXPECT_TRUE(k0 == in.Host().substr(0, layer)) << "layer 0's keys before the rest";
  auto fin = (*gs)->Finish();
  ASSERT_TRUE(fin.ok()) << fin.status();
  EXPECT_EQ(fin->path, "nccl");
  EXPECT_TRUE(out.Read(stream) == in.Host());

  // A stream abandoned half way: nothing is stored, and the next put gets a new channel.
  {
    auto half = c->OpenDevicePutStream("m", "half", layout, tokens, 0, po);
    ASSERT_TRUE(half.ok()) << half.status();
    ASSERT_TRUE((*half)->AppendLayer(0, layers[0], stream).ok());
  }
  EXPECT_EQ(c->GetBytes("m", "half").status().code(), absl::StatusCode::kNotFound);
  auto again = c->PutDevice("m", "again", layout, tokens, in.In(), stream, po);
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << daemon_->Log();
  EXPECT_EQ(again->path, "nccl");
}

TEST_F(GpuChannelGpuTest, AnotherTenantCannotUseTheChannel) {
  REQUIRE_GPUS(2);
  StartDaemon(1);
  auto alpha = Connect();
  ASSERT_NE(alpha, nullptr);
  ASSERT_TRUE(alpha->ProbeGpuChannel(daemon_->data_endpoint(), 0).ok());
  // Channel ids are small integers: beta names alpha's first one directly.
  testing::ControlClient raw(daemon_->ports().control);
  const rpc::Auth beta = testing::MakeAuth("beta", "secret-b");
  // Alpha's cache, put over alpha's channel.
  const KvLayout layout = Layout(2);
  DeviceCache in(rt_, 0, layout, 64, 3);
  client::PutOptions po;
  po.policy = Lossless();
  auto put = alpha->PutDevice("m", "k", layout, 64, in.In(), NewStream(0), po);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->path, "nccl");
  // A put of beta's whose block names alpha's channel, and a get of beta's that names it: both
  // NOT_FOUND with LINK_GONE on the data plane, nothing stored, nothing sent.
  {
    auto conn = transport::UcxClient::Connect(
        transport::Endpoint{"127.0.0.1", static_cast<uint16_t>(daemon_->ports().data)}, "beta",
        "secret-b");
    ASSERT_TRUE(conn.ok()) << conn.status();
    transport::wire::PutBegin begin;
    begin.model_id = "m";
    begin.key = "stolen";
    begin.layout = KvLayout{1, 8, 32, 128, DType::kBF16};
    begin.num_tokens = 16;
    auto id = (*conn)->PutBegin(begin);
    ASSERT_TRUE(id.ok()) << id.status();
    transport::wire::Block b;
    b.put_id = *id;
    b.layer_end = 1;
    b.token_end = 16;
    b.parts = transport::wire::kPartBoth;
    b.key_bytes = b.value_bytes = 8 * 16 * 128 * 2;
    b.flags = transport::wire::kBlockLinkPayload;
    b.link_channel = 1;
    absl::Notification n;
    absl::Status answer;
    (*conn)->SendLinkBlockAsync(b, "", [&](absl::Status s) {
      answer = s;
      n.Notify();
    });
    n.WaitForNotification();
    EXPECT_EQ(answer.code(), absl::StatusCode::kNotFound) << answer;
    EXPECT_EQ(DetailOf(answer), ErrorDetail::kLinkGone) << answer;
    for (const bool dense : {false, true}) {
      transport::wire::Get g;
      g.model_id = "m";
      g.key = "k";  // alpha's key: beta reads it on no channel
      g.link_channel = 1;
      g.link_capacity = 1 << 30;
      g.link_dense = dense;
      auto got = (*conn)->GetOverLink(g, "", absl::InfiniteFuture());
      EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound) << got.status();
      EXPECT_EQ(DetailOf(got.status()), ErrorDetail::kLinkGone) << got.status();
    }
  }
  rpc::GpuCloseResponse cl;
  raw->CloseGpuChannel(cl, beta, 1);
  EXPECT_EQ(cl.status.code, rpc::StatusCode::NOT_FOUND);
  // Alpha's channel still carries alpha's puts and gets.
  auto again = alpha->PutDevice("m", "k2", layout, 64, in.In(), NewStream(0), po);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->path, "nccl");
  DeviceCache out(rt_, 0, layout, 64, 4);
  void* stream = NewStream(0);
  auto got = alpha->GetKvIntoDevice("m", "k", layout, 64, out.Out(), stream);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->path, "nccl");
  EXPECT_TRUE(out.Read(stream) == in.Host());
}

// An SDK that does not say it puts and gets over the data plane (one before protocol 1.5, whose
// gets, or puts, were control-plane calls this daemon no longer has) is refused the channel with
// the reason, before anything is formed, and falls back to the data plane's links; with it, the
// same request gets a channel that says it takes data-plane puts and gets.
TEST_F(GpuChannelGpuTest, AnSdkThatDoesNotPutOverTheDataPlaneIsRefusedTheChannel) {
  REQUIRE_GPUS(1);
  StartDaemon(0);
  absl::StatusOr<std::string> uuid = rt_->DeviceUuid(0);
  ASSERT_TRUE(uuid.ok()) << uuid.status();
  std::string event;
  ASSERT_TRUE(rt_->SetDevice(0).ok());
  absl::StatusOr<void*> ev = rt_->NewIpcEvent(&event);
  ASSERT_TRUE(ev.ok()) << ev.status();
  testing::ControlClient raw(daemon_->ports().control);
  rpc::GpuChannelRequest req;
  req.nccl_version = GpuRuntime::nccl_version();
  req.device_uuid = *uuid;
  req.__set_ipc_event(event);
  rpc::GpuChannelResponse r;
  raw->OpenGpuChannel(r, testing::MakeAuth("alpha", "secret-a"), req);
  EXPECT_EQ(r.status.code, rpc::StatusCode::FAILED_PRECONDITION) << r.status.message;
  EXPECT_TRUE(absl::StrContains(r.status.message, "protocol 1.5")) << r.status.message;
  EXPECT_EQ(r.channel_id, 0);
  req.__set_data_plane_puts(true);  // a 1.4 SDK: puts on the data plane, gets not
  raw->OpenGpuChannel(r, testing::MakeAuth("alpha", "secret-a"), req);
  EXPECT_EQ(r.status.code, rpc::StatusCode::FAILED_PRECONDITION) << r.status.message;
  req.__set_data_plane_gets(true);
  raw->OpenGpuChannel(r, testing::MakeAuth("alpha", "secret-a"), req);
  ASSERT_EQ(r.status.code, rpc::StatusCode::OK) << r.status.message;
  EXPECT_TRUE(r.__isset.data_plane_puts && r.data_plane_puts);
  EXPECT_TRUE(r.__isset.data_plane_gets && r.data_plane_gets);
  rpc::GpuCloseResponse cl;
  raw->CloseGpuChannel(cl, testing::MakeAuth("alpha", "secret-a"), r.channel_id);
  EXPECT_EQ(cl.status.code, rpc::StatusCode::OK);
  rt_->DestroyEvent(*ev);
}

// One GPU: client and daemon on the same device cannot form an NCCL communicator; the channel
// is in CUDA IPC mode: the daemon maps the caller's memory and copies on the device, after the
// caller's stream (the source below is written behind a long queue of work), bit for bit.
TEST_F(GpuChannelGpuTest, SameGpuGoesOverCudaIpcBitIdentical) {
  REQUIRE_GPUS(1);
  StartDaemon(0);
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->ProbeGpuChannel(daemon_->data_endpoint(), 0).ok())
      << c->ProbeGpuChannel(daemon_->data_endpoint(), 0) << "\n" << daemon_->Log();
  const KvLayout layout = Layout();
  const uint64_t tokens = 1000;
  DeviceCache in(rt_, 0, layout, tokens, 21);
  DeviceCache src(rt_, 0, layout, tokens, 22);  // other bytes until the stream rewrites them
  void* stream = NewStream(0);
  QueueLongWork(rt_, stream);
  src.CopyFrom(in, stream);
  client::PutOptions po;
  po.policy = Lossless();
  auto put = c->PutDevice("m", "k", layout, tokens, src.In(), stream, po);
  ASSERT_TRUE(put.ok()) << put.status() << "\n" << daemon_->Log();
  EXPECT_EQ(put->path, "ipc");
  EXPECT_EQ(put->original_bytes, layout.CacheBytes(tokens));

  DeviceCache out(rt_, 0, layout, tokens, 23);
  QueueLongWork(rt_, stream, 100);  // the daemon writes only after this
  auto got = c->GetKvIntoDevice("m", "k", layout, tokens, out.Out(), stream);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->path, "ipc");
  EXPECT_TRUE(out.Read(stream) == in.Host()) << "K/V differ after the IPC round trip";

  auto bytes = c->GetBytes("m", "k");
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto buf = rt_->AllocDevice(bytes->size() + 4096);
  ASSERT_TRUE(buf.ok());
  auto raw = c->GetIntoDevice("m", "k", *buf, bytes->size() + 4096, stream);
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ(raw->path, "ipc");
  ASSERT_EQ(raw->bytes, bytes->size());
  std::string back(bytes->size(), '\0');
  ASSERT_TRUE(rt_->CopyAsync(back.data(), *buf, back.size(), GpuRuntime::Copy::kDeviceToHost,
                             stream).ok());
  ASSERT_TRUE(rt_->WaitStream(stream, absl::Now() + absl::Seconds(10)).ok());
  EXPECT_TRUE(back == *bytes);
  auto small = c->GetIntoDevice("m", "k", *buf, 16, stream);
  EXPECT_EQ(small.status().code(), absl::StatusCode::kOutOfRange) << small.status();

  // A chunk outside the caller's allocation: INVALID_ARGUMENT, and the channel serves on.
  auto exported = rt_->ExportMemory(*buf);
  ASSERT_TRUE(exported.ok()) << exported.status();
  for (const auto& [tenant, token] : {std::pair<std::string, std::string>{"alpha", "secret-a"},
                                      {"beta", "secret-b"}}) {
    auto conn = transport::UcxClient::Connect(
        transport::Endpoint{"127.0.0.1", static_cast<uint16_t>(daemon_->ports().data)}, tenant,
        token);
    ASSERT_TRUE(conn.ok()) << conn.status();
    transport::IpcMemory m;
    m.handles = {exported->handle};
    m.regions = {{0, exported->allocation_bytes, uint64_t{1} << 30}};  // past its end
    transport::wire::Get g;
    g.model_id = "m";
    g.key = "k";
    g.link_channel = 1;
    g.link_capacity = uint64_t{1} << 30;
    auto t = (*conn)->GetOverLink(g, transport::EncodeIpcMemory(m), absl::InfiniteFuture());
    if (tenant == "alpha") {
      EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
    } else {  // another tenant naming the channel: absent
      EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound) << t.status();
      EXPECT_EQ(DetailOf(t.status()), ErrorDetail::kLinkGone) << t.status();
    }
  }
  rt_->FreeDevice(*buf);

  // Layer by layer on one GPU: the put stream's layers go at Commit, the get's all at once.
  auto ps = c->OpenDevicePutStream("m", "layers", layout, tokens, 0, po);
  ASSERT_TRUE(ps.ok()) << ps.status();
  EXPECT_EQ((*ps)->path(), "ipc");
  const std::vector<DeviceLayerData> layers = in.In();
  EXPECT_EQ((*ps)->AppendLayer(1, layers[1], stream).code(), absl::StatusCode::kInvalidArgument);
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    ASSERT_TRUE((*ps)->AppendLayer(l, layers[l], stream).ok());
  }
  auto committed = (*ps)->Commit();
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->path, "ipc");
  DeviceCache out2(rt_, 0, layout, tokens, 24);
  auto gs = c->OpenDeviceGetStream("m", "layers", layout, tokens, out2.Out(), stream);
  ASSERT_TRUE(gs.ok()) << gs.status();
  for (uint32_t l = 0; l < layout.num_layers; ++l) EXPECT_TRUE((*gs)->WaitLayer(l, stream).ok());
  EXPECT_EQ((*gs)->WaitLayer(layout.num_layers, stream).code(), absl::StatusCode::kInvalidArgument);
  auto fin = (*gs)->Finish();
  ASSERT_TRUE(fin.ok()) << fin.status();
  EXPECT_EQ(fin->path, "ipc");
  EXPECT_TRUE(out2.Read(stream) == in.Host());

  const client::GpuChannelStats st = c->GpuStats();
  EXPECT_EQ(st.ipc_puts, 2u);
  EXPECT_EQ(st.ipc_gets, 3u);
  EXPECT_EQ(st.fallback_puts, 0u);
  EXPECT_EQ(st.fallback_gets, 0u);
  EXPECT_EQ(st.nccl_puts, 0u);
  EXPECT_EQ(st.channels_opened, 1u);
  EXPECT_EQ(st.channel_failures, 0u);
}

// A dense get of a cache that kept every token with int8 keys, over CUDA IPC from a daemon
// whose engine runs on the GPU: the daemon decodes it on its GPU into the channel's staging
// buffer; the keys and values are the daemon's decoded form (GetDecoded, made dense here) bit
// for bit, the raw values the input's.
// A daemon with an engine on each of two GPUs (and a GPU tier pool on each, drawn through its
// device seam): a client on either GPU shares it over CUDA IPC, each channel on its own GPU, and
// what was put from one GPU comes back through the other GPU's channel bit for bit.
TEST_F(GpuChannelGpuTest, TwoGpuEnginesEachServeTheChannelOnTheirGpu) {
  REQUIRE_GPUS(2);
  StartDaemon(0, {"--engine.backend=cuda", "--engine.cuda_devices=0,1"});
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  for (int d = 0; d < 2; ++d) {
    ASSERT_TRUE(c->ProbeGpuChannel(daemon_->data_endpoint(), d).ok())
        << c->ProbeGpuChannel(daemon_->data_endpoint(), d) << "\n" << daemon_->Log();
  }
  const KvLayout layout = Layout();
  const uint64_t tokens = 700;
  client::PutOptions po;
  po.policy = Lossless();
  for (int from = 0; from < 2; ++from) {
    const int to = 1 - from;
    const std::string key = "k" + std::to_string(from);
    std::string sent;
    {
      DeviceCache in(rt_, from, layout, tokens, 40 + from);
      auto put = c->PutDevice("m", key, layout, tokens, in.In(), NewStream(from), po);
      ASSERT_TRUE(put.ok()) << put.status() << "\n" << daemon_->Log();
      EXPECT_EQ(put->path, "ipc");
      sent = in.Host();
      ASSERT_TRUE(rt_->SetDevice(from).ok());  // `in` is freed on its device
    }
    DeviceCache out(rt_, to, layout, tokens, 50 + from);
    void* stream = NewStream(to);
    auto got = c->GetKvIntoDevice("m", key, layout, tokens, out.Out(), stream);
    ASSERT_TRUE(got.ok()) << got.status() << "\n" << daemon_->Log();
    EXPECT_EQ(got->path, "ipc");
    EXPECT_TRUE(out.Read(stream) == sent) << "put from GPU " << from << ", read on GPU " << to;
    ASSERT_TRUE(rt_->SetDevice(to).ok());
  }
  const client::GpuChannelStats st = c->GpuStats();
  EXPECT_EQ(st.ipc_puts, 2u);
  EXPECT_EQ(st.ipc_gets, 2u);
  EXPECT_EQ(st.channels_opened, 2u);
}

TEST_F(GpuChannelGpuTest, ADenseGetOfAnEncodedCacheIsDecodedOnTheDaemonsGpu) {
  REQUIRE_GPUS(1);
  StartDaemon(0, {"--engine.backend=cuda"});
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const KvLayout layout = Layout();
  const uint64_t tokens = 1000;
  DeviceCache in(rt_, 0, layout, tokens, 31);
  client::PutOptions po;
  po.policy = Lossless();
  po.policy->key_codec = KeyCodec::kInt8;
  auto put = c->Put("m", "int8", layout, tokens, in.HostLayers(), po);
  ASSERT_TRUE(put.ok()) << put.status() << "\n" << daemon_->Log();

  DeviceCache out(rt_, 0, layout, tokens, 32);
  void* stream = NewStream(0);
  const std::string before = testing::HttpGet(daemon_->ports().metrics, "/metrics").body;
  auto got = c->GetKvIntoDevice("m", "int8", layout, tokens, out.Out(), stream);
  ASSERT_TRUE(got.ok()) << got.status() << "\n" << daemon_->Log();
  const std::string after = testing::HttpGet(daemon_->ports().metrics, "/metrics").body;
  EXPECT_EQ(got->path, "ipc");
  EXPECT_EQ(got->bytes, layout.CacheBytes(tokens));
  const std::string dense = out.Read(stream);
  // Decoded once, on the device: the encoded arrays up and the decoded dense K and V up into the
  // staging buffer (the path through host memory uploads the encoded arrays only, less than
  // the dense payload).
  auto delta = [&](const std::string& series) {
    return testing::MetricValue(after, series) - testing::MetricValue(before, series);
  };
  EXPECT_EQ(delta("kvcomp_stage_duration_seconds_count{stage=\"decode\"}"), 1.0);
  EXPECT_GT(delta("kvcomp_h2d_bytes_total"), static_cast<double>(layout.CacheBytes(tokens)));

  auto decoded = c->GetDecoded("m", "int8");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  std::string want(layout.CacheBytes(tokens), '\0');
  ASSERT_TRUE(decoded->WriteDenseKv(reinterpret_cast<uint8_t*>(want.data())).ok());
  EXPECT_TRUE(dense == want) << "the dense get differs from the daemon's decoded form";
  const std::string host = in.Host();
  const size_t half = host.size() / 2;
  EXPECT_TRUE(dense.substr(half) == host.substr(half)) << "raw values changed";
  EXPECT_FALSE(dense.substr(0, half) == host.substr(0, half)) << "int8 keys came back exact";
}

// A dense get of a cache that kept every token with the Hadamard codecs (hq4 keys, hq3 values),
// over CUDA IPC from a daemon whose engine runs on the GPU: the stored records are read into
// device memory and decoded there straight into the staging buffer (nothing but the header comes
// to the host, nothing decoded goes up); the keys and values are the daemon's decoded form bit
// for bit.
TEST_F(GpuChannelGpuTest, ADenseGetOfAnHqCacheIsDecodedFromDeviceMemory) {
  REQUIRE_GPUS(1);
  StartDaemon(0, {"--engine.backend=cuda"});
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const KvLayout layout = Layout();
  const uint64_t tokens = 1000;
  DeviceCache in(rt_, 0, layout, tokens, 41);
  client::PutOptions po;
  po.policy = Lossless();
  po.policy->key_codec = KeyCodec::kHq4;
  po.policy->value_codec = ValueCodec::kHq3;
  auto put = c->Put("m", "hq", layout, tokens, in.HostLayers(), po);
  ASSERT_TRUE(put.ok()) << put.status() << "\n" << daemon_->Log();

  DeviceCache out(rt_, 0, layout, tokens, 42);
  void* stream = NewStream(0);
  const std::string before = testing::HttpGet(daemon_->ports().metrics, "/metrics").body;
  auto got = c->GetKvIntoDevice("m", "hq", layout, tokens, out.Out(), stream);
  ASSERT_TRUE(got.ok()) << got.status() << "\n" << daemon_->Log();
  const std::string after = testing::HttpGet(daemon_->ports().metrics, "/metrics").body;
  EXPECT_EQ(got->path, "ipc");
  EXPECT_EQ(got->bytes, layout.CacheBytes(tokens));
  const std::string dense = out.Read(stream);
  auto delta = [&](const std::string& series) {
    return testing::MetricValue(after, series) - testing::MetricValue(before, series);
  };
  EXPECT_EQ(delta("kvcomp_stage_duration_seconds_count{stage=\"decode\"}"), 1.0);
  // At most the stored records go up (from a host tier); the decoded K and V never do.
  EXPECT_LT(delta("kvcomp_h2d_bytes_total"), static_cast<double>(layout.CacheBytes(tokens) / 2));

  auto decoded = c->GetDecoded("m", "hq");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  std::string want(layout.CacheBytes(tokens), '\0');
  ASSERT_TRUE(decoded->WriteDenseKv(reinterpret_cast<uint8_t*>(want.data())).ok());
  EXPECT_TRUE(dense == want) << "the dense get differs from the daemon's decoded form";
  EXPECT_FALSE(dense == in.Host()) << "hq came back exact";
}

// The channel turned off: a client on the daemon's GPU goes through host memory over UCX,
// saying so, bit for bit.
TEST_F(GpuChannelGpuTest, SameGpuWithoutChannelFallsBackToUcxBitIdentical) {
  REQUIRE_GPUS(1);
  StartDaemon(0, {"--data_plane.gpu_channel=false"});
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const KvLayout layout = Layout(2);
  const uint64_t tokens = 300;
  DeviceCache in(rt_, 0, layout, tokens, 4);
  void* stream = NewStream(0);
  client::PutOptions po;
  po.policy = Lossless();
  auto put = c->PutDevice("m", "k", layout, tokens, in.In(), stream, po);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->path, "ucx");
  DeviceCache out(rt_, 0, layout, tokens, 5);
  auto got = c->GetKvIntoDevice("m", "k", layout, tokens, out.Out(), stream);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->path, "ucx");
  EXPECT_TRUE(out.Read(stream) == in.Host());
  const client::GpuChannelStats st = c->GpuStats();
  EXPECT_EQ(st.fallback_puts, 1u);
  EXPECT_EQ(st.fallback_gets, 1u);
  EXPECT_EQ(st.nccl_puts, 0u);
  EXPECT_FALSE(st.last_fallback_reason.empty());
  EXPECT_FALSE(c->ProbeGpuChannel(daemon_->data_endpoint(), 0).ok());
}

// The GPU tier's pool is drawn from its device's budget (engine.gpu_memory_bytes): a pool
// larger than the budget stops the start, saying so; one that fits leaves the rest to puts and
// the channel's buffers, and a put into the GPU tier and its get round-trip.
TEST_F(GpuChannelGpuTest, TheGpuTierIsDrawnFromItsDevicesBudget) {
  REQUIRE_GPUS(1);
  KvcompdProcess over(KVCOMPD_PATH, dir_.path() + "/over",
                      {"--engine.cuda_device=0", "--storage.durability=memory",
                       "--engine.gpu_memory_bytes=67108864",
                       "--storage.device_capacity_bytes=134217728"});
  EXPECT_FALSE(over.Start());
  EXPECT_TRUE(absl::StrContains(over.Log(), "the GPU tier does not fit")) << over.Log();
  StartDaemon(0, {"--engine.gpu_memory_bytes=2147483648",
                  "--storage.device_capacity_bytes=134217728", "--storage.put_tier=device"});
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const KvLayout layout = Layout(2);
  const uint64_t tokens = 300;
  DeviceCache in(rt_, 0, layout, tokens, 6);
  void* stream = NewStream(0);
  client::PutOptions po;
  po.policy = Lossless();
  auto put = c->PutDevice("m", "tiered", layout, tokens, in.In(), stream, po);
  ASSERT_TRUE(put.ok()) << put.status();
  DeviceCache out(rt_, 0, layout, tokens, 7);
  auto got = c->GetKvIntoDevice("m", "tiered", layout, tokens, out.Out(), stream);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(out.Read(stream) == in.Host());
}

TEST_F(GpuChannelGpuTest, DaemonWithoutNcclFallsBackToUcx) {
  REQUIRE_GPUS(1);
  StartDaemon(Devices() > 1 ? 1 : 0, {}, {"KVCOMP_NCCL_LIBRARY=/nonexistent/libnccl.so.2"});
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const KvLayout layout = Layout(1);
  DeviceCache in(rt_, 0, layout, 128, 6);
  client::PutOptions po;
  po.policy = Lossless();
  auto put = c->PutDevice("m", "k", layout, 128, in.In(), NewStream(0), po);
  ASSERT_TRUE(put.ok()) << put.status();
  if (Devices() > 1) {
    // A client on another GPU needs NCCL at the daemon: through host memory, saying why.
    EXPECT_EQ(put->path, "ucx");
    EXPECT_TRUE(absl::StrContains(c->GpuStats().last_fallback_reason, "NCCL") ||
                absl::StrContains(c->GpuStats().last_fallback_reason, "GPU"))
        << c->GpuStats().last_fallback_reason;
  } else {
    // One GPU: the daemon shares it with the client, and CUDA IPC needs no NCCL.
    EXPECT_EQ(put->path, "ipc");
  }
  // Device pointers are checked: host memory is refused.
  std::vector<uint8_t> host(layout.CacheBytes(128));
  std::vector<DeviceLayerData> bad = {{host.data(), host.data() + host.size() / 2}};
  auto refused = c->PutDevice("m", "host", layout, 128, bad, nullptr, po);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
}

// A client killed with half its payload sent: the daemon's receive is aborted at the transfer
// timeout, the put leaves nothing behind, and the daemon serves the next channel.
TEST_F(GpuChannelGpuTest, ClientDyingMidTransferLeavesNoHang) {
  REQUIRE_GPUS(2);
  StartDaemon(1);
  const std::string cmd = std::string(GPU_CHANNEL_PEER_PATH) + " put-and-die " +
                          std::to_string(daemon_->ports().control) + " " +
                          std::to_string(daemon_->ports().data) + " alpha secret-a 0 > " +
                          dir_.path() + "/peer.log 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream peer_log(dir_.path() + "/peer.log");
  std::string peer((std::istreambuf_iterator<char>(peer_log)), std::istreambuf_iterator<char>());
  ASSERT_TRUE(absl::StrContains(peer, "sent the keys; dying")) << "rc " << rc << ": " << peer;
  // The daemon aborts the half-done receive at its transfer timeout (3 s).
  const auto t0 = std::chrono::steady_clock::now();
  bool closed = false;
  while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20)) {
    if (absl::StrContains(daemon_->Log(), "did not finish in time")) {
      closed = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(closed) << daemon_->Log();
  testing::ControlClient raw(daemon_->ports().control);
  rpc::StatsResponse st;
  raw->Stats(st, testing::MakeAuth("alpha", "secret-a"));
  EXPECT_EQ(st.puts_in_progress, 0);
  rpc::LookupResponse lk;
  rpc::CacheRef ref;
  ref.model_id = "m";
  ref.key = "half-sent";
  raw->Lookup(lk, testing::MakeAuth("alpha", "secret-a"), ref);
  EXPECT_EQ(lk.status.code, rpc::StatusCode::NOT_FOUND);
  // A new client gets a new channel and a good round trip.
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const KvLayout layout = Layout(2);
  DeviceCache in(rt_, 0, layout, 256, 7);
  void* stream = NewStream(0);
  client::PutOptions po;
  po.policy = Lossless();
  auto put = c->PutDevice("m", "after", layout, 256, in.In(), stream, po);
  ASSERT_TRUE(put.ok()) << put.status() << "\n" << daemon_->Log();
  EXPECT_EQ(put->path, "nccl");
  DeviceCache out(rt_, 0, layout, 256, 8);
  auto got = c->GetKvIntoDevice("m", "after", layout, 256, out.Out(), stream);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(out.Read(stream) == in.Host());
}

// An NCCL peer killed after joining: our send has no receiver; Wait gives up at its deadline,
// aborts the communicator, and the stream drains (later work on it completes).
TEST_F(GpuChannelGpuTest, PeerDyingAfterJoinDoesNotHangTheSender) {
  REQUIRE_GPUS(2);
  const std::string id_file = dir_.path() + "/nccl.id";
  pid_t pid = fork();
  if (pid == 0) {
    execl(GPU_CHANNEL_PEER_PATH, GPU_CHANNEL_PEER_PATH, "join-and-die", id_file.c_str(), "1",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  std::string id;
  for (int i = 0; i < 300 && id.size() != 128; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::ifstream f(id_file, std::ios::binary);
    id.assign((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  }
  ASSERT_EQ(id.size(), 128u);
  auto link = NcclLink::Join(id, 1, 0, absl::Seconds(30));
  ASSERT_TRUE(link.ok()) << link.status();
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  void* stream = NewStream(0);
  const size_t bytes = size_t{256} << 20;
  auto buf = rt_->AllocDevice(bytes);
  ASSERT_TRUE(buf.ok());
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = (*link)->Send({{*buf, bytes}}, stream);
  if (s.ok()) s = (*link)->Wait(stream, absl::Now() + absl::Seconds(3));
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE((*link)->broken());
  EXPECT_LT(secs, 20.0) << s;
  // The stream is usable again: new work on it finishes.
  EXPECT_TRUE(rt_->WaitStream(stream, absl::Now() + absl::Seconds(20)).ok());
  rt_->FreeDevice(*buf);
}

}  // namespace
}  // namespace kvcomp
