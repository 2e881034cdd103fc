// What one caller can make kvcompd's control plane hold, against real daemon processes on
// loopback: a GetChunks reply never passes control_plane.max_reply_bytes whatever max_bytes
// asks for, a key repeated in one call is read once, a first cache larger than the bound is
// RESOURCE_EXHAUSTED, and the daemon's memory stays bounded and returns after such calls.
// Strangers cannot hold the control plane: valid clients are served while 256 unauthenticated
// connections stay connected and keep sending credential-less calls, strangers are closed at
// the authentication deadline whatever they send, one tenant holds at most its share of
// connections, and /readyz says when the control plane is full. Policy updates are small
// durable records, bounded in number and rate per tenant. A clean shutdown after a write burst
// leaves no write-ahead log to replay; a SIGKILL after one leaves a log that the restart replays
// without writing it out, and every acknowledged cache is served byte for byte after it. Under
// a hard descriptor limit one tenant's data-plane connections cannot take the descriptors
// another tenant's need. A zero-length Thrift frame closes its connection at once, on the plain
// and the TLS listener. Received block memory follows the buffer budget. A key the fp16 key
// codec would turn into Inf refuses the put.
#include <errno.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>
#include <thrift/transport/TSSLSocket.h>
#include <thrift/transport/TSocket.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "block_put.h"
#include "daemon_fixture.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/status.h"
#include "kvcomp/rpc/KvcompControl.h"
#include "kvcomp/transport/client.h"
#include "kvcompd_process.h"

namespace kvcomp {
namespace testing {
namespace {

namespace wire = transport::wire;
using transport::UcxClient;

// 2 layers of 2 KV heads of 64 f16 elements: 1 KiB of K and V per token.
const KvLayout kLayout{2, 2, 4, 64, DType::kF16};
constexpr uint64_t kBigTokens = 4608;  // 4.5 MiB of K and V
constexpr uint64_t kMiB = uint64_t{1} << 20;

// A control client that reads replies of up to 1 GiB (Thrift's client default is 16 MB).
class BigReplyClient : public ControlClient {
 public:
  explicit BigReplyClient(int port) : ControlClient(port, 60000, 1 << 30) {}
};

class ControlBoundsTest : public DaemonFixture {
 protected:
  // Puts a lossless cache of kBigTokens tokens under model "m", key `key`; returns its stored
  // bytes.
  uint64_t PutBig(const KvcompdProcess& d, const std::string& key) {
    auto c = Connect(d);
    if (c == nullptr) return 0;
    wire::PutBegin begin = MakePutBegin(kLayout, kBigTokens, "m", key);
    begin.has_policy = true;
    begin.policy.ratio = 0;
    begin.policy.moments = false;
    auto stored = PutRandomF16(*c, begin, 7);
    EXPECT_TRUE(stored.ok()) << stored.status();
    return stored.ok() ? stored->stored_bytes : 0;
  }
};

TEST_F(ControlBoundsTest, RepeatedLargeKeyWithHugeMaxBytesIsBoundedAndReadOnce) {
  auto d = StartDaemon();
  const uint64_t size = PutBig(*d, "big");
  ASSERT_GT(size, 4 * kMiB);
  const rpc::Auth auth = MakeAuth("", "");
  const std::vector<std::string> keys(1024, "big");
  const uint64_t rss_before = ProcStatusKb(d->ports().pid, "VmRSS");
  rpc::StatsResponse stats;
  BigReplyClient c(d->ports().control);
  c->Stats(stats, auth);
  const int64_t gets_before = stats.gets_total;

  for (int round = 0; round < 3; ++round) {
    rpc::GetChunksResponse r;
    c->GetChunks(r, auth, "m", keys, false, int64_t{1} << 62);
    ASSERT_EQ(r.status.code, rpc::StatusCode::OK) << r.status.message;
    // As many whole copies as fit in the 64 MiB bound, and the rest left for another call.
    EXPECT_EQ(r.caches.size(), (64 * kMiB) / size);
    EXPECT_TRUE(r.truncated);
    uint64_t total = 0;
    for (const std::string& cache : r.caches) {
      EXPECT_EQ(cache.size(), size);
      EXPECT_EQ(cache, r.caches[0]);
      total += cache.size();
    }
    EXPECT_LE(total, 64 * kMiB);
  }
  c->Stats(stats, auth);
  EXPECT_EQ(stats.gets_total - gets_before, 3) << "a repeated key was read more than once";

  // Four such calls at once from one tenant: every reply within the bound (some may be refused
  // or cut short by the tenant's bound), and the daemon's peak memory bounded.
  std::vector<std::thread> callers;
  std::vector<rpc::GetChunksResponse> replies(4);
  for (int i = 0; i < 4; ++i) {
    callers.emplace_back([&, i] {
      BigReplyClient ci(d->ports().control);
      ci->GetChunks(replies[i], auth, "m", keys, false, int64_t{1} << 62);
    });
  }
  for (auto& t : callers) t.join();
  for (const auto& r : replies) {
    EXPECT_TRUE(r.status.code == rpc::StatusCode::OK ||
                r.status.code == rpc::StatusCode::RESOURCE_EXHAUSTED)
        << r.status.message;
    EXPECT_LE(r.caches.size() * size, 64 * kMiB);
  }
  ASSERT_TRUE(d->running()) << d->Log();
  const uint64_t peak = ProcStatusKb(d->ports().pid, "VmHWM");
  // Four replies of at most 64 MiB, each with its gathered copy and its write buffer.
  EXPECT_LT(peak - rss_before, 1024 * 1024) << "peak RSS grew by " << (peak - rss_before) / 1024
                                            << " MiB";
  // The memory goes back once the replies are sent.
  absl::SleepFor(absl::Milliseconds(500));
  const uint64_t rss_after = ProcStatusKb(d->ports().pid, "VmRSS");
  std::printf("kvcompd RSS: %llu MiB before, peak %llu MiB, %llu MiB after\n",
              static_cast<unsigned long long>(rss_before / 1024),
              static_cast<unsigned long long>(peak / 1024),
              static_cast<unsigned long long>(rss_after / 1024));
  EXPECT_LT(rss_after, rss_before + 128 * 1024)
      << "RSS " << rss_before / 1024 << " MiB before, " << rss_after / 1024 << " MiB after";
  // The daemon still serves.
  rpc::HealthResponse h;
  c->Health(h, auth);
  EXPECT_EQ(h.status.code, rpc::StatusCode::OK);
}

TEST_F(ControlBoundsTest, FirstCacheLargerThanTheReplyBoundIsResourceExhausted) {
  auto d = StartDaemon({"--control_plane.max_reply_bytes=1Mi",
                        "--control_plane.tenant_reply_bytes=2Mi"});
  const uint64_t size = PutBig(*d, "big");
  ASSERT_GT(size, kMiB);
  const rpc::Auth auth = MakeAuth("", "");
  BigReplyClient c(d->ports().control);
  rpc::GetChunksResponse r;
  c->GetChunks(r, auth, "m", {"big", "big"}, false, 0);
  EXPECT_EQ(r.status.code, rpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(r.status.message, "control_plane.max_reply_bytes"))
      << r.status.message;
  EXPECT_TRUE(r.caches.empty());
  // Decoded, the same.
  c->GetChunks(r, auth, "m", {"big"}, true, 0);
  EXPECT_EQ(r.status.code, rpc::StatusCode::RESOURCE_EXHAUSTED) << r.status.message;
  // A bound below one reply's worth, or a tenant bound below twice it, does not start.
  KvcompdProcess bad(KVCOMPD_PATH, dir_.path() + "/bad",
                     {"--control_plane.max_reply_bytes=4Mi",
                      "--control_plane.tenant_reply_bytes=4Mi"});
  EXPECT_FALSE(bad.Start(10));
  EXPECT_TRUE(absl::StrContains(bad.Log(), "tenant_reply_bytes")) << bad.Log();
}

// The bytes of one framed Health call with `auth`.
std::string HealthFrame(const rpc::Auth& auth) {
  auto memory = std::make_shared<apache::thrift::transport::TMemoryBuffer>();
  auto framed = std::make_shared<apache::thrift::transport::TFramedTransport>(memory);
  rpc::KvcompControlClient c(std::make_shared<apache::thrift::protocol::TBinaryProtocol>(framed));
  c.send_Health(auth);
  return memory->getBufferAsString();
}

// True when the peer has closed `fd` (replies waiting are read and dropped).
bool PeerClosedNow(int fd) {
  char buf[4096];
  while (true) {
    const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) continue;
    return n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK);
  }
}

// A fresh connection's authenticated Health call: OK, or why not.
std::string ServeOnce(int port, const rpc::Auth& auth) {
  try {
    ControlClient c(port);
    rpc::HealthResponse h;
    c->Health(h, auth);
    return h.status.code == rpc::StatusCode::OK ? "" : h.status.message;
  } catch (const std::exception& e) {
    return e.what();
  }
}

// `n` strangers on the control port, each sending a credential-less Health every `period`;
// one found closed is reconnected (counted).
class Strangers {
 public:
  Strangers(int port, int n, absl::Duration period) : port_(port), period_(period) {
    frame_ = HealthFrame(MakeAuth("", ""));
    for (int i = 0; i < n; ++i) fds_.push_back(ConnectLoopback(port));
    thread_ = std::thread([this] { Run(); });
  }
  ~Strangers() {
    stop_ = true;
    thread_.join();
    for (int fd : fds_) close(fd);
  }
  int connected() const { return connected_.load(); }
  int reconnects() const { return reconnects_.load(); }

 private:
  void Run() {
    while (!stop_) {
      int connected = 0;
      for (int& fd : fds_) {
        if (fd >= 0 && PeerClosedNow(fd)) {
          close(fd);
          fd = -1;
        }
        if (fd < 0) {
          fd = ConnectLoopback(port_);
          ++reconnects_;
        }
        if (fd < 0) continue;
        ++connected;
        (void)send(fd, frame_.data(), frame_.size(), MSG_NOSIGNAL);
      }
      connected_ = connected;
      absl::SleepFor(period_);
    }
  }
  const int port_;
  const absl::Duration period_;
  std::string frame_;
  std::vector<int> fds_;
  std::atomic<bool> stop_{false};
  std::atomic<int> connected_{0};
  std::atomic<int> reconnects_{0};
  std::thread thread_;
};

TEST_F(ControlBoundsTest, ValidClientsAreServedWhile256StrangersStayConnected) {
  WriteTokens("alpha: secret-a\nbeta: secret-b\n");
  auto d = StartDaemon({"--auth.token_file=" + tokens_path()});
  const int port = d->ports().control;
  {
    Strangers strangers(port, 256, absl::Seconds(1));
    absl::SleepFor(absl::Milliseconds(1500));
    ASSERT_EQ(strangers.connected(), 256);
    // Within the authentication deadline (10 s) the strangers stay connected, each sending a
    // credential-less call every second, and valid clients of both tenants are served.
    int served = 0;
    for (int i = 0; i < 15; ++i) {
      const rpc::Auth auth =
          i % 2 == 0 ? MakeAuth("alpha", "secret-a") : MakeAuth("beta", "secret-b");
      const std::string why = ServeOnce(port, auth);
      EXPECT_EQ(why, "") << "attempt " << i;
      served += why.empty();
      absl::SleepFor(absl::Milliseconds(400));
    }
    EXPECT_EQ(served, 15);
    // The strangers still hold their 256 connections (a valid client's connection is a stranger
    // until its first call, so each one arriving may close the oldest stranger, which comes
    // back).
    EXPECT_EQ(strangers.connected(), 256);
    // Past the deadline the strangers are closed whatever they sent (refused calls keep
    // nothing open); they reconnect, and valid clients are still served.
    absl::SleepFor(absl::Seconds(6));
    EXPECT_GE(strangers.reconnects(), 256);
    EXPECT_EQ(ServeOnce(port, MakeAuth("alpha", "secret-a")), "");
  }
  const HttpResponse metrics = HttpGet(d->ports().metrics, "/metrics");
  EXPECT_GE(MetricValue(metrics.body,
                        "kvcomp_control_connections_closed_total{reason=\"unauthenticated\"}"),
            256);
}

TEST_F(ControlBoundsTest, StrangersBeyondTheirShareCloseTheOldestStranger) {
  WriteTokens("alpha: secret-a\n");
  auto d = StartDaemon({"--auth.token_file=" + tokens_path(),
                        "--control_plane.max_connections=16",
                        "--control_plane.max_unauthenticated_connections=4"});
  const int port = d->ports().control;
  std::vector<int> fds;
  for (int i = 0; i < 4; ++i) fds.push_back(ConnectLoopback(port));
  absl::SleepFor(absl::Milliseconds(300));
  for (int i = 0; i < 4; ++i) EXPECT_FALSE(PeerClosedNow(fds[i])) << i;
  // A fifth stranger closes the oldest.
  fds.push_back(ConnectLoopback(port));
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_TRUE(PeerClosedNow(fds[0]));
  for (int i = 1; i < 5; ++i) EXPECT_FALSE(PeerClosedNow(fds[i])) << i;
  // A valid client's connection is a stranger only until its first call.
  EXPECT_EQ(ServeOnce(port, MakeAuth("alpha", "secret-a")), "");
  for (int fd : fds) close(fd);
}

TEST_F(ControlBoundsTest, ATenantHoldsAtMostItsShareOfConnections) {
  WriteTokens("alpha: secret-a\nbeta: secret-b\n");
  auto d = StartDaemon({"--auth.token_file=" + tokens_path(),
                        "--control_plane.max_connections=8",
                        "--control_plane.tenant_share=0.5"});
  const rpc::Auth alpha = MakeAuth("alpha", "secret-a");
  std::vector<std::unique_ptr<ControlClient>> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(std::make_unique<ControlClient>(d->ports().control));
    rpc::HealthResponse h;
    (*held.back())->Health(h, alpha);
    ASSERT_EQ(h.status.code, rpc::StatusCode::OK) << i;
  }
  ControlClient fifth(d->ports().control);
  rpc::HealthResponse h;
  fifth->Health(h, alpha);
  EXPECT_EQ(h.status.code, rpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ServeOnce(d->ports().control, MakeAuth("beta", "secret-b")), "");
  // Alpha's held connections keep working.
  (*held[0])->Health(h, alpha);
  EXPECT_EQ(h.status.code, rpc::StatusCode::OK);
  // Every slot held: /readyz says so.
  std::vector<int> fds;
  for (int i = 0; i < 3; ++i) fds.push_back(ConnectLoopback(d->ports().control));
  absl::SleepFor(absl::Milliseconds(300));
  const HttpResponse ready = HttpGet(d->ports().metrics, "/readyz");
  EXPECT_EQ(ready.code, 503);
  EXPECT_TRUE(absl::StrContains(ready.body, "control plane full")) << ready.body;
  for (int fd : fds) close(fd);
}

size_t Lines(const std::string& path) {
  std::ifstream in(path);
  size_t n = 0;
  std::string line;
  while (std::getline(in, line)) ++n;
  return n;
}

TEST_F(ControlBoundsTest, PolicyUpdatesAreBoundedDurableRecords) {
  WriteTokens("alpha: secret-a\nbeta: secret-b\n");
  auto d = StartDaemon({"--auth.token_file=" + tokens_path(),
                        "--control_plane.max_policies_per_tenant=64",
                        "--control_plane.policy_updates_per_second=1000"});
  const rpc::Auth alpha = MakeAuth("alpha", "secret-a");
  const rpc::Auth beta = MakeAuth("beta", "secret-b");
  ControlClient c(d->ports().control);
  rpc::PolicyResponse r;
  c->GetPolicy(r, alpha, "m0");
  rpc::Policy p = r.policy;
  for (int i = 0; i < 64; ++i) {
    p.ratio = 0.5 + i / 256.0;
    c->SetPolicy(r, alpha, "m" + std::to_string(i), p);
    ASSERT_EQ(r.status.code, rpc::StatusCode::OK) << i << ": " << r.status.message;
  }
  c->SetPolicy(r, alpha, "m64", p);
  EXPECT_EQ(r.status.code, rpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(r.status.message, "max_policies_per_tenant")) << r.status.message;
  p.ratio = 0.25;
  c->SetPolicy(r, alpha, "m0", p);  // an existing one may change
  EXPECT_EQ(r.status.code, rpc::StatusCode::OK) << r.status.message;
  c->SetPolicy(r, beta, "m64", p);  // another tenant is not bound by alpha's count
  EXPECT_EQ(r.status.code, rpc::StatusCode::OK) << r.status.message;
  // One record per change, appended; the snapshot is not rewritten per change.
  const std::string snapshot = dir_.path() + "/data/policies.yaml";
  EXPECT_EQ(Lines(snapshot + ".log"), 66u);
  EXPECT_FALSE(std::ifstream(snapshot).good()) << "the whole file was rewritten";
  // A record torn by a crash is skipped, and the next record after a restart is whole.
  {
    std::ofstream log(snapshot + ".log", std::ios::app);
    log << "0badc0de alpha\tm9";
  }
  d->Kill(SIGKILL);
  ASSERT_TRUE(d->Start()) << d->Log();
  {
    ControlClient again(d->ports().control);
    again->GetPolicy(r, alpha, "m63");
    EXPECT_FALSE(r.is_default);
    EXPECT_DOUBLE_EQ(r.policy.ratio, 0.5 + 63 / 256.0);
    again->GetPolicy(r, alpha, "m0");
    EXPECT_DOUBLE_EQ(r.policy.ratio, 0.25);
    p.ratio = 0.375;
    again->SetPolicy(r, alpha, "m1", p);
    EXPECT_EQ(r.status.code, rpc::StatusCode::OK) << r.status.message;
  }
  d->Kill(SIGKILL);
  ASSERT_TRUE(d->Start()) << d->Log();
  ControlClient third(d->ports().control);
  third->GetPolicy(r, alpha, "m1");
  EXPECT_DOUBLE_EQ(r.policy.ratio, 0.375);
  third->GetPolicy(r, beta, "m64");
  EXPECT_FALSE(r.is_default);
}

TEST_F(ControlBoundsTest, PolicyUpdatesAreRateBoundedPerTenant) {
  WriteTokens("alpha: secret-a\nbeta: secret-b\n");
  auto d = StartDaemon({"--auth.token_file=" + tokens_path(),
                        "--control_plane.policy_updates_per_second=2"});
  const rpc::Auth alpha = MakeAuth("alpha", "secret-a");
  ControlClient c(d->ports().control);
  rpc::PolicyResponse r;
  c->GetPolicy(r, alpha, "m");
  const rpc::Policy p = r.policy;
  int ok = 0, refused = 0;
  for (int i = 0; i < 12; ++i) {
    c->SetPolicy(r, alpha, "m", p);
    ok += r.status.code == rpc::StatusCode::OK;
    refused += r.status.code == rpc::StatusCode::RESOURCE_EXHAUSTED;
  }
  EXPECT_GE(ok, 4);   // the burst
  EXPECT_GE(refused, 1);
  EXPECT_EQ(ok + refused, 12);
  c->SetPolicy(r, MakeAuth("beta", "secret-b"), "m", p);
  EXPECT_EQ(r.status.code, rpc::StatusCode::OK) << "one tenant's rate held another's back";
}

// Puts a bf16 cache whose keys are normal(0, 1) except key element `at` of layer 0, set to
// `big`, with key codec fp16; returns the put's status.
absl::Status PutBf16WithKey(UcxClient& c, const std::string& key, size_t at, float big) {
  const KvLayout layout{2, 2, 4, 64, DType::kBF16};
  constexpr uint64_t kTokens = 32;
  wire::PutBegin begin = MakePutBegin(layout, kTokens, "m", key);
  begin.has_policy = true;
  begin.policy.key_codec = KeyCodec::kFp16;
  KVCOMP_ASSIGN_OR_RETURN(uint64_t id, c.PutBegin(begin));
  std::mt19937_64 rng(3);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const size_t count = uint64_t{layout.num_kv_heads} * kTokens * layout.head_dim;
  std::vector<uint16_t> k(count), v(count);
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    for (size_t i = 0; i < count; ++i) {
      k[i] = FloatToBf16(l == 0 && i == at ? big : n(rng));
      v[i] = FloatToBf16(n(rng));
    }
    absl::Status sent = c.SendBlock(LayersBlock(id, layout, kTokens, l, l + 1), k.data(), v.data());
    if (!sent.ok()) {
      (void)c.PutAbort(id);
      return sent;
    }
  }
  return c.PutCommit(id, layout.num_layers).status();
}

TEST_F(ControlBoundsTest, KeysBeyondTheFp16CodecsRangeRefuseThePut) {
  auto d = StartDaemon();
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  const absl::Status big = PutBf16WithKey(*c, "big", 700, 1e6f);
  EXPECT_TRUE(absl::IsInvalidArgument(big)) << big;
  EXPECT_TRUE(absl::StrContains(big.message(), "fp16 key codec")) << big;
  EXPECT_TRUE(absl::StrContains(big.message(), "head 0, token 10")) << big;
  auto look = c->Lookup("m", "big");
  EXPECT_TRUE(absl::IsNotFound(look.status())) << "a cache with Inf keys was stored";
  // Within the half range the same put is stored.
  const absl::Status fits = PutBf16WithKey(*c, "fits", 700, 6e4f);
  EXPECT_TRUE(fits.ok()) << fits;
}

TEST_F(ControlBoundsTest, OneTenantsConnectionsLeaveDescriptorsForAnother) {
  WriteTokens("alpha: secret-a\nbeta: secret-b\n");
  auto d = std::make_unique<KvcompdProcess>(
      KVCOMPD_PATH, dir_.path() + "/data",
      std::vector<std::string>{"--auth.token_file=" + tokens_path()});
  d->SetFdLimit(1024);
  ASSERT_TRUE(d->Start()) << d->Log();
  EXPECT_TRUE(absl::StrContains(d->Log(), "file descriptors: a limit of 1024 holds")) << d->Log();
  // Alpha opens connections until it is refused (its share), at most 400 (with 3 or more
  // descriptors each, far beyond what the daemon's 1024 can hold).
  std::vector<std::unique_ptr<UcxClient>> alpha;
  absl::Status refused;
  for (int i = 0; i < 400 && refused.ok(); ++i) {
    auto c = Connect(*d, "alpha", "secret-a", &refused);
    if (c != nullptr) alpha.push_back(std::move(c));
  }
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_GT(alpha.size(), 8u);
  // Beta still connects and puts.
  absl::Status error;
  auto beta = Connect(*d, "beta", "secret-b", &error);
  ASSERT_NE(beta, nullptr) << error << "\n" << d->Log();
  auto stored = PutRandomF16(*beta, MakePutBegin(kLayout, 64, "m", "k"), 1);
  EXPECT_TRUE(stored.ok()) << stored.status();
  ASSERT_TRUE(d->running());
}

TEST_F(ControlBoundsTest, ZeroLengthFrameClosesTheConnectionAtOnce) {
  // Long deadlines: a close within the receive timeout is the frame's doing.
  auto d = StartDaemon(
      {"--control_plane.idle_timeout_seconds=600", "--control_plane.auth_timeout_seconds=600"});
  const int fd = ConnectLoopback(d->ports().control);
  ASSERT_GE(fd, 0);
  const char zero[4] = {0, 0, 0, 0};
  ASSERT_EQ(send(fd, zero, 4, MSG_NOSIGNAL), 4);
  timeval tv{3, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[64];
  const ssize_t n = recv(fd, buf, sizeof(buf), 0);
  EXPECT_TRUE(n == 0 || (n < 0 && errno == ECONNRESET)) << "connection still open after 3 s";
  close(fd);
  // A valid call's frame after a good one is read as before.
  ControlClient c(d->ports().control);
  rpc::HealthResponse h;
  c->Health(h, MakeAuth("", ""));
  c->Health(h, MakeAuth("", ""));
  EXPECT_EQ(h.status.code, rpc::StatusCode::OK);
  const HttpResponse metrics = HttpGet(d->ports().metrics, "/metrics");
  EXPECT_GE(
      MetricValue(metrics.body, "kvcomp_control_connections_closed_total{reason=\"malformed\"}"),
      1);
}

TEST_F(ControlBoundsTest, ZeroLengthFrameOverTlsClosesTheConnectionAtOnce) {
  const std::string cert = dir_.path() + "/cert.pem", key = dir_.path() + "/key.pem";
  const std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
                          "-keyout " + key + " -out " + cert + " >/dev/null 2>&1";
  if (std::system(cmd.c_str()) != 0) GTEST_SKIP() << "openssl CLI not available";
  auto d = StartDaemon({"--control_plane.tls=true", "--control_plane.tls_cert_file=" + cert,
                        "--control_plane.tls_key_file=" + key,
                        "--control_plane.idle_timeout_seconds=600",
                        "--control_plane.auth_timeout_seconds=600"});
  auto factory = std::make_shared<apache::thrift::transport::TSSLSocketFactory>();
  factory->loadTrustedCertificates(cert.c_str());
  factory->authenticate(true);
  {
    // Long deadlines: a close within the receive timeout is the frame's doing.
    auto socket = factory->createSocket("localhost", d->ports().control);
    socket->setRecvTimeout(30000);
    socket->open();
    const uint8_t zero[4] = {0, 0, 0, 0};
    socket->write(zero, 4);
    socket->flush();
    uint8_t buf[64];
    bool closed = false;
    std::string why;
    try {
      closed = socket->read(buf, sizeof(buf)) == 0;
    } catch (const apache::thrift::transport::TTransportException& e) {
      why = e.what();
      closed = e.getType() != apache::thrift::transport::TTransportException::TIMED_OUT &&
               !absl::StrContains(why, "timed out") && !absl::StrContains(why, "EAGAIN");
    }
    EXPECT_TRUE(closed) << "connection still open after 30 s: " << why;
  }
  const HttpResponse metrics = HttpGet(d->ports().metrics, "/metrics");
  EXPECT_GE(
      MetricValue(metrics.body, "kvcomp_control_connections_closed_total{reason=\"malformed\"}"),
      1);
  // Calls over TLS are read as before, several frames on one connection.
  auto socket = factory->createSocket("localhost", d->ports().control);
  auto transport = std::make_shared<apache::thrift::transport::TFramedTransport>(socket);
  rpc::KvcompControlClient client(
      std::make_shared<apache::thrift::protocol::TBinaryProtocol>(transport));
  transport->open();
  rpc::HealthResponse h;
  for (int i = 0; i < 3; ++i) {
    client.Health(h, MakeAuth("", ""));
    EXPECT_EQ(h.status.code, rpc::StatusCode::OK);
  }
  transport->close();
}

TEST_F(ControlBoundsTest, ReceivedBlockMemoryFollowsTheBufferBudget) {
  auto d = StartDaemon({"--data_plane.max_buffered_bytes=16Mi"});
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  // One layer of 8 KV heads of 128 f16: 4 KiB of K and V per token.
  const KvLayout layout{1, 8, 8, 128, DType::kF16};
  auto put_and_abort = [&](uint64_t tokens) {
    auto id = c->PutBegin(MakePutBegin(layout, tokens, "m", "aborted"));
    ASSERT_TRUE(id.ok()) << id.status();
    // Each layer view is [heads][tokens][d]: the first `tokens` rows of each head are enough.
    std::vector<uint16_t> kk(uint64_t{8} * tokens * 128, 0x3c00), vv(kk.size(), 0x3c00);
    absl::Status sent = c->SendBlock(LayersBlock(*id, layout, tokens, 0, 1), kk.data(), vv.data());
    ASSERT_TRUE(sent.ok()) << sent;
    ASSERT_TRUE(c->PutAbort(*id).ok());
  };
  put_and_abort(1024);
  absl::SleepFor(absl::Milliseconds(300));
  const uint64_t before = ProcStatusKb(d->ports().pid, "VmRSS");
  // 80 blocks of 80 sizes from 4 to 9 MiB: about 520 MiB through a 16 MiB budget.
  for (int i = 0; i < 80; ++i) put_and_abort(1024 + 16 * static_cast<uint64_t>(i));
  absl::SleepFor(absl::Milliseconds(300));
  const uint64_t after = ProcStatusKb(d->ports().pid, "VmRSS");
  std::printf("kvcompd RSS: %llu MiB before the blocks, %llu MiB after\n",
              static_cast<unsigned long long>(before / 1024),
              static_cast<unsigned long long>(after / 1024));
  EXPECT_LT(after, before + 96 * 1024) << "released block buffers kept beyond the budget";
}

uint64_t WalBytes(const std::string& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(dir, ec)) {
    if (f.path().extension() == ".log") total += f.file_size(ec);
  }
  return total;
}

TEST_F(ControlBoundsTest, SigtermAfterAWriteBurstLeavesNoLogToReplay) {
  auto d = StartDaemon({"--storage.put_tier=rocksdb"});
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  // 54 lossless caches of 2 MiB: about 108 MiB, acknowledged once in RocksDB's synced log
  // (payloads below the tier's direct_min_bytes, 4 MiB, go through the log; larger ones are
  // written to files of their own and leave nothing in it).
  constexpr int kBurst = 54;
  for (int i = 0; i < kBurst; ++i) {
    wire::PutBegin begin = MakePutBegin(kLayout, 2048, "m", "burst" + std::to_string(i));
    begin.has_policy = true;
    begin.policy.ratio = 0;
    begin.policy.moments = false;
    auto stored = PutRandomF16(*c, begin, 100 + i);
    ASSERT_TRUE(stored.ok()) << i << ": " << stored.status();
  }
  c.reset();
  const std::string rocksdb = dir_.path() + "/data/rocksdb";
  EXPECT_GT(WalBytes(rocksdb), 16 * kMiB) << "the burst did not reach the log";
  const int status = d->Kill(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << d->Log();
  EXPECT_LT(WalBytes(rocksdb), kMiB) << "a clean shutdown left the log to replay";
  ASSERT_TRUE(d->Start()) << d->Log();
  auto again = Connect(*d);
  ASSERT_NE(again, nullptr);
  auto got = again->Get("m", "burst" + std::to_string(kBurst - 1));
  EXPECT_TRUE(got.ok()) << got.status();
}

// The RocksDB info log's lines since its last open (the file starts again at every open).
std::string RocksDbLog(const std::string& dir) {
  std::ifstream in(dir + "/LOG");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST_F(ControlBoundsTest, SigkillAfterAWriteBurstReplaysTheLogWithoutAFlushAndKeepsEveryPut) {
  auto d = StartDaemon({"--storage.put_tier=rocksdb"});
  const std::string rocksdb = dir_.path() + "/data/rocksdb";
  // Every acknowledged cache's size and CRC32C as served before any kill.
  std::vector<std::pair<uint64_t, uint32_t>> served;
  auto burst = [&](int first, int count) {
    auto c = Connect(*d);
    ASSERT_NE(c, nullptr);
    for (int i = first; i < first + count; ++i) {
      wire::PutBegin begin = MakePutBegin(kLayout, 2048, "m", "crash" + std::to_string(i));
      begin.has_policy = true;
      begin.policy.ratio = 0;
      begin.policy.moments = false;
      auto stored = PutRandomF16(*c, begin, 500 + i);
      ASSERT_TRUE(stored.ok()) << i << ": " << stored.status();
      auto got = c->Get("m", "crash" + std::to_string(i));
      ASSERT_TRUE(got.ok()) << got.status();
      served.emplace_back(got->bytes.size(), Crc32c(got->bytes.data(), got->bytes.size()));
    }
  };
  auto all_served_as_before = [&](const char* when) {
    auto c = Connect(*d);
    ASSERT_NE(c, nullptr) << when;
    for (size_t i = 0; i < served.size(); ++i) {
      auto got = c->Get("m", "crash" + std::to_string(i));
      ASSERT_TRUE(got.ok()) << when << ", cache " << i << ": " << got.status();
      EXPECT_EQ(got->bytes.size(), served[i].first) << when << ", cache " << i;
      EXPECT_EQ(Crc32c(got->bytes.data(), got->bytes.size()), served[i].second)
          << when << ", cache " << i;
    }
  };
  // 54 lossless 2 MiB caches through the synced log (below the tier's direct_min_bytes): more
  // than one 64 MiB memtable, so the log holds what the last flush left.
  ASSERT_NO_FATAL_FAILURE(burst(0, 54));
  const uint64_t wal = WalBytes(rocksdb);
  EXPECT_GT(wal, 16 * kMiB) << "the burst did not reach the log";
  d->Kill(SIGKILL);
  ASSERT_TRUE(d->Start()) << d->Log();
  // The open replayed the log into memtables and wrote no table or blob file for it.
  const std::string log = RocksDbLog(rocksdb);
  EXPECT_TRUE(absl::StrContains(log, "Recovering log")) << "nothing replayed";
  EXPECT_FALSE(absl::StrContains(log, "WriteLevel0TableForRecovery")) << log;
  EXPECT_GE(WalBytes(rocksdb), wal) << "the replayed log was dropped before a flush";
  ASSERT_NO_FATAL_FAILURE(all_served_as_before("after the first SIGKILL"));
  // Killed again before any write: the kept log is replayed again.
  d->Kill(SIGKILL);
  ASSERT_TRUE(d->Start()) << d->Log();
  ASSERT_NO_FATAL_FAILURE(all_served_as_before("after a second SIGKILL with no write between"));
  // Writes after such an open flush what was replayed; killed again, nothing is lost.
  ASSERT_NO_FATAL_FAILURE(burst(54, 24));
  d->Kill(SIGKILL);
  ASSERT_TRUE(d->Start()) << d->Log();
  ASSERT_NO_FATAL_FAILURE(all_served_as_before("after writes and a third SIGKILL"));
  // A clean stop still leaves no log.
  const int status = d->Kill(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << d->Log();
  EXPECT_LT(WalBytes(rocksdb), kMiB) << "a clean shutdown left the log to replay";
}

}  // namespace
}  // namespace testing
}  // namespace kvcomp
