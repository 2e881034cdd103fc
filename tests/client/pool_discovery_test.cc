// Pools found through DNS, against a real DNS server and real daemons: dnsmasq on a free
// 127.0.0.1 port serves pool.kvcomp.test from a hosts file that the test rewrites (and reloads
// with SIGHUP), and kvcompd processes listen on 10.77.0.2, 10.77.0.3, ... (one veth interface
// each, in a private network namespace), all on the same data and control ports. A running client sees the
// pool grow and shrink, puts and gets keep working meanwhile, keys move only for the members that
// changed, a failed member makes the client resolve again at once, and a name with no address is
// a clear error. Also: parsing of dns:/// endpoints and the resolver on its own.
#include <arpa/inet.h>
#include <grp.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "integration/kvcompd_process.h"
#include "kvcomp/client/client.h"
#include "pool.h"
#include "resolver.h"

namespace kvcomp {
namespace client {
namespace {

using testing::KvcompdProcess;
using testing::TempDir;

constexpr char kModel[] = "test/model";
constexpr char kName[] = "pool.kvcomp.test";

// A port nobody listens on now (bound to port 0, read back, closed).
int FreePort(int type, const char* ip) {
  int fd = socket(AF_INET, type, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  inet_pton(AF_INET, ip, &a.sin_addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return 0;
  }
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// The daemons' addresses. UCX's TCP data lanes listen on the first address of the interface
// that a connection arrived on, and a client dials the listener's address, so each daemon needs
// an interface whose first address is its own: lo aliases (127.0.0.2) do not work, see
// docs/operations.md. The test process moves into a private network namespace with one veth
// interface per address; nothing leaves it.
std::string Ip(int n) { return absl::StrCat("10.77.0.", n); }

// Empty when the namespace is ready; else why not. Needs a process with no other thread yet
// (a mount namespace cannot be unshared by one thread of several).
std::string EnterPrivateNetwork() {
  if (unshare(CLONE_NEWNET | CLONE_NEWNS) != 0) {
    return absl::StrCat("unshare(CLONE_NEWNET | CLONE_NEWNS): ", std::strerror(errno),
                        " (needs CAP_SYS_ADMIN and CAP_NET_ADMIN)");
  }
  // lo first: the tests without daemons need it even when the rest fails.
  std::string cmd = "ip link set lo up";
  for (int n = 2; n <= 5; ++n) {
    absl::StrAppend(&cmd, " && ip link add kvc", n, " type veth peer name kvc", n, "p",
                    " && ip addr add ", Ip(n), "/24 dev kvc", n, " && ip link set kvc", n,
                    " up && ip link set kvc", n, "p up");
  }
  if (std::system(cmd.c_str()) != 0) return "setting up interfaces with ip(8) failed";
  // UCX lists network devices under /sys/class/net, which shows the namespace of whoever
  // mounted sysfs: mount a fresh one (as `ip netns exec` does), else UCX in this process and
  // in the daemons sees the host's interfaces and refuses ours ("device is not enabled").
  if (mount(nullptr, "/", nullptr, MS_REC | MS_SLAVE, nullptr) != 0) {
    return absl::StrCat("making mounts private: ", std::strerror(errno));
  }
  umount2("/sys", MNT_DETACH);
  if (mount("sysfs", "/sys", "sysfs", 0, nullptr) != 0) {
    return absl::StrCat("mounting sysfs for the private network: ", std::strerror(errno));
  }
  return "";
}

bool WaitFor(const std::function<bool()>& done, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return done();
}

// dnsmasq answering for kvcomp.test only: names of the hosts file resolve, others are NXDOMAIN.
class Dnsmasq {
 public:
  explicit Dnsmasq(std::string dir) : dir_(std::move(dir)), hosts_(dir_ + "/pool.hosts") {}
  ~Dnsmasq() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
  }

  bool Start() {
    WriteHosts({});
    for (int attempt = 0; attempt < 5 && pid_ <= 0; ++attempt) {
      port_ = FreePort(SOCK_DGRAM, "127.0.0.1");
      if (port_ == 0) continue;
      Spawn();
      // Up once it answers (NXDOMAIN for the still unlisted name).
      auto r = NewAresResolver({server(), absl::Seconds(1)});
      if (!r.ok()) return false;
      const bool up = WaitFor(
          [&] {
            if (!Running()) return true;
            return absl::IsNotFound((*r)->Resolve(kName).status());
          },
          10);
      if (up && Running()) return true;
      Stop();  // the port was taken meanwhile: try another
    }
    return false;
  }

  // Serves `ips` for kName from now on (once dnsmasq has reloaded; see Serve).
  void SetAddresses(const std::vector<std::string>& ips) {
    WriteHosts(ips);
    kill(pid_, SIGHUP);
  }
  // SetAddresses, then waits until dnsmasq answers with `ips`.
  bool Serve(std::vector<std::string> ips) {
    SetAddresses(ips);
    std::sort(ips.begin(), ips.end());
    auto r = NewAresResolver({server(), absl::Seconds(1)});
    return r.ok() && WaitFor(
                         [&] {
                           auto got = (*r)->Resolve(kName);
                           return ips.empty() ? absl::IsNotFound(got.status())
                                              : (got.ok() && *got == ips);
                         },
                         10);
  }
  std::string server() const { return absl::StrCat("127.0.0.1:", port_); }
  int port() const { return port_; }
  std::string Log() const {
    std::ifstream in(dir_ + "/dnsmasq.log");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

 private:
  void WriteHosts(const std::vector<std::string>& ips) {
    const std::string tmp = hosts_ + ".tmp";
    {
      std::ofstream f(tmp, std::ios::trunc);
      for (const auto& ip : ips) f << ip << " " << kName << "\n";
    }
    std::rename(tmp.c_str(), hosts_.c_str());
  }
  void Spawn() {
    const passwd* pw = getpwuid(getuid());
    const group* gr = getgrgid(getgid());
    std::vector<std::string> args = {
        "dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null",
        absl::StrCat("--port=", port_), "--listen-address=127.0.0.1", "--bind-interfaces",
        "--no-resolv", "--no-hosts", "--addn-hosts=" + hosts_, "--local=/kvcomp.test/",
        "--cache-size=0", "--local-ttl=0", "--pid-file=" + dir_ + "/dnsmasq.pid",
        "--log-facility=-", "--log-queries"};
    // As root dnsmasq would switch to nobody, who cannot read the hosts file on reload.
    if (pw != nullptr) args.push_back(absl::StrCat("--user=", pw->pw_name));
    if (gr != nullptr) args.push_back(absl::StrCat("--group=", gr->gr_name));
    const std::string log = dir_ + "/dnsmasq.log";
    pid_ = fork();
    if (pid_ == 0) {
      FILE* f = std::fopen(log.c_str(), "a");
      if (f != nullptr) {
        dup2(fileno(f), STDOUT_FILENO);
        dup2(fileno(f), STDERR_FILENO);
      }
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execvp("dnsmasq", argv.data());
      _exit(127);
    }
  }
  bool Running() {
    if (pid_ <= 0) return false;
    if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
      pid_ = -1;
      return false;
    }
    return true;
  }
  void Stop() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
    pid_ = -1;
  }

  const std::string dir_, hosts_;
  int port_ = 0;
  pid_t pid_ = -1;
};

struct Cache {
  KvLayout layout{2, 2, 4, 64, DType::kF16};
  uint64_t tokens = 32;
  std::vector<std::vector<uint16_t>> k, v;
  Cache() {
    for (uint32_t l = 0; l < layout.num_layers; ++l) {
      k.emplace_back(layout.num_kv_heads * tokens * layout.head_dim);
      v.emplace_back(k.back().size());
      for (size_t i = 0; i < k.back().size(); ++i) {
        k.back()[i] = FloatToHalf(static_cast<float>((i * 7 + l) % 13) / 13.0f - 0.5f);
        v.back()[i] = FloatToHalf(static_cast<float>((i * 5 + l) % 11) / 11.0f - 0.5f);
      }
    }
  }
  std::vector<LayerData> layers() const {
    std::vector<LayerData> out;
    for (size_t l = 0; l < k.size(); ++l) out.push_back({k[l].data(), v[l].data()});
    return out;
  }
};

class PoolDiscoveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Tests with daemons need the private network (entered before the first test).
    const std::string test = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    if (test != "ResolverReturnsEveryAddress" && !NetworkError().empty()) {
      GTEST_SKIP() << "no private network: " << NetworkError();
    }
    dns_ = std::make_unique<Dnsmasq>(dir_.path());
    ASSERT_TRUE(dns_->Start()) << dns_->Log();
  }

  // Starts kvcompd on `ip`, on the pool's shared ports (the first daemon picks them).
  void StartDaemon(const std::string& ip) {
    std::vector<std::string> flags = {"--data_plane.address=" + ip,
                                      "--control_plane.address=" + ip,
                                      "--metrics.address=" + ip};
    if (data_port_ != 0) {
      flags.push_back(absl::StrCat("--data_plane.port=", data_port_));
      flags.push_back(absl::StrCat("--control_plane.port=", control_port_));
    }
    auto d = std::make_unique<KvcompdProcess>(KVCOMPD_PATH, dir_.path() + "/" + ip, flags);
    ASSERT_TRUE(d->Start()) << d->Log();
    if (data_port_ == 0) {
      data_port_ = d->ports().data;
      control_port_ = d->ports().control;
    }
    ASSERT_EQ(d->ports().data, data_port_);
    daemons_[ip] = std::move(d);
  }

  std::string DaemonLogs() const {
    std::string out;
    for (const auto& [ip, d] : daemons_) absl::StrAppend(&out, "\n--- kvcompd on ", ip, ":\n", d->Log());
    return out;
  }

  std::string Spec() const { return absl::StrCat("dns:///", kName, ":", data_port_, ",", control_port_); }
  std::string Member(const std::string& ip) const { return absl::StrCat(ip, ":", data_port_); }

  ClientOptions Options(absl::Duration refresh) const {
    ClientOptions o;
    o.dns_server = dns_->server();
    o.dns_refresh_interval = refresh;
    o.connect_timeout = absl::Seconds(2);
    o.request_timeout = absl::Seconds(10);
    return o;
  }

  // The client's members, sorted.
  static std::vector<std::string> MembersOf(const Client& c) {
    std::vector<std::string> m = c.Ranking(kModel, "any");
    std::sort(m.begin(), m.end());
    return m;
  }
  bool WaitForMembers(const Client& c, std::vector<std::string> want) {
    std::sort(want.begin(), want.end());
    return WaitFor([&] { return MembersOf(c) == want; }, 15);
  }

  // Why the private network could not be entered (empty when the process is in it).
  static const std::string& NetworkError();
  TempDir dir_;
  std::unique_ptr<Dnsmasq> dns_;
  int data_port_ = 0;
  int control_port_ = 0;
  std::map<std::string, std::unique_ptr<KvcompdProcess>> daemons_;
};

// The whole process enters the private network before the first test, while it has a single
// thread; dnsmasq and the daemons it starts inherit it. Without one (not root), the daemon
// tests are skipped and the rest runs on the host's 127.0.0.1.
class PrivateNetwork : public ::testing::Environment {
 public:
  void SetUp() override { error_ = EnterPrivateNetwork(); }
  static std::string error_;
};
std::string PrivateNetwork::error_ = "not entered";
const ::testing::Environment* const kPrivateNetwork =
    ::testing::AddGlobalTestEnvironment(new PrivateNetwork);

const std::string& PoolDiscoveryTest::NetworkError() { return PrivateNetwork::error_; }

std::vector<std::string> Without(std::vector<std::string> v, const std::string& x) {
  v.erase(std::remove(v.begin(), v.end(), x), v.end());
  return v;
}

TEST(DnsEndpoint, ParsesAndRejectsClearly) {
  auto d = ParseDnsEndpoint("dns:///kvcomp.ns.svc:7420,7421");
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(d->has_value());
  EXPECT_EQ((*d)->name, "kvcomp.ns.svc");
  EXPECT_EQ((*d)->data_port, 7420);
  EXPECT_EQ((*d)->control_port, 7421);
  EXPECT_EQ((*d)->At("10.0.0.7").data, "10.0.0.7:7420");
  EXPECT_EQ((*d)->At("10.0.0.7").control, "10.0.0.7:7421");
  EXPECT_EQ((*d)->At("fd00::7").data, "[fd00::7]:7420");
  auto no_control = ParseDnsEndpoint("dns:///kvcomp:7420");
  ASSERT_TRUE(no_control.ok() && no_control->has_value());
  EXPECT_TRUE((*no_control)->At("10.0.0.7").control.empty());
  auto plain = ParseDnsEndpoint("127.0.0.1:7420");
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->has_value());
  for (const char* bad : {"dns:///kvcomp", "dns:///:7420", "dns:///kvcomp:0", "dns:///kvcomp:x",
                          "dns:///kvcomp:7420,", "dns:///kvcomp:7420,1,2", "dns:///a b:7420",
                          "dns://10.0.0.10/kvcomp:7420", "dns:kvcomp:7420"}) {
    auto r = ParseDnsEndpoint(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(r.status().message(), "dns:///NAME:DATA_PORT")) << r.status();
  }
  auto server = ParseDnsEndpoint("dns://10.0.0.10/kvcomp:7420");
  EXPECT_TRUE(absl::StrContains(server.status().message(), "dns_server")) << server.status();
}

TEST(DnsEndpoint, ConnectRejectsBadOptions) {
  ClientOptions o;
  o.dns_server = "not an address";
  auto c = Client::Connect({"dns:///kvcomp.test:7420"}, o, false);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), "not an address")) << c.status();
  o.dns_server = "";
  o.dns_refresh_interval = absl::Seconds(-1);
  c = Client::Connect({"dns:///kvcomp.test:7420"}, o, false);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  o.dns_refresh_interval = absl::Seconds(5);
  c = Client::Connect({"dns:///kvcomp.test:7420", "dns:///kvcomp.test:7420"}, o, false);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
}

TEST(DnsEndpoint, OptionsOutOfRangeAreRefusedBeforeAnyQuery) {
  // A refresh period of a nanosecond would query DNS as fast as the resolver answers.
  ClientOptions o;
  o.dns_refresh_interval = absl::Nanoseconds(1);
  auto c = Client::Connect({"dns:///kvcomp.test:7420"}, o, false);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), "dns_refresh_interval")) << c.status();
  o.dns_refresh_interval = absl::ZeroDuration();  // no periodic refresh: allowed
  EXPECT_TRUE(Client::Connect({"127.0.0.1:1"}, o, false).ok());
  const std::vector<std::pair<const char*, std::function<void(ClientOptions&)>>> bad = {
      {"connect_timeout", [](ClientOptions& x) { x.connect_timeout = absl::ZeroDuration(); }},
      {"request_timeout", [](ClientOptions& x) { x.request_timeout = absl::InfiniteDuration(); }},
      {"initial_backoff", [](ClientOptions& x) { x.initial_backoff = absl::Seconds(5); }},
      {"max_backoff", [](ClientOptions& x) { x.max_backoff = absl::Hours(2); }},
      {"down_for", [](ClientOptions& x) { x.down_for = absl::Seconds(-1); }},
      {"replicas", [](ClientOptions& x) { x.replicas = 1000; }},
      {"attempts_per_endpoint", [](ClientOptions& x) { x.attempts_per_endpoint = 1 << 30; }},
      {"max_block_bytes", [](ClientOptions& x) { x.max_block_bytes = uint64_t{1} << 40; }},
  };
  for (const auto& [name, edit] : bad) {
    ClientOptions x;
    edit(x);
    auto r = Client::Connect({"127.0.0.1:1"}, x, false);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_TRUE(absl::StrContains(r.status().message(), name)) << r.status();
  }
}

TEST_F(PoolDiscoveryTest, ResolverReturnsEveryAddress) {
  auto r = NewAresResolver({dns_->server(), absl::Seconds(2)});
  ASSERT_TRUE(r.ok()) << r.status();
  dns_->SetAddresses({Ip(4), Ip(2), Ip(3)});
  std::vector<std::string> want = {Ip(2), Ip(3), Ip(4)};
  ASSERT_TRUE(WaitFor(
      [&] {
        auto got = (*r)->Resolve(kName);
        return got.ok() && *got == want;
      },
      10))
      << dns_->Log();
  auto missing = (*r)->Resolve("nothing.kvcomp.test");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  EXPECT_TRUE(absl::StrContains(missing.status().message(), "nothing.kvcomp.test"));
  EXPECT_TRUE(absl::StrContains(missing.status().message(), "no address"));
  // A server that is not there: Unavailable, within the bound.
  const int dead = FreePort(SOCK_DGRAM, "127.0.0.1");
  auto silent = NewAresResolver({absl::StrCat("127.0.0.1:", dead), absl::Seconds(1)});
  ASSERT_TRUE(silent.ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto down = (*silent)->Resolve(kName);
  EXPECT_EQ(down.status().code(), absl::StatusCode::kUnavailable) << down.status();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
}

TEST_F(PoolDiscoveryTest, PoolGrowsAndShrinksUnderARunningClient) {
  const std::string a = Ip(2), b = Ip(3), c = Ip(4);
  StartDaemon(a);
  StartDaemon(b);
  ASSERT_TRUE(dns_->Serve({a, b})) << dns_->Log();
  ClientOptions o = Options(absl::Milliseconds(200));
  auto client_or = Client::Connect({Spec()}, o);
  ASSERT_TRUE(client_or.ok()) << client_or.status() << DaemonLogs();
  Client& client = **client_or;
  ASSERT_TRUE(WaitForMembers(client, {Member(a), Member(b)})) << dns_->Log();

  Cache cache;
  constexpr int kKeys = 48;
  std::map<std::string, std::vector<std::string>> before;  // key -> ranking over {a, b}
  for (int i = 0; i < kKeys; ++i) {
    const std::string key = absl::StrCat("k", i);
    auto put = client.Put(kModel, key, cache.layout, cache.tokens, cache.layers());
    ASSERT_TRUE(put.ok()) << put.status();
    before[key] = client.Ranking(kModel, key);
    ASSERT_EQ(put->endpoints, std::vector<std::string>{before[key][0]});
  }

  // Puts and gets go on from another thread while the pool changes. A get may miss a cache
  // only when the member that stored it has left the pool.
  std::atomic<bool> stop{false};
  std::atomic<int> rounds{0}, failures{0};
  std::string first_failure;
  std::thread traffic([&] {
    for (int i = 0; !stop.load(); ++i) {
      const std::string key = absl::StrCat("t", i);
      auto put = client.Put(kModel, key, cache.layout, cache.tokens, cache.layers());
      absl::Status s = put.status();
      if (put.ok()) {
        auto got = client.Get(kModel, key);
        s = got.status();
        if (absl::IsNotFound(s)) {
          const auto members = client.Ranking(kModel, key);
          if (std::find(members.begin(), members.end(), put->endpoints[0]) == members.end()) {
            s = absl::OkStatus();
          }
        } else if (got.ok() && got->original_tokens != cache.tokens) {
          s = absl::InternalError("wrong cache");
        }
      }
      if (!s.ok() && failures.fetch_add(1) == 0) first_failure = s.ToString();
      rounds.fetch_add(1);
    }
  });

  // Grow: c joins.
  StartDaemon(c);
  dns_->SetAddresses({a, b, c});
  ASSERT_TRUE(WaitForMembers(client, {Member(a), Member(b), Member(c)})) << dns_->Log();
  int moved = 0;
  for (const auto& [key, old_rank] : before) {
    const std::vector<std::string> now = client.Ranking(kModel, key);
    // Only keys that c now ranks first move, and the old members keep their order.
    EXPECT_EQ(Without(now, Member(c)), old_rank) << key;
    if (now[0] != old_rank[0]) {
      EXPECT_EQ(now[0], Member(c)) << key;
      ++moved;
    }
    // Every cache stays readable: a get walks past c (which lacks it) to the old owner.
    auto look = client.Lookup(kModel, key);
    ASSERT_TRUE(look.ok()) << key << ": " << look.status();
    EXPECT_EQ(look->endpoint, old_rank[0]) << key;
  }
  EXPECT_GT(moved, 0);
  EXPECT_LT(moved, kKeys);
  // New puts reach c for the keys it ranks first.
  int on_c = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string key = absl::StrCat("n", i);
    auto put = client.Put(kModel, key, cache.layout, cache.tokens, cache.layers());
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ(put->endpoints[0], client.Ranking(kModel, key)[0]);
    on_c += put->endpoints[0] == Member(c);
  }
  EXPECT_GT(on_c, 0);

  // Shrink: b leaves DNS (still running: the client must stop using it on its own).
  const int rounds_before_shrink = rounds.load();
  dns_->SetAddresses({a, c});
  ASSERT_TRUE(WaitForMembers(client, {Member(a), Member(c)})) << dns_->Log();
  for (const auto& [key, old_rank] : before) {
    const std::vector<std::string> now = client.Ranking(kModel, key);
    EXPECT_EQ(now.size(), 2u);
    if (old_rank[0] == Member(b)) {
      // Stored on b only: no longer reachable through the pool.
      EXPECT_TRUE(absl::IsNotFound(client.Get(kModel, key).status())) << key;
    } else {
      EXPECT_TRUE(client.Get(kModel, key).ok()) << key;
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // requests begun before finish
  daemons_[b]->Kill(SIGKILL);
  EXPECT_TRUE(WaitFor([&] { return rounds.load() > rounds_before_shrink + 5; }, 30));
  stop = true;
  traffic.join();
  EXPECT_GT(rounds.load(), 5);
  EXPECT_EQ(failures.load(), 0) << first_failure;
}

TEST_F(PoolDiscoveryTest, FailedMemberMakesTheClientResolveAgain) {
  const std::string a = Ip(2), b = Ip(3);
  StartDaemon(a);
  StartDaemon(b);
  ASSERT_TRUE(dns_->Serve({a, b})) << dns_->Log();
  // No periodic refresh: only a failure can make the client notice.
  auto client_or = Client::Connect({Spec()}, Options(absl::ZeroDuration()));
  ASSERT_TRUE(client_or.ok()) << client_or.status();
  Client& client = **client_or;
  ASSERT_EQ(MembersOf(client), (std::vector<std::string>{Member(a), Member(b)}));
  std::string on_b;
  for (int i = 0; on_b.empty(); ++i) {
    const std::string key = absl::StrCat("k", i);
    if (client.Ranking(kModel, key)[0] == Member(b)) on_b = key;
  }
  daemons_[b]->Kill(SIGKILL);
  ASSERT_TRUE(dns_->Serve({a})) << dns_->Log();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  EXPECT_EQ(MembersOf(client).size(), 2u);  // nothing has told the client yet
  Cache cache;
  auto put = client.Put(kModel, on_b, cache.layout, cache.tokens, cache.layers());
  ASSERT_TRUE(put.ok()) << put.status();  // b fails to connect; a takes the copy
  EXPECT_EQ(put->endpoints, std::vector<std::string>{Member(a)});
  EXPECT_TRUE(WaitForMembers(client, {Member(a)}));
}

TEST_F(PoolDiscoveryTest, NameWithNoAddressIsAClearErrorUntilMembersAppear) {
  StartDaemon(Ip(2));
  ClientOptions o = Options(absl::Milliseconds(200));
  auto now = Client::Connect({Spec()}, o);
  EXPECT_EQ(now.status().code(), absl::StatusCode::kUnavailable) << now.status();
  EXPECT_TRUE(absl::StrContains(now.status().message(), kName)) << now.status();
  EXPECT_TRUE(absl::StrContains(now.status().message(), "no address")) << now.status();

  // A client made before the pool has members fails each call with the same reason, then
  // works once the name resolves.
  auto lazy = Client::Connect({Spec()}, o, /*connect_now=*/false);
  ASSERT_TRUE(lazy.ok()) << lazy.status();
  Cache cache;
  auto put = (*lazy)->Put(kModel, "k", cache.layout, cache.tokens, cache.layers());
  EXPECT_EQ(put.status().code(), absl::StatusCode::kUnavailable) << put.status();
  EXPECT_TRUE(absl::StrContains(put.status().message(), "no kvcompd in the pool"));
  EXPECT_TRUE(absl::StrContains(put.status().message(), kName)) << put.status();
  EXPECT_TRUE((*lazy)->Ranking(kModel, "k").empty());
  auto stats = (*lazy)->Stats();
  ASSERT_EQ(stats.size(), 1u);
  EXPECT_EQ(stats[0].status.code(), absl::StatusCode::kUnavailable);

  dns_->SetAddresses({Ip(2)});
  ASSERT_TRUE(WaitForMembers(**lazy, {Member(Ip(2))})) << dns_->Log();
  put = (*lazy)->Put(kModel, "k", cache.layout, cache.tokens, cache.layers());
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_TRUE((*lazy)->Get(kModel, "k").ok());
  stats = (*lazy)->Stats();
  ASSERT_EQ(stats.size(), 1u);
  EXPECT_TRUE(stats[0].status.ok()) << stats[0].status;
  EXPECT_EQ(stats[0].caches, 1u);

  // The pool empties again: calls fail clearly, nothing crashes or hangs.
  dns_->SetAddresses({});
  ASSERT_TRUE(WaitForMembers(**lazy, {})) << dns_->Log();
  auto got = (*lazy)->Get(kModel, "k");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_TRUE(absl::StrContains(got.status().message(), "no address")) << got.status();
}

}  // namespace
}  // namespace client
}  // namespace kvcomp
