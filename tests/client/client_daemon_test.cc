// The C++ SDK against real kvcompd processes on loopback: every call, streamed puts, fetching
// into caller memory, statistics over Thrift, and replicas with a daemon killed mid-run.
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"

#include "common/random_kv.h"
#include "gtest/gtest.h"
#include "integration/kvcompd_process.h"
#include "kvcomp/client/client.h"
#include "kvcomp/core/format.h"
#include "kvcomp/transport/shm_copy_pool.h"

namespace kvcomp {
namespace client {
namespace {

using testing::KvcompdProcess;
using testing::TempDir;

constexpr char kModel[] = "test/model";

struct Cache {
  KvLayout layout{2, 2, 4, 64, DType::kF16};
  uint64_t tokens = 257;
  std::vector<std::vector<uint16_t>> k, v;
  explicit Cache(uint32_t seed) { testing::RandomLayersF16(layout, tokens, seed, &k, &v); }
  std::vector<LayerData> layers() const {
    std::vector<LayerData> out;
    for (size_t l = 0; l < k.size(); ++l) out.push_back({k[l].data(), v[l].data()});
    return out;
  }
};

class ClientDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<KvcompdProcess>(KVCOMPD_PATH, dir_.path() + "/d0");
    ASSERT_TRUE(daemon_->Start()) << daemon_->Log();
    endpoint_ = daemon_->client_endpoint();
    auto c = Client::Connect({endpoint_});
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
  }
  TempDir dir_;
  std::unique_ptr<KvcompdProcess> daemon_;
  std::string endpoint_;
  std::unique_ptr<Client> client_;
};

TEST_F(ClientDaemonTest, EveryCall) {
  Cache c(1);
  PutOptions o;
  o.policy = CompressionPolicy{};
  o.policy->scorer = Scorer::kKnorm;
  o.policy->ratio = 0.5;
  auto put = client_->Put(kModel, "k1", c.layout, c.tokens, c.layers(), o);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->original_bytes, c.layout.CacheBytes(c.tokens));
  EXPECT_EQ(put->total_kept, c.layout.num_heads_total() * (c.tokens / 2));
  ASSERT_EQ(put->endpoints.size(), 1u);

  auto got = client_->Get(kModel, "k1");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->total_kept(), put->total_kept);
  EXPECT_EQ(got->original_tokens, c.tokens);
  // The kept keys are the caller's keys at the kept positions, bit for bit.
  const uint64_t d = c.layout.head_dim;
  for (uint32_t i = 0; i < 5; ++i) {
    const uint32_t p = got->positions[i];
    EXPECT_EQ(std::memcmp(got->keys.data() + i * d * 2, c.k[0].data() + p * d, d * 2), 0);
  }
  auto bytes = client_->GetBytes(kModel, "k1");
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(bytes->size(), put->stored_bytes);
  EXPECT_EQ(*format::EncodeCache(*got), *bytes);
  auto decoded = client_->GetDecoded(kModel, "k1");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->positions, got->positions);

  std::vector<char> buf(bytes->size());
  auto n = client_->GetInto(kModel, "k1", buf.data(), buf.size());
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(std::string(buf.data(), *n), *bytes);
  auto small = client_->GetInto(kModel, "k1", buf.data(), 100);
  EXPECT_EQ(small.status().code(), absl::StatusCode::kOutOfRange);

  auto look = client_->Lookup(kModel, "k1");
  ASSERT_TRUE(look.ok()) << look.status();
  EXPECT_EQ(look->stored_bytes, put->stored_bytes);
  EXPECT_EQ(look->layout, c.layout);

  auto stats = client_->Stats();
  ASSERT_EQ(stats.size(), 1u);
  ASSERT_TRUE(stats[0].status.ok()) << stats[0].status;
  EXPECT_EQ(stats[0].caches, 1u);
  EXPECT_EQ(stats[0].stored_bytes, put->stored_bytes);

  EXPECT_TRUE(client_->Delete(kModel, "k1").ok());
  EXPECT_EQ(client_->Get(kModel, "k1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Delete(kModel, "k1").code(), absl::StatusCode::kNotFound);
}

// Calibration through the SDK: the daemon fits a projection from the raw caches it stores, and
// later puts asking for KVSplice values are encoded with it (and decode on request).
TEST_F(ClientDaemonTest, CalibrateThenPutWithKvSplice) {
  PutOptions raw;
  raw.policy = CompressionPolicy{};
  raw.policy->ratio = 0.25;
  for (uint32_t i = 0; i < 3; ++i) {
    Cache c(10 + i);
    ASSERT_TRUE(client_->Put(kModel, "raw" + std::to_string(i), c.layout, c.tokens, c.layers(), raw)
                    .ok());
  }
  EXPECT_EQ(client_->Calibrate(kModel, {}).status().code(), absl::StatusCode::kInvalidArgument);
  CalibrateOptions bad;
  bad.rank = 8;
  bad.error_budget = 0.1;
  EXPECT_EQ(client_->Calibrate(kModel, bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = {};
  bad.rank = 8;
  bad.value_codec = "none";
  EXPECT_EQ(client_->Calibrate(kModel, bad).status().code(), absl::StatusCode::kInvalidArgument);

  CalibrateOptions opt;
  opt.error_budget = 0.9;
  auto cal = client_->Calibrate(kModel, opt);
  ASSERT_TRUE(cal.ok()) << cal.status();
  ASSERT_EQ(cal->size(), 1u);
  const CalibrateResult& r = (*cal)[0];
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.endpoint, daemon_->data_endpoint());
  EXPECT_NE(r.projection_version, 0u);
  EXPECT_EQ(r.caches_used, 3u);
  EXPECT_GE(r.rank, 1u);
  EXPECT_LE(r.rank, 64u);
  EXPECT_LE(r.achieved_error, 0.9);
  ASSERT_EQ(r.layer_ranks.size(), 2u);
  EXPECT_EQ(*std::max_element(r.layer_ranks.begin(), r.layer_ranks.end()), r.rank);

  // A model with no stored caches has nothing to learn from: the endpoint says why.
  auto none = client_->Calibrate("test/other", opt);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE((*none)[0].status.ok());

  Cache c(20);
  PutOptions enc = raw;
  enc.policy->value_codec = ValueCodec::kOrthogonalInt8;
  enc.policy->key_codec = KeyCodec::kInt8;
  auto put = client_->Put(kModel, "enc", c.layout, c.tokens, c.layers(), enc);
  ASSERT_TRUE(put.ok()) << put.status();
  auto plain = client_->Put(kModel, "plain", c.layout, c.tokens, c.layers(), raw);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_LT(put->stored_bytes, plain->stored_bytes);
  auto look = client_->Lookup(kModel, "enc");
  ASSERT_TRUE(look.ok()) << look.status();
  EXPECT_EQ(look->value_codec, ValueCodec::kOrthogonalInt8);
  auto got = client_->Get(kModel, "enc");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->projection_version, r.projection_version);
  EXPECT_LE(got->rank, r.rank);
  auto decoded = client_->GetDecoded(kModel, "enc");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->value_codec, ValueCodec::kRaw);
  EXPECT_EQ(decoded->positions, got->positions);
  EXPECT_EQ(decoded->values.size(), decoded->total_kept() * c.layout.head_dim * 2);

  // int4 keys through the daemon: stored in fewer bytes than int8 keys, reported by Lookup,
  // decoded by the daemon on the same kept positions.
  PutOptions k4 = raw, k8 = raw;
  k4.policy->key_codec = KeyCodec::kInt4;
  k8.policy->key_codec = KeyCodec::kInt8;
  auto put4 = client_->Put(kModel, "k4", c.layout, c.tokens, c.layers(), k4);
  ASSERT_TRUE(put4.ok()) << put4.status();
  auto put8 = client_->Put(kModel, "k8", c.layout, c.tokens, c.layers(), k8);
  ASSERT_TRUE(put8.ok()) << put8.status();
  EXPECT_LT(put4->stored_bytes, put8->stored_bytes);
  auto look4 = client_->Lookup(kModel, "k4");
  ASSERT_TRUE(look4.ok()) << look4.status();
  EXPECT_EQ(look4->key_codec, KeyCodec::kInt4);
  auto got4 = client_->Get(kModel, "k4");
  ASSERT_TRUE(got4.ok()) << got4.status();
  EXPECT_EQ(got4->key_codec, KeyCodec::kInt4);
  EXPECT_EQ(got4->key_scales.size(), got4->KeyScaleCount());
  auto dec4 = client_->GetDecoded(kModel, "k4");
  ASSERT_TRUE(dec4.ok()) << dec4.status();
  EXPECT_EQ(dec4->key_codec, KeyCodec::kRaw);
  EXPECT_EQ(dec4->positions, got4->positions);
}

TEST_F(ClientDaemonTest, StreamInTokenRangesAndAbort) {
  Cache c(2);
  auto s = client_->OpenPutStream(kModel, "s1", c.layout, c.tokens);
  ASSERT_TRUE(s.ok()) << s.status();
  const uint64_t row = c.layout.head_dim;
  std::vector<uint16_t> kb, vb;
  for (uint64_t t0 = 0; t0 < c.tokens; t0 += 100) {
    const uint64_t n = std::min<uint64_t>(100, c.tokens - t0);
    for (uint32_t l = 0; l < c.layout.num_layers; ++l) {
      kb.clear();
      vb.clear();
      for (uint32_t h = 0; h < c.layout.num_kv_heads; ++h) {
        const uint64_t base = (h * c.tokens + t0) * row;
        kb.insert(kb.end(), c.k[l].begin() + base, c.k[l].begin() + base + n * row);
        vb.insert(vb.end(), c.v[l].begin() + base, c.v[l].begin() + base + n * row);
      }
      ASSERT_TRUE((*s)->Append(l, t0, n, kb.data(), vb.data()).ok());
    }
  }
  auto put = (*s)->Commit();
  ASSERT_TRUE(put.ok()) << put.status();
  // Same cache as a whole-cache put of the same data.
  auto whole = client_->Put(kModel, "s2", c.layout, c.tokens, c.layers());
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(client_->Get(kModel, "s1")->positions, client_->Get(kModel, "s2")->positions);

  auto a = client_->OpenPutStream(kModel, "s3", c.layout, c.tokens);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE((*a)->AppendLayer(0, c.k[0].data(), c.v[0].data()).ok());
  EXPECT_TRUE((*a)->Abort().ok());
  EXPECT_EQ(client_->Lookup(kModel, "s3").status().code(), absl::StatusCode::kNotFound);
  // Out-of-range appends are refused locally.
  auto b = client_->OpenPutStream(kModel, "s4", c.layout, c.tokens);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->Append(5, 0, 1, c.k[0].data(), c.v[0].data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*b)->Append(0, c.tokens, 1, c.k[0].data(), c.v[0].data()).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ClientReplicas, KilledDaemonFailsOverAndWritesGoToSurvivors) {
  TempDir dir;
  std::vector<std::unique_ptr<KvcompdProcess>> ds;
  std::vector<std::string> eps;
  for (int i = 0; i < 3; ++i) {
    ds.push_back(
        std::make_unique<KvcompdProcess>(KVCOMPD_PATH, dir.path() + "/d" + std::to_string(i)));
    ASSERT_TRUE(ds.back()->Start()) << ds.back()->Log();
    eps.push_back(ds.back()->data_endpoint());
  }
  ClientOptions o;
  o.replicas = 2;
  o.request_timeout = absl::Seconds(5);
  o.connect_timeout = absl::Seconds(2);
  auto c = Client::Connect(eps, o);
  ASSERT_TRUE(c.ok()) << c.status();
  Cache cache(3);
  for (int i = 0; i < 8; ++i) {
    const std::string key = "r" + std::to_string(i);
    auto put = (*c)->Put(kModel, key, cache.layout, cache.tokens, cache.layers());
    ASSERT_TRUE(put.ok()) << put.status();
    std::vector<std::string> want = (*c)->Ranking(kModel, key);
    want.resize(2);
    EXPECT_EQ(put->endpoints, want);
  }
  const std::string victim = (*c)->Ranking(kModel, "r0")[0];
  for (auto& d : ds) {
    if (d->data_endpoint() == victim) d->Kill(SIGKILL);
  }
  for (int i = 0; i < 8; ++i) {
    auto got = (*c)->Get(kModel, "r" + std::to_string(i));
    EXPECT_TRUE(got.ok()) << got.status();
  }
  auto put = (*c)->Put(kModel, "after", cache.layout, cache.tokens, cache.layers());
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->endpoints.size(), 2u);
  for (const auto& e : put->endpoints) EXPECT_NE(e, victim);
}

// Threads of this process that are shared-memory copy threads.
int CopyThreads() {
  int n = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream in(task.path() / "comm");
    std::string name;
    std::getline(in, name);
    n += name == transport::kCopyThreadName ? 1 : 0;
  }
  return n;
}

// Lines of /proc/<pid>/maps that map a client's shared region.
int SharedMappings(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  int n = 0;
  while (std::getline(in, line)) n += absl::StrContains(line, "memfd:kvcomp-shm") ? 1 : 0;
  return n;
}

// The SDK's shared-memory options reach its connections: by default a put moves directly (the
// daemon maps no region of the client's); shm_direct = false puts through the client's regions
// (the daemon maps its put region), with shm_copy_lanes copy threads in this process (none
// with 1, gone with the client); every way stores the same cache. Out of range is refused.
TEST_F(ClientDaemonTest, SharedMemoryOptionsReachTheConnection) {
  // Layers of 1 MiB of K and 1 MiB of V: blocks large enough to be split over copy lanes.
  Cache c(7);
  c.layout = KvLayout{2, 4, 4, 128, DType::kF16};
  c.tokens = 1024;
  c.k.clear();
  c.v.clear();
  testing::RandomLayersF16(c.layout, c.tokens, 7, &c.k, &c.v);
  const int daemon = daemon_->ports().pid;
  auto put_with = [&](ClientOptions o, const std::string& key) -> std::unique_ptr<Client> {
    auto client = Client::Connect({endpoint_}, o);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return nullptr;
    auto put = (*client)->Put(kModel, key, c.layout, c.tokens, c.layers());
    EXPECT_TRUE(put.ok()) << put.status();
    return std::move(*client);
  };
  {
    auto direct = put_with(ClientOptions{}, "direct");
    ASSERT_NE(direct, nullptr);
    EXPECT_EQ(SharedMappings(daemon), 0);
    EXPECT_EQ(CopyThreads(), 0);
  }
  auto want = client_->Get(kModel, "direct");
  ASSERT_TRUE(want.ok()) << want.status();
  for (uint32_t lanes : {1u, 3u}) {
    SCOPED_TRACE(::testing::Message() << lanes << " copy lanes");
    ClientOptions o;
    o.shm_direct = false;
    o.shm_copy_lanes = lanes;
    const std::string key = "regions-" + std::to_string(lanes);
    {
      auto regions = put_with(o, key);
      ASSERT_NE(regions, nullptr);
      EXPECT_GE(SharedMappings(daemon), 1);
      if (lanes == 1) {
        EXPECT_EQ(CopyThreads(), 0);
      } else {
        EXPECT_GE(CopyThreads(), 1);
        EXPECT_LE(CopyThreads(), static_cast<int>(lanes));
      }
    }
    EXPECT_EQ(CopyThreads(), 0);  // joined with the client's connection
    auto got = client_->Get(kModel, key);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->positions, want->positions);
    EXPECT_EQ(got->keys, want->keys);
    EXPECT_EQ(got->values, want->values);
  }
  ClientOptions bad;
  bad.shm_copy_lanes = 17;
  auto refused = Client::Connect({endpoint_}, bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "shm_copy_lanes"));
}

TEST(ClientConnect, UnreachableEndpointIsUnavailable) {
  ClientOptions o;
  o.connect_timeout = absl::Seconds(1);
  auto c = Client::Connect({"127.0.0.1:9"}, o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
}

}  // namespace
}  // namespace client
}  // namespace kvcomp
