// End-to-end tests of kvcompd: a real daemon process on loopback ephemeral ports, driven over
// UCX (the transport's UcxClient, UCX_TLS=tcp and posix,tcp) and Thrift, with /metrics scraped
// and checked against what was sent and stored.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/client.h"
#include "kvcompd_process.h"

namespace kvcomp {
namespace testing {
namespace {

namespace wire = transport::wire;
using transport::UcxClient;

const KvLayout kLayout{2, 2, 4, 64, DType::kBF16};
constexpr uint64_t kTokens = 256;

// K and V of one sequence, [layer][kv_head][token][head_dim] bf16.
struct HostKv {
  KvLayout layout;
  uint64_t tokens = 0;
  std::vector<uint16_t> k, v;
  size_t index(uint32_t l, uint32_t h, uint64_t t) const {
    return ((uint64_t{l} * layout.num_kv_heads + h) * tokens + t) * layout.head_dim;
  }
};

HostKv MakeKv(const KvLayout& layout, uint64_t tokens, uint64_t seed) {
  HostKv kv{layout, tokens, {}, {}};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  size_t count = uint64_t{layout.num_layers} * layout.num_kv_heads * tokens * layout.head_dim;
  kv.k.resize(count);
  kv.v.resize(count);
  for (size_t i = 0; i < count; ++i) {
    kv.k[i] = FloatToBf16(n(rng) * (1.0f + static_cast<float>(i % 7)));
    kv.v[i] = FloatToBf16(n(rng));
  }
  return kv;
}

// The block's halves, [layer in block][kv_head][token in block][head_dim].
void Slice(const HostKv& kv, const wire::Block& b, std::vector<uint16_t>* k,
           std::vector<uint16_t>* v) {
  k->clear();
  v->clear();
  const uint32_t D = kv.layout.head_dim;
  for (uint32_t l = b.layer_begin; l < b.layer_end; ++l) {
    for (uint32_t h = 0; h < kv.layout.num_kv_heads; ++h) {
      size_t at = kv.index(l, h, b.token_begin);
      size_t n = (b.token_end - b.token_begin) * D;
      k->insert(k->end(), kv.k.begin() + at, kv.k.begin() + at + n);
      v->insert(v->end(), kv.v.begin() + at, kv.v.begin() + at + n);
    }
  }
}

wire::Block MakeBlock(uint64_t put_id, const KvLayout& layout, uint32_t lb, uint32_t le,
                      uint64_t tb, uint64_t te) {
  wire::Block b;
  b.put_id = put_id;
  b.layer_begin = lb;
  b.layer_end = le;
  b.token_begin = tb;
  b.token_end = te;
  b.parts = wire::kPartBoth;
  b.key_bytes = b.value_bytes = uint64_t{le - lb} * layout.LayerBytes(te - tb);
  return b;
}

wire::PutBegin MakeBegin(const HostKv& kv, const std::string& model, const std::string& key) {
  wire::PutBegin begin;
  begin.layout = kv.layout;
  begin.num_tokens = kv.tokens;
  begin.model_id = model;
  begin.key = key;
  return begin;
}

// Sends `kv` as blocks of `chunk` tokens per layer, in `order` (shuffled with `seed` unless
// in_order), and commits.
absl::StatusOr<wire::CacheSummary> PutCache(UcxClient& c, const HostKv& kv,
                                            const std::string& model, const std::string& key,
                                            uint64_t chunk, bool block_wise = false,
                                            bool in_order = false, uint64_t* sent = nullptr) {
  wire::PutBegin begin = MakeBegin(kv, model, key);
  begin.block_wise = block_wise;
  KVCOMP_ASSIGN_OR_RETURN(uint64_t id, c.PutBegin(begin));
  std::vector<wire::Block> blocks;
  for (uint32_t l = 0; l < kv.layout.num_layers; ++l) {
    for (uint64_t t = 0; t < kv.tokens; t += chunk) {
      blocks.push_back(MakeBlock(id, kv.layout, l, l + 1, t, std::min(kv.tokens, t + chunk)));
    }
  }
  if (!in_order) std::shuffle(blocks.begin(), blocks.end(), std::mt19937_64(7));
  std::vector<uint16_t> k, v;
  for (const auto& b : blocks) {
    Slice(kv, b, &k, &v);
    KVCOMP_RETURN_IF_ERROR(c.SendBlock(b, k.data(), v.data()));
    if (sent != nullptr) *sent += b.payload_bytes();
  }
  return c.PutCommit(id, blocks.size());
}

std::string TestBinary() { return KVCOMPD_PATH; }

class DaemonTest : public ::testing::TestWithParam<std::string> {
 protected:
  void StartDaemon(std::vector<std::string> flags = {}) {
    flags.push_back("--data_plane.max_block_bytes=1Mi");
    flags.push_back("--data_plane.max_put_bytes=64Mi");
    daemon_ = std::make_unique<KvcompdProcess>(TestBinary(), dir_.path() + "/data", flags);
    ASSERT_TRUE(daemon_->Start()) << daemon_->Log();
  }
  std::unique_ptr<UcxClient> Connect(const std::string& tenant = "", const std::string& token = "",
                                     absl::Status* error = nullptr,
                                     absl::Duration timeout = absl::Seconds(30)) {
    transport::ClientOptions o;
    o.ucx.overrides["TLS"] = GetParam();
    o.request_timeout = timeout;
    auto ep = transport::Endpoint::Parse(daemon_->data_endpoint());
    auto c = UcxClient::Connect(*ep, tenant, token, o);
    if (!c.ok()) {
      if (error != nullptr) *error = c.status();
      if (error == nullptr) ADD_FAILURE() << "connect: " << c.status();
      return nullptr;
    }
    return std::move(*c);
  }
  std::string Metrics() {
    HttpResponse r = HttpGet(daemon_->ports().metrics, "/metrics");
    EXPECT_EQ(r.code, 200);
    return r.body;
  }
  // Waits until the totals gauges show `caches` (a commit is acknowledged before the worker's
  // last bookkeeping; the gauges are read from the store at each scrape).
  std::string MetricsWithCaches(double caches) {
    std::string m;
    for (int i = 0; i < 40; ++i) {
      m = Metrics();
      if (MetricValue(m, "kvcomp_caches_stored") == caches) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    return m;
  }

  TempDir dir_;
  std::unique_ptr<KvcompdProcess> daemon_;
};

TEST_P(DaemonTest, PutGetLookupDeleteMatchMetrics) {
  StartDaemon();
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const HostKv kv = MakeKv(kLayout, kTokens, 1);
  uint64_t sent = 0;
  auto summary = PutCache(*c, kv, "llama", "req-1", 100, false, false, &sent);
  ASSERT_TRUE(summary.ok()) << summary.status() << daemon_->Log();
  EXPECT_EQ(summary->original_tokens, kTokens);
  EXPECT_EQ(summary->original_bytes, kLayout.CacheBytes(kTokens));
  // Default policy: manifold, ratio 0.5, uniform: every head keeps 128 of 256.
  EXPECT_EQ(summary->total_kept, kLayout.num_heads_total() * 128);
  EXPECT_LT(summary->stored_bytes, summary->original_bytes);

  auto got = c->Get("llama", "req-1");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->bytes.size(), summary->stored_bytes);
  auto cache = format::ParseCache(got->bytes.view());
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(cache->layout, kLayout);
  EXPECT_EQ(cache->original_tokens, kTokens);
  // The kept keys and values are the sent ones, at their positions.
  auto offsets = cache->TokenOffsets();
  const size_t row = kLayout.head_dim * 2;
  for (uint32_t l = 0; l < kLayout.num_layers; ++l) {
    for (uint32_t h = 0; h < kLayout.num_kv_heads; ++h) {
      uint64_t head = cache->head_index(l, h);
      for (uint64_t i = offsets[head]; i < offsets[head + 1]; ++i) {
        uint32_t p = cache->positions[i];
        ASSERT_EQ(std::memcmp(cache->keys.data() + i * row, &kv.k[kv.index(l, h, p)], row), 0);
        ASSERT_EQ(std::memcmp(cache->values.data() + i * row, &kv.v[kv.index(l, h, p)], row), 0);
      }
    }
  }
  // Raw codecs: the decoded representation is the stored bytes.
  auto decoded = c->Get("llama", "req-1", wire::Representation::kDecoded);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->bytes.view(), got->bytes.view());

  auto looked = c->Lookup("llama", "req-1");
  ASSERT_TRUE(looked.ok()) << looked.status();
  EXPECT_EQ(looked->stored_bytes, summary->stored_bytes);
  EXPECT_EQ(looked->total_kept, summary->total_kept);
  EXPECT_EQ(looked->layout, kLayout);

  std::string m = MetricsWithCaches(1);
  EXPECT_EQ(MetricValue(m, "kvcomp_received_bytes_total"), static_cast<double>(sent));
  EXPECT_EQ(MetricValue(m, "kvcomp_original_bytes_total"),
            static_cast<double>(kLayout.CacheBytes(kTokens)));
  EXPECT_EQ(MetricValue(m, "kvcomp_stored_bytes_total"),
            static_cast<double>(summary->stored_bytes));
  const double saved = static_cast<double>(summary->original_bytes - summary->stored_bytes);
  EXPECT_EQ(MetricValue(m, "kvcomp_saved_bytes_total"), saved);
  EXPECT_EQ(MetricValue(m, "kvcomp_resident_saved_bytes"), saved);
  EXPECT_EQ(MetricValue(m, "kvcomp_caches_stored"), 1);
  EXPECT_EQ(MetricValue(m, "kvcomp_compression_ratio_count"), 1);
  EXPECT_EQ(MetricValue(m, "kvcomp_operation_duration_seconds_count{op=\"put\"}"), 1);
  EXPECT_EQ(MetricValue(m, "kvcomp_operation_duration_seconds_count{op=\"get\"}"), 2);
  EXPECT_EQ(MetricValue(m, "kvcomp_stage_duration_seconds_count{stage=\"compress\"}"), 1);
  // The encoding and the store are stages of their own, once per put; the copies to the device
  // are a stage of a GPU engine's puts (exported, zero puts, on the CPU).
  EXPECT_EQ(MetricValue(m, "kvcomp_stage_duration_seconds_count{stage=\"encode\"}"), 1);
  EXPECT_EQ(MetricValue(m, "kvcomp_stage_duration_seconds_count{stage=\"store\"}"), 1);
  EXPECT_GE(MetricValue(m, "kvcomp_stage_duration_seconds_count{stage=\"to_device\"}"), 0);
  EXPECT_EQ(MetricValue(m, "kvcomp_served_bytes_total"), 2.0 * summary->stored_bytes);
  const std::string tier = ExpectedPutTier();
  EXPECT_EQ(MetricValue(m, "kvcomp_tier_entries{tier=\"" + tier + "\"}"), 1);
  EXPECT_EQ(MetricValue(m, "kvcomp_tier_stored_bytes{tier=\"" + tier + "\"}"),
            static_cast<double>(summary->stored_bytes));
  EXPECT_EQ(MetricValue(m, "kvcomp_ready"), 1);
  EXPECT_EQ(MetricValue(m, "kvcomp_queue_depth"), 0);

  ASSERT_TRUE(c->Delete("llama", "req-1").ok());
  EXPECT_EQ(c->Get("llama", "req-1").status().code(), absl::StatusCode::kNotFound);
  m = MetricsWithCaches(0);
  EXPECT_EQ(MetricValue(m, "kvcomp_caches_stored"), 0);
  EXPECT_EQ(MetricValue(m, "kvcomp_resident_saved_bytes"), 0);
  // A get of a cache that is not there is a miss, not an error.
  EXPECT_LE(MetricValue(m, "kvcomp_errors_total{code=\"not_found\",op=\"get\"}"), 0);
  EXPECT_EQ(MetricValue(m, "kvcomp_cache_requests_total{model_class=\"llama\",op=\"get\","
                           "result=\"miss\",tenant=\"default\"}"),
            1)
      << m;
}

TEST_P(DaemonTest, BlockWisePutKeepsTheBudget) {
  StartDaemon({"--default_policy.block_size=64"});
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const HostKv kv = MakeKv(kLayout, kTokens, 2);
  // Blocks arrive shuffled; the daemon appends each layer's in token order.
  auto summary = PutCache(*c, kv, "llama", "stream", 32, /*block_wise=*/true);
  ASSERT_TRUE(summary.ok()) << summary.status() << daemon_->Log();
  EXPECT_EQ(summary->total_kept, kLayout.num_heads_total() * 128);
  auto got = c->Get("llama", "stream");
  ASSERT_TRUE(got.ok());
  auto cache = format::ParseCache(got->bytes.view());
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(cache->original_tokens, kTokens);
}

TEST_P(DaemonTest, MalformedTrafficGetsClearStatusesAndDaemonKeepsServing) {
  StartDaemon();
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const HostKv kv = MakeKv(kLayout, kTokens, 3);

  // A bad frame header.
  auto r = c->SendRawForTesting(0, std::string(40, 'x'), "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->status.ok());
  // A block whose checksum does not match.
  auto id = c->PutBegin(MakeBegin(kv, "m", "crc"));
  ASSERT_TRUE(id.ok());
  wire::Block b = MakeBlock(*id, kLayout, 0, 1, 0, 16);
  std::vector<uint16_t> k, v;
  Slice(kv, b, &k, &v);
  b.key_crc = Crc32c(k.data(), b.key_bytes);
  b.value_crc = Crc32c(v.data(), b.value_bytes) ^ 1;
  std::string payload(reinterpret_cast<const char*>(k.data()), b.key_bytes);
  payload.append(reinterpret_cast<const char*>(v.data()), b.value_bytes);
  r = c->SendRawForTesting(91, wire::Encode(91, b), payload);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status.code(), absl::StatusCode::kDataLoss) << r->status;
  // Wrong sizes: the frame announces fewer payload bytes than the block's halves.
  wire::Block wrong = b;
  wrong.value_bytes -= 2;
  r = c->SendRawForTesting(92, wire::Encode(92, wrong), payload.substr(0, payload.size() - 2));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status.code(), absl::StatusCode::kInvalidArgument) << r->status;
  // Blocks for a put that was never begun.
  wire::Block unknown = MakeBlock(123456, kLayout, 0, 1, 0, 16);
  EXPECT_EQ(c->SendBlock(unknown, k.data(), v.data()).code(), absl::StatusCode::kNotFound);
  // Overlapping blocks.
  b.key_crc = b.value_crc = 0;
  ASSERT_TRUE(c->SendBlock(b, k.data(), v.data()).ok());
  EXPECT_EQ(c->SendBlock(b, k.data(), v.data()).code(), absl::StatusCode::kInvalidArgument);
  // Commit of an incomplete put.
  EXPECT_EQ(c->PutCommit(*id, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  // An oversized block (max_block_bytes is 1 MiB here) and an oversized put (64 MiB).
  const KvLayout big{1, 8, 8, 128, DType::kF32};
  wire::PutBegin huge = MakeBegin(MakeKv(KvLayout{1, 1, 1, 64, DType::kF32}, 1, 0), "m", "h");
  huge.layout = big;
  huge.num_tokens = 1 << 20;
  EXPECT_EQ(c->PutBegin(huge).status().code(), absl::StatusCode::kInvalidArgument);
  huge.num_tokens = 1024;
  auto hid = c->PutBegin(huge);
  ASSERT_TRUE(hid.ok()) << hid.status();
  wire::Block hb = MakeBlock(*hid, big, 0, 1, 0, 1024);
  std::vector<uint8_t> zeros(hb.key_bytes, 0);
  EXPECT_EQ(c->SendBlock(hb, zeros.data(), zeros.data()).code(),
            absl::StatusCode::kInvalidArgument);
  // An unknown key, and a key too long.
  EXPECT_EQ(c->Get("m", "nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->Lookup("m", "nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->Delete("m", "nope").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->Get("m", std::string(5000, 'k')).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A client that vanishes mid-put leaves nothing behind.
  {
    auto gone = Connect();
    ASSERT_NE(gone, nullptr);
    auto gid = gone->PutBegin(MakeBegin(kv, "m", "vanish"));
    ASSERT_TRUE(gid.ok());
    wire::Block gb = MakeBlock(*gid, kLayout, 0, 1, 0, 16);
    ASSERT_TRUE(gone->SendBlock(gb, k.data(), v.data()).ok());
    gone->Close();
  }
  // The daemon still serves: a full put and get on the same connection and a new one.
  ASSERT_TRUE(PutCache(*c, kv, "m", "after", 128).ok()) << daemon_->Log();
  auto c2 = Connect();
  ASSERT_NE(c2, nullptr);
  EXPECT_TRUE(c2->Get("m", "after").ok());
  EXPECT_EQ(c2->Lookup("m", "vanish").status().code(), absl::StatusCode::kNotFound);
  std::string m;
  for (int i = 0; i < 50; ++i) {
    m = Metrics();
    if (MetricValue(m, "kvcomp_puts_in_progress") <= 2) break;  // crc and huge puts remain
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_LE(MetricValue(m, "kvcomp_puts_in_progress"), 2);
  EXPECT_GE(MetricValue(m, "kvcomp_cache_requests_total{model_class=\"m\",op=\"lookup\","
                           "result=\"miss\",tenant=\"default\"}"),
            1)
      << m;
  EXPECT_TRUE(daemon_->running());
}

TEST_P(DaemonTest, ClientKilledMidPutLeavesNoHalfCache) {
  StartDaemon({"--data_plane.put_timeout_seconds=2"});
  const HostKv kv = MakeKv(kLayout, kTokens, 5);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t child = fork();
  if (child == 0) {
    // The child owns its own UCX context: it begins a put, sends half of it, then dies hard.
    auto c = Connect();
    if (c == nullptr) _exit(3);
    auto id = c->PutBegin(MakeBegin(kv, "m", "killed"));
    if (!id.ok()) _exit(4);
    wire::Block b = MakeBlock(*id, kLayout, 0, 1, 0, kTokens);
    std::vector<uint16_t> k, v;
    Slice(kv, b, &k, &v);
    if (!c->SendBlock(b, k.data(), v.data()).ok()) _exit(5);
    char byte = 1;
    if (write(ready[1], &byte, 1) != 1) _exit(6);
    raise(SIGKILL);
    _exit(7);
  }
  close(ready[1]);
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1) << "child failed before its put";
  close(ready[0]);
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  // The daemon notices (disconnect, or the put timeout at the latest) and drops the put.
  std::string m;
  for (int i = 0; i < 100; ++i) {
    m = Metrics();
    if (MetricValue(m, "kvcomp_puts_in_progress") == 0) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(MetricValue(m, "kvcomp_puts_in_progress"), 0);
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->Lookup("m", "killed").status().code(), absl::StatusCode::kNotFound);
  // The same key can be put whole afterwards.
  EXPECT_TRUE(PutCache(*c, kv, "m", "killed", 128).ok());
  EXPECT_TRUE(c->Get("m", "killed").ok());
}

TEST_P(DaemonTest, BackPressureIsBusyNotUnboundedQueueing) {
  StartDaemon({"--data_plane.max_open_puts=1"});
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const HostKv kv = MakeKv(kLayout, kTokens, 4);
  auto first = c->PutBegin(MakeBegin(kv, "m", "a"));
  ASSERT_TRUE(first.ok());
  // A second put is answered busy at once (sent raw: the client would retry busy replies).
  wire::PutBegin second = MakeBegin(kv, "m", "b");
  second.put_id = 777;
  auto r = c->SendRawForTesting(55, wire::Encode(55, second), "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(IsBusy(r->status)) << r->status;
  ASSERT_TRUE(c->PutAbort(*first).ok());
  EXPECT_TRUE(PutCache(*c, kv, "m", "b", 256).ok());
  // Refused by the data plane's own bound (data_plane.max_open_puts): op "transport".
  EXPECT_GE(MetricValue(Metrics(), "kvcomp_errors_total{code=\"busy\",op=\"transport\"}"), 1);
}

TEST_P(DaemonTest, ConcurrentClientsThroughABoundedQueue) {
  // One worker and a queue of one: commits beyond it are answered busy and retried by the
  // clients; every put ends stored, none is lost or duplicated.
  StartDaemon({"--engine.workers=1", "--engine.queue_capacity=1"});
  constexpr int kClients = 4, kPuts = 3;
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      auto c = Connect();
      if (c == nullptr) return;
      const HostKv kv = MakeKv(kLayout, kTokens, 100 + t);
      for (int i = 0; i < kPuts; ++i) {
        auto r = PutCache(*c, kv, "m", "c" + std::to_string(t) + "-" + std::to_string(i), 64);
        if (r.ok()) ok++;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), kClients * kPuts);
  std::string m = MetricsWithCaches(kClients * kPuts);
  EXPECT_EQ(MetricValue(m, "kvcomp_caches_stored"), kClients * kPuts);
  EXPECT_EQ(MetricValue(m, "kvcomp_operation_duration_seconds_count{op=\"put\"}"),
            kClients * kPuts);
  // The last worker task may still be returning after its commit was acknowledged.
  for (int i = 0; i < 50 && MetricValue(m, "kvcomp_queue_depth") != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    m = Metrics();
  }
  EXPECT_EQ(MetricValue(m, "kvcomp_queue_depth"), 0);
}

INSTANTIATE_TEST_SUITE_P(Transports, DaemonTest, ::testing::Values("tcp", "posix,tcp"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param == "tcp" ? std::string("tcp") : std::string("shm");
                         });

}  // namespace
}  // namespace testing
}  // namespace kvcomp
