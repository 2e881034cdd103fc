// The data plane under abuse, against real kvcompd processes on loopback: file-descriptor
// exhaustion, endpoints that never say hello, slow and stopped clients, clients that vanish
// mid-put, one tenant holding its whole share, concurrent large blocks against the memory
// budget, and a restart right after SIGKILL with a client connected.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "block_put.h"
#include "daemon_fixture.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/client.h"
#include "kvcompd_process.h"

namespace kvcomp {
namespace testing {
namespace {

namespace wire = transport::wire;
using transport::UcxClient;

const KvLayout kLayout{2, 2, 4, 64, DType::kBF16};
constexpr uint64_t kTokens = 128;

wire::PutBegin Begin(const std::string& key, const KvLayout& layout = kLayout,
                     uint64_t tokens = kTokens) {
  return MakePutBegin(layout, tokens, "m", key);
}

// A whole put of bf16 noise, one block per layer.
absl::Status PutWhole(UcxClient& c, const std::string& key, const KvLayout& layout = kLayout,
                      uint64_t tokens = kTokens) {
  KVCOMP_ASSIGN_OR_RETURN(uint64_t id, c.PutBegin(Begin(key, layout, tokens)));
  std::vector<uint16_t> k(layout.LayerBytes(tokens) / 2), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = FloatToBf16(static_cast<float>((i * 7919) % 1000) / 500.0f - 1.0f);
    v[i] = FloatToBf16(static_cast<float>((i * 104729) % 1000) / 500.0f - 1.0f);
  }
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    KVCOMP_RETURN_IF_ERROR(
        c.SendBlock(LayersBlock(id, layout, tokens, l, l + 1), k.data(), v.data()));
  }
  return c.PutCommit(id, layout.num_layers).status();
}

// User plus system CPU seconds of a process.
double CpuSeconds(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::istringstream rest(all.substr(all.rfind(')') + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::strtod(field.c_str(), nullptr);
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

size_t OpenFds(int pid) {
  size_t n = 0;
  std::string cmd = "ls /proc/" + std::to_string(pid) + "/fd | wc -l";
  FILE* p = popen(cmd.c_str(), "r");
  if (p != nullptr) {
    if (fscanf(p, "%zu", &n) != 1) n = 0;
    pclose(p);
  }
  return n;
}

size_t FileSize(const std::string& path) {
  std::ifstream in(path, std::ios::ate | std::ios::binary);
  return in ? static_cast<size_t>(in.tellg()) : 0;
}

// Plain TCP connections to a port, holding their descriptors.
std::vector<int> OpenTcp(int port, int count) {
  std::vector<int> fds;
  for (int i = 0; i < count; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) break;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(fd);
      continue;
    }
    fds.push_back(fd);
  }
  return fds;
}

// UCX endpoints to the daemon that complete UCX's wire-up and then never send a message: one
// context and worker, progressed by a thread of their own.
class SilentEndpoints {
 public:
  SilentEndpoints(int port, int count) {
    ucp_config_t* cfg = nullptr;
    if (ucp_config_read(nullptr, nullptr, &cfg) != UCS_OK) return;
    ucp_config_modify(cfg, "TLS", "tcp");
    ucp_params_t params = {};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    ucs_status_t s = ucp_init(&params, cfg, &context_);
    ucp_config_release(cfg);
    if (s != UCS_OK) return;
    ucp_worker_params_t wp = {};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    if (ucp_worker_create(context_, &wp, &worker_) != UCS_OK) return;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    for (int i = 0; i < count; ++i) {
      ucp_ep_params_t ep = {};
      ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
      ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
      ep.sockaddr.addrlen = sizeof(addr);
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = [](void*, ucp_ep_h, ucs_status_t) {};
      ucp_ep_h h = nullptr;
      if (ucp_ep_create(worker_, &ep, &h) == UCS_OK) eps_.push_back(h);
      for (int j = 0; j < 20; ++j) ucp_worker_progress(worker_);
    }
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        if (ucp_worker_progress(worker_) == 0) absl::SleepFor(absl::Microseconds(200));
      }
    });
  }
  ~SilentEndpoints() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
    for (ucp_ep_h ep : eps_) {
      ucp_request_param_t p = {};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      void* req = ucp_ep_close_nbx(ep, &p);
      if (UCS_PTR_IS_PTR(req)) {
        while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(worker_);
        ucp_request_free(req);
      }
    }
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }
  size_t size() const { return eps_.size(); }

 private:
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<ucp_ep_h> eps_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class DataPlaneAdmissionTest : public DaemonFixture {
 protected:
  DataPlaneAdmissionTest() {
    default_flags_ = {"--data_plane.ucx_tls=tcp", "--engine.workers=1"};
  }
  // Connects, retrying for up to `within` (the daemon may be refusing connections for a while).
  std::unique_ptr<UcxClient> ConnectWithin(const KvcompdProcess& d, absl::Duration within,
                                           const std::string& tenant = "",
                                           const std::string& token = "") {
    const absl::Time end = absl::Now() + within;
    absl::Status last;
    while (absl::Now() < end) {
      auto c = Connect(d, tenant, token, &last);
      if (c != nullptr) return c;
      absl::SleepFor(absl::Milliseconds(200));
    }
    ADD_FAILURE() << "no connection within " << within << ": " << last;
    return nullptr;
  }
};

TEST_F(DataPlaneAdmissionTest, FdExhaustionRefusesConnectionsWithoutSpinningAndRecovers) {
  auto d = StartDaemon();
  ASSERT_GT(d->ports().data, 0) << d->Log();
  const int pid = d->ports().pid;
  auto before = Connect(*d);
  ASSERT_NE(before, nullptr);
  ASSERT_TRUE(PutWhole(*before, "before").ok());
  // Leave the daemon 200 descriptors, then connect more than that to its data port.
  const size_t open = OpenFds(pid);
  ASSERT_GT(open, 0u);
  const std::string prlimit = absl::StrCat("prlimit --pid ", pid, " --nofile=", open + 200, ":",
                                           open + 200);
  ASSERT_EQ(std::system(prlimit.c_str()), 0) << prlimit;
  const size_t log_before = FileSize(d->log_path());
  const double cpu_before = CpuSeconds(pid);
  std::vector<int> flood = OpenTcp(d->ports().data, 400);
  absl::SleepFor(absl::Seconds(3));
  const double cpu = CpuSeconds(pid) - cpu_before;
  const size_t logged = FileSize(d->log_path()) - log_before;
  // A listener retrying accept() would burn a core (about 3 s of CPU here) and write megabytes.
  EXPECT_LT(cpu, 1.5) << "CPU seconds in 3 s of descriptor exhaustion";
  EXPECT_LT(logged, 256u << 10) << "log bytes in 3 s of descriptor exhaustion";
  EXPECT_TRUE(d->running());
  // A connection made before keeps working.
  EXPECT_TRUE(before->Ping().ok());
  for (int fd : flood) close(fd);
  // Once the descriptors are back, new connections are served again.
  auto after = ConnectWithin(*d, absl::Seconds(20));
  ASSERT_NE(after, nullptr);
  EXPECT_TRUE(PutWhole(*after, "after").ok());
  EXPECT_TRUE(after->Get("m", "before").ok());
  const std::string log = d->Log();
  EXPECT_NE(log.find("listener closed"), std::string::npos) << log.substr(0, 4000);
}

TEST_F(DataPlaneAdmissionTest, SilentEndpointsDoNotLockOutARealClient) {
  // More silent endpoints than the daemon takes at once; none of them ever says hello.
  auto d = StartDaemon({"--data_plane.max_connections=64", "--data_plane.hello_timeout_seconds=30"});
  ASSERT_GT(d->ports().data, 0) << d->Log();
  SilentEndpoints silent(d->ports().data, 200);
  ASSERT_GT(silent.size(), 100u);
  absl::SleepFor(absl::Seconds(1));
  // A real client gets in at once (well before any hello timeout) and is served.
  transport::ClientOptions o;
  o.ucx.overrides["TLS"] = "tcp";
  o.connect_timeout = absl::Seconds(5);
  auto c = UcxClient::Connect(*transport::Endpoint::Parse(d->data_endpoint()), "", "", o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(PutWhole(**c, "real").ok());
  EXPECT_TRUE((*c)->Get("m", "real").ok());
}

TEST_F(DataPlaneAdmissionTest, OneTenantHoldingItsShareLeavesTheOthersServed) {
  WriteTokens("a: token-a\nb: token-b\n");
  auto d = StartDaemon({"--auth.token_file=" + tokens_path(), "--data_plane.max_open_puts=8"});
  ASSERT_GT(d->ports().data, 0) << d->Log();
  auto a = Connect(*d, "a", "token-a");
  auto b = Connect(*d, "b", "token-b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  // Tenant a opens as many empty puts as it may (its share of 8), then is answered busy.
  int opened = 0;
  for (int i = 0; i < 8; ++i) {
    wire::PutBegin begin = Begin("held-" + std::to_string(i));
    begin.put_id = 1000 + i;
    auto r = a->SendRawForTesting(50 + i, wire::Encode(50 + i, begin), "");
    ASSERT_TRUE(r.ok()) << r.status();
    if (r->status.ok()) ++opened;
    if (IsBusy(r->status)) break;
  }
  EXPECT_GE(opened, 1);
  EXPECT_LT(opened, 8) << "one tenant took every open put";
  // Tenant b's puts go through while a holds its puts open.
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(PutWhole(*b, "b-" + std::to_string(i)).ok());
  }
}

TEST_F(DataPlaneAdmissionTest, BufferedBytesOfOneTenantLeaveRoomForAnother) {
  // Tenant a holds blocks of open puts it never commits; tenant b's blocks still fit.
  WriteTokens("a: token-a\nb: token-b\n");
  const KvLayout big{1, 8, 8, 128, DType::kBF16};  // 4 KiB per token, K and V
  const uint64_t tokens = 1024;                     // 4 MiB blocks
  auto d = StartDaemon({"--auth.token_file=" + tokens_path(), "--data_plane.max_block_bytes=4Mi",
                        "--data_plane.max_buffered_bytes=16Mi"});
  ASSERT_GT(d->ports().data, 0) << d->Log();
  auto a = Connect(*d, "a", "token-a", nullptr, absl::Seconds(2));
  auto b = Connect(*d, "b", "token-b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  std::vector<uint16_t> k(big.LayerBytes(tokens) / 2, 0x3f80), v(k.size(), 0x3f80);
  int held = 0;
  for (int i = 0; i < 8; ++i) {
    auto id = a->PutBegin(Begin("a-" + std::to_string(i), big, tokens));
    ASSERT_TRUE(id.ok()) << id.status();
    absl::Status s = a->SendBlock(LayersBlock(*id, big, tokens, 0, 1), k.data(), v.data());
    if (!s.ok()) {
      EXPECT_TRUE(IsBusy(s)) << s;
      break;
    }
    ++held;
  }
  EXPECT_LT(held, 4) << "tenant a buffered all of max_buffered_bytes";
  EXPECT_TRUE(PutWhole(*b, "b", big, tokens).ok());
}

TEST_F(DataPlaneAdmissionTest, ConcurrentLargeBlocksStayWithinTheMemoryBudget) {
  // Twelve clients send one 32 MiB block each at once against a 64 MiB budget: blocks beyond it
  // are answered busy before their buffers exist, so the daemon's peak RSS grows by about the
  // budget, not by twelve blocks.
  const KvLayout big{1, 8, 8, 128, DType::kBF16};  // 4 KiB per token (K and V)
  const uint64_t tokens = 8192;                     // 32 MiB blocks
  auto d = StartDaemon({"--data_plane.max_block_bytes=32Mi", "--data_plane.max_buffered_bytes=64Mi",
                        "--data_plane.max_put_bytes=64Mi", "--storage.durability=memory",
                        "--storage.rocksdb_enabled=false", "--storage.host_capacity_bytes=256Mi"});
  ASSERT_GT(d->ports().data, 0) << d->Log();
  const int pid = d->ports().pid;
  // Everything the daemon allocates once (UCX, pools) is there after a first put of this size.
  {
    auto warm = Connect(*d);
    ASSERT_NE(warm, nullptr);
    ASSERT_TRUE(PutWhole(*warm, "warm", big, tokens).ok());
  }
  const uint64_t rss_before_kb = ProcStatusKb(pid, "VmRSS");
  constexpr int kClients = 12;
  std::vector<std::unique_ptr<UcxClient>> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.push_back(Connect(*d, "", "", nullptr, absl::Seconds(1)));
    ASSERT_NE(clients.back(), nullptr);
  }
  std::vector<uint16_t> k(big.LayerBytes(tokens) / 2, 0x3f80), v(k.size(), 0x3f80);
  std::atomic<int> sent{0}, busy{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      auto id = clients[i]->PutBegin(Begin("big-" + std::to_string(i), big, tokens));
      if (!id.ok()) return;
      absl::Status s =
          clients[i]->SendBlock(LayersBlock(*id, big, tokens, 0, 1), k.data(), v.data());
      if (s.ok()) {
        sent++;
      } else if (IsBusy(s)) {
        busy++;
      }
    });
  }
  for (auto& t : threads) t.join();
  const uint64_t peak_kb = ProcStatusKb(pid, "VmHWM");
  EXPECT_GE(sent.load(), 1);
  EXPECT_GE(busy.load(), 1) << "every block was admitted";
  // Budget 64 MiB plus a generous 160 MiB for everything else a put touches.
  const uint64_t grown_mb = peak_kb > rss_before_kb ? (peak_kb - rss_before_kb) >> 10 : 0;
  EXPECT_LT(grown_mb, 64u + 160u) << "peak RSS grew by " << grown_mb << " MiB";
  // The held puts end; their buffers go back: a new block fits again.
  clients.clear();
  auto c = ConnectWithin(*d, absl::Seconds(10));
  ASSERT_NE(c, nullptr);
  EXPECT_TRUE(PutWhole(*c, "after", big, tokens).ok());
}

TEST_F(DataPlaneAdmissionTest, VanishingClientsMidPutGiveTheirBuffersBack) {
  // Clients die holding blocks of open puts that fill the budget; the daemon frees them (peer
  // failure) and the next client's put fits.
  const KvLayout big{1, 8, 8, 128, DType::kBF16};
  const uint64_t tokens = 1024;  // 4 MiB blocks
  auto d = StartDaemon({"--data_plane.max_block_bytes=4Mi", "--data_plane.max_buffered_bytes=8Mi",
                        "--data_plane.tenant_share=1", "--data_plane.put_timeout_seconds=600"});
  ASSERT_GT(d->ports().data, 0) << d->Log();
  for (int i = 0; i < 2; ++i) {
    int ready[2];
    ASSERT_EQ(pipe(ready), 0);
    pid_t child = fork();
    if (child == 0) {
      close(ready[0]);
      auto c = Connect(*d);
      if (c == nullptr) _exit(3);
      auto id = c->PutBegin(Begin("vanish-" + std::to_string(i), big, tokens));
      if (!id.ok()) _exit(4);
      std::vector<uint16_t> k(big.LayerBytes(tokens) / 2, 0x3f80), v(k.size(), 0x3f80);
      if (!c->SendBlock(LayersBlock(*id, big, tokens, 0, 1), k.data(), v.data()).ok()) _exit(5);
      char byte = 1;
      if (write(ready[1], &byte, 1) != 1) _exit(6);
      raise(SIGKILL);
      _exit(7);
    }
    close(ready[1]);
    char byte = 0;
    ASSERT_EQ(read(ready[0], &byte, 1), 1) << "child " << i << " failed before its block";
    close(ready[0]);
    int status = 0;
    waitpid(child, &status, 0);
  }
  // Both 4 MiB blocks were held (8 MiB budget full) when their clients died; with a put timeout
  // of 10 minutes only the disconnect can free them.
  auto c = Connect(*d, "", "", nullptr, absl::Seconds(20));
  ASSERT_NE(c, nullptr);
  EXPECT_TRUE(PutWhole(*c, "next", big, tokens).ok());
}

TEST_F(DataPlaneAdmissionTest, StoppedClientDoesNotHoldUpOthersAndResumes) {
  // A client stopped (SIGSTOP) in the middle of a put holds nothing the others need; after
  // SIGCONT it finishes its put.
  auto d = StartDaemon({"--data_plane.max_open_puts=4"});
  ASSERT_GT(d->ports().data, 0) << d->Log();
  int ready[2], go[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(go), 0);
  pid_t child = fork();
  if (child == 0) {
    close(ready[0]);
    close(go[1]);
    auto c = Connect(*d);
    if (c == nullptr) _exit(3);
    auto id = c->PutBegin(Begin("stopped"));
    if (!id.ok()) _exit(4);
    std::vector<uint16_t> k(kLayout.LayerBytes(kTokens) / 2, 0x3f80), v(k.size(), 0x3f80);
    if (!c->SendBlock(LayersBlock(*id, kLayout, kTokens, 0, 1), k.data(), v.data()).ok()) _exit(5);
    char byte = 1;
    if (write(ready[1], &byte, 1) != 1) _exit(6);
    if (read(go[0], &byte, 1) != 1) _exit(7);
    if (!c->SendBlock(LayersBlock(*id, kLayout, kTokens, 1, 2), k.data(), v.data()).ok()) _exit(8);
    if (!c->PutCommit(*id, 2).ok()) _exit(9);
    _exit(0);
  }
  close(ready[1]);
  close(go[0]);
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  ASSERT_EQ(kill(child, SIGSTOP), 0);
  {
    auto c = Connect(*d);
    ASSERT_NE(c, nullptr);
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(PutWhole(*c, "other-" + std::to_string(i)).ok());
    EXPECT_TRUE(c->Get("m", "other-0").ok());
  }
  ASSERT_EQ(kill(child, SIGCONT), 0);
  ASSERT_EQ(write(go[1], &byte, 1), 1);
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  EXPECT_TRUE(c->Lookup("m", "stopped").ok());
}

TEST_F(DataPlaneAdmissionTest, SlowClientsTricklingBlocksDoNotStarveOthers) {
  // Slowloris on the data plane: connections that each keep a put open by trickling a tiny
  // block now and then, as many as one tenant may; another tenant is served meanwhile.
  WriteTokens("slow: token-s\nfast: token-f\n");
  auto d = StartDaemon({"--auth.token_file=" + tokens_path(), "--data_plane.max_open_puts=8",
                        "--data_plane.max_connections=16"});
  ASSERT_GT(d->ports().data, 0) << d->Log();
  const KvLayout one_layer{1, 2, 4, 64, DType::kBF16};
  std::vector<std::unique_ptr<UcxClient>> slow;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 16; ++i) {
    absl::Status error;
    auto c = Connect(*d, "slow", "token-s", &error, absl::Milliseconds(500));
    if (c == nullptr) break;
    auto id = c->PutBegin(Begin("slow-" + std::to_string(i), one_layer, 1024));
    if (!id.ok()) break;
    slow.push_back(std::move(c));
    ids.push_back(*id);
  }
  EXPECT_LT(slow.size(), 16u) << "one tenant took every connection and put";
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    std::vector<uint16_t> k(one_layer.LayerBytes(1) / 2, 0x3f80), v(k.size(), 0x3f80);
    for (uint64_t t = 0; t < 1024 && !stop.load(); ++t) {
      for (size_t i = 0; i < slow.size(); ++i) {
        wire::Block b = LayersBlock(ids[i], one_layer, 1, 0, 1);
        b.token_begin = t;
        b.token_end = t + 1;
        (void)slow[i]->SendBlock(b, k.data(), v.data());
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
  });
  auto fast = ConnectWithin(*d, absl::Seconds(5), "fast", "token-f");
  ASSERT_NE(fast, nullptr);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(PutWhole(*fast, "fast-" + std::to_string(i)).ok());
  stop.store(true);
  trickle.join();
}

TEST_F(DataPlaneAdmissionTest, RestartRightAfterSigkillBindsItsPorts) {
  // Fixed ports (a restart must get the same ones back): free ones, picked by the kernel.
  const int data = FreeLoopbackPort(), control = FreeLoopbackPort(), metrics = FreeLoopbackPort();
  const std::vector<std::string> ports = {absl::StrCat("--data_plane.port=", data),
                                          absl::StrCat("--control_plane.port=", control),
                                          absl::StrCat("--metrics.port=", metrics)};
  // KvcompdProcess asks for port 0 first; later flags win.
  auto d = std::make_unique<KvcompdProcess>(
      KVCOMPD_PATH, dir_.path() + "/data",
      std::vector<std::string>{"--data_plane.ucx_tls=tcp", ports[0], ports[1], ports[2]});
  ASSERT_TRUE(d->Start()) << d->Log();
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(PutWhole(*c, "kept").ok());
  // A client stays connected, with a put open, while the daemon is killed.
  ASSERT_TRUE(c->PutBegin(Begin("open")).ok());
  d->Kill(SIGKILL);
  ASSERT_TRUE(d->Start()) << "restart after SIGKILL failed:\n" << d->Log();
  EXPECT_EQ(d->ports().data, data);
  auto again = Connect(*d);
  ASSERT_NE(again, nullptr);
  EXPECT_TRUE(again->Get("m", "kept").ok());
  EXPECT_TRUE(PutWhole(*again, "after-restart").ok());
}

}  // namespace
}  // namespace testing
}  // namespace kvcomp
