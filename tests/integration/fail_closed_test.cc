// kvcompd fails closed and stays bounded for strangers (real daemon processes on loopback):
// a configured token source never lowers authentication (broken at reload: previous tokens kept;
// broken at start: the daemon refuses to start); the Thrift control plane reads at most
// control_plane.max_frame_bytes per frame, holds at most control_plane.max_connections
// connections, closes idle ones and closes at once one whose request does not decode; when its
// serving thread dies the daemon stops being ready and says why; a start that fails says why;
// values with NaN or Inf are refused like keys.
#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "block_put.h"
#include "daemon_fixture.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/rpc/kvcomp_constants.h"
#include "kvcomp/transport/client.h"
#include "kvcompd_process.h"

namespace kvcomp {
namespace testing {
namespace {

namespace wire = transport::wire;
using transport::UcxClient;

const KvLayout kLayout{2, 2, 4, 64, DType::kF16};
constexpr uint64_t kTokens = 64;
constexpr char kReloadFailures[] = "kvcomp_auth_reload_failures_total";

// Puts one cache (one block per layer) whose values are random except element `bad_at` of
// layer 0's values, set to `bad` (no change when bad_at is out of range).
absl::StatusOr<wire::CacheSummary> Put(UcxClient& c, const std::string& key, uint64_t seed,
                                       size_t bad_at = SIZE_MAX, float bad = 0,
                                       bool bad_in_keys = false) {
  return PutRandomF16(c, MakePutBegin(kLayout, kTokens, "m", key), seed,
                      [&](uint32_t l, std::vector<uint16_t>& k, std::vector<uint16_t>& v) {
                        if (l == 0 && bad_at < k.size()) {
                          (bad_in_keys ? k : v)[bad_at] = FloatToHalf(bad);
                        }
                      });
}

// Polls /metrics until `series` reaches at least `at_least` (or 15 s pass); returns its value.
double MetricAtLeast(const KvcompdProcess& d, const std::string& series, double at_least) {
  double v = -1;
  for (int i = 0; i < 150; ++i) {
    v = MetricValue(HttpGet(d.ports().metrics, "/metrics").body, series);
    if (v >= at_least) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return v;
}

// A raw TCP connection to 127.0.0.1:port with a receive timeout; -1 on failure.
int RawConnect(int port, double recv_timeout_s = 5) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) return -1;
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(recv_timeout_s);
  tv.tv_usec = static_cast<suseconds_t>((recv_timeout_s - static_cast<double>(tv.tv_sec)) * 1e6);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// Whether the peer closed `fd` (end of stream or reset) before its receive timeout.
bool PeerClosed(int fd) {
  char buf[64];
  const ssize_t n = recv(fd, buf, sizeof(buf), 0);
  return n == 0 || (n < 0 && errno == ECONNRESET);
}

// The control plane answers an authenticated call on a fresh connection.
bool ControlAnswers(const KvcompdProcess& d, const rpc::Auth& auth) {
  try {
    ControlClient rpc(d.ports().control);
    rpc::HealthResponse h;
    rpc->Health(h, auth);
    return h.status.code == rpc::StatusCode::OK;
  } catch (const std::exception&) {
    return false;
  }
}

class FailClosedTest : public DaemonFixture {
 protected:
  // Anonymous (and wrong) credentials are refused on both planes; alpha's token still works
  // for puts, gets and lists.
  void ExpectAuthRequired(const KvcompdProcess& d, const std::string& when) {
    SCOPED_TRACE(when);
    absl::Status error;
    EXPECT_EQ(Connect(d, "", "", &error), nullptr) << "anonymous data-plane hello accepted";
    EXPECT_EQ(error.code(), absl::StatusCode::kUnauthenticated) << error;
    EXPECT_EQ(Connect(d, "default", "", &error), nullptr);
    EXPECT_EQ(Connect(d, "alpha", "wrong", &error), nullptr);
    ControlClient rpc(d.ports().control);
    rpc::ListResponse list;
    rpc->List(list, MakeAuth("", ""), "", "", 100);
    EXPECT_EQ(list.status.code, rpc::StatusCode::UNAUTHENTICATED);
    rpc::LookupResponse look;
    rpc::CacheRef ref;
    ref.model_id = "m";
    ref.key = "a0";
    rpc->Lookup(look, MakeAuth("", ""), ref);
    EXPECT_EQ(look.status.code, rpc::StatusCode::UNAUTHENTICATED);
    auto a = Connect(d, "alpha", "secret-a");
    ASSERT_NE(a, nullptr) << "the previous token no longer works";
    ++puts_;
    EXPECT_TRUE(Put(*a, "after-" + std::to_string(puts_), puts_).ok());
    EXPECT_TRUE(a->Get("m", "a0").ok());
    rpc->List(list, MakeAuth("alpha", "secret-a"), "", "", 100);
    EXPECT_EQ(list.status.code, rpc::StatusCode::OK);
    EXPECT_GE(list.caches.size(), 1u);
    const std::string m = HttpGet(d.ports().metrics, "/metrics").body;
    EXPECT_EQ(MetricValue(m, "kvcomp_auth_required"), 1);
  }

  // Starts with alpha's token from `source`, breaks the source with `breakit`, reloads (SIGHUP,
  // and the modification-time check), and checks that nothing was lowered.
  void BreakAtReload(const std::string& source, const std::function<void()>& breakit,
                     const std::string& what) {
    SCOPED_TRACE(what);
    auto d = StartDaemon({"--auth.token_file=" + source});
    ASSERT_TRUE(d->running());
    {
      auto a = Connect(*d, "alpha", "secret-a");
      ASSERT_NE(a, nullptr);
      ASSERT_TRUE(Put(*a, "a0", 1).ok());
    }
    ExpectAuthRequired(*d, "before: " + what);
    breakit();
    d->Signal(SIGHUP);
    EXPECT_GE(MetricAtLeast(*d, kReloadFailures, 1), 1) << d->Log();
    absl::SleepFor(absl::Milliseconds(600));  // several modification-time checks (0.2 s)
    ExpectAuthRequired(*d, "after: " + what);
    EXPECT_TRUE(absl::StrContains(d->Log(), "token reload failed (previous tokens kept)"))
        << d->Log();
    EXPECT_FALSE(absl::StrContains(d->Log(), "OPEN single-tenant")) << d->Log();
  }

  int puts_ = 0;
};

TEST_F(FailClosedTest, BrokenTokenFileAtReloadKeepsAuthRequired) {
  const std::string f = tokens_path();
  auto write = [&](const std::string& text) {
    std::ofstream out(f, std::ios::trunc);
    out << text;
  };
  write("alpha: secret-a\n");
  BreakAtReload(f, [&] { write(""); }, "file emptied");
  write("alpha: secret-a\n");
  BreakAtReload(f, [&] { write("# every tenant removed\n\n   # nothing left\n"); },
                "comments only");
  write("alpha: secret-a\n");
  BreakAtReload(f, [&] { std::remove(f.c_str()); }, "file deleted");
  write("alpha: secret-a\n");
  BreakAtReload(f, [&] { write("alpha: [not, a, token]\n"); }, "malformed");
  write("alpha: secret-a\n");
  // Unreadable for everyone, root included: the path becomes a symlink loop.
  BreakAtReload(
      f,
      [&] {
        std::remove(f.c_str());
        ASSERT_EQ(symlink(f.c_str(), f.c_str()), 0);
      },
      "unreadable (symlink loop)");
  std::remove(f.c_str());
  if (geteuid() != 0) {  // permission bits stop only non-root readers
    write("alpha: secret-a\n");
    BreakAtReload(f, [&] { chmod(f.c_str(), 0); }, "unreadable (mode 000)");
    chmod(f.c_str(), 0600);
  }
}

TEST_F(FailClosedTest, EmptiedTokenDirectoryAtReloadKeepsAuthRequired) {
  const std::string dir = dir_.path() + "/secret";
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  {
    std::ofstream(dir + "/alpha") << "secret-a\n";
  }
  BreakAtReload(dir, [&] { std::remove((dir + "/alpha").c_str()); }, "directory emptied");
  {
    std::ofstream(dir + "/alpha") << "secret-a\n";
  }
  BreakAtReload(dir, [&] { std::ofstream(dir + "/alpha", std::ios::trunc) << "  \n"; },
                "token file in the directory emptied");
}

TEST_F(FailClosedTest, ConfiguredButUnusableTokenSourceRefusesToStart) {
  const std::string f = tokens_path();
  const std::string dir = dir_.path() + "/empty-secret";
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  struct Case {
    std::string what, text;  // text "-" = no file
    std::string path;
  };
  const std::vector<Case> cases = {
      {"missing", "-", f},
      {"empty", "", f},
      {"comments only", "# no tenants yet\n", f},
      {"malformed", "alpha: [1, 2]\n", f},
      {"empty directory", "-", dir},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::remove(f.c_str());
    if (c.text != "-") std::ofstream(f, std::ios::trunc) << c.text;
    KvcompdProcess d(KVCOMPD_PATH, dir_.path() + "/data-" + std::to_string(&c - &cases[0]),
                     {"--auth.token_file=" + c.path});
    EXPECT_FALSE(d.Start(20)) << "started with an unusable token source:\n" << d.Log();
    EXPECT_FALSE(d.running());
    EXPECT_TRUE(absl::StrContains(d.Log(), "cannot start")) << d.Log();
    EXPECT_TRUE(absl::StrContains(d.Log(), "auth")) << d.Log();
  }
}

TEST_F(FailClosedTest, NoTokenSourceRunsOpenAndSaysSo) {
  auto d = StartDaemon();
  EXPECT_TRUE(absl::StrContains(d->Log(), "AUTHENTICATION OFF")) << d->Log();
  const std::string m = HttpGet(d->ports().metrics, "/metrics").body;
  EXPECT_EQ(MetricValue(m, "kvcomp_auth_required"), 0);
  EXPECT_NE(Connect(*d, "anyone", "anything"), nullptr);
}

TEST_F(FailClosedTest, OversizeFrameFromAStrangerIsRefusedBeforeBuffering) {
  auto d = StartDaemon({"--control_plane.max_frame_bytes=64Ki"});
  const rpc::Auth auth = MakeAuth("", "");
  ControlClient real(d->ports().control);
  rpc::HealthResponse h;
  real->Health(h, auth);
  ASSERT_EQ(h.status.code, rpc::StatusCode::OK);
  // A frame header announcing 100 MiB, then a little of it: the daemon closes the connection
  // at once instead of waiting for (and buffering) the rest.
  for (uint32_t announced : {100u << 20, 65u << 10}) {
    SCOPED_TRACE(announced);
    int fd = RawConnect(d->ports().control);
    ASSERT_GE(fd, 0);
    const uint32_t be = htonl(announced);
    std::string frame(reinterpret_cast<const char*>(&be), 4);
    frame += std::string(4096, 'x');
    ASSERT_EQ(send(fd, frame.data(), frame.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(frame.size()));
    EXPECT_TRUE(PeerClosed(fd)) << "oversize frame not refused";
    close(fd);
  }
  // Frames within the limit are served; the real client never noticed.
  real->Health(h, auth);
  EXPECT_EQ(h.status.code, rpc::StatusCode::OK);
  EXPECT_TRUE(ControlAnswers(*d, auth));
}

// A framed TBinaryProtocol call of LookupPrefix whose key list announces `announced` elements and
// carries none: a few dozen bytes, no credentials.
std::string LookupPrefixAnnouncing(uint32_t announced) {
  std::string body;
  auto i32 = [&body](uint32_t v) {
    const uint32_t be = htonl(v);
    body.append(reinterpret_cast<const char*>(&be), 4);
  };
  auto field = [&body](uint8_t type, uint16_t id) {
    body.push_back(static_cast<char>(type));
    body.push_back(static_cast<char>(id >> 8));
    body.push_back(static_cast<char>(id & 0xff));
  };
  const std::string method = "LookupPrefix";
  i32(0x80010001u);  // strict binary protocol, CALL
  i32(static_cast<uint32_t>(method.size()));
  body += method;
  i32(1);              // sequence id
  field(12, 1);        // 1: Auth auth (empty)
  body.push_back(0);   // stop
  field(11, 2);        // 2: string model_id
  i32(1);
  body += "m";
  field(15, 3);        // 3: list<binary> keys
  body.push_back(11);  // element type: string
  i32(announced);
  const uint32_t len = htonl(static_cast<uint32_t>(body.size()));
  return std::string(reinterpret_cast<const char*>(&len), 4) + body;
}

// A framed call of `method` (strict binary protocol) whose message type word is `type_word` and
// whose body after the sequence id is `args`.
std::string ControlFrame(const std::string& method, uint32_t type_word, const std::string& args) {
  std::string body;
  auto i32 = [&body](uint32_t v) {
    const uint32_t be = htonl(v);
    body.append(reinterpret_cast<const char*>(&be), 4);
  };
  i32(type_word);
  i32(static_cast<uint32_t>(method.size()));
  body += method;
  i32(7);  // sequence id
  body += args;
  const uint32_t len = htonl(static_cast<uint32_t>(body.size()));
  return std::string(reinterpret_cast<const char*>(&len), 4) + body;
}

TEST_F(FailClosedTest, MalformedControlRequestClosesTheConnectionAtOnce) {
  // With a 600 s idle timeout, a close within the 5 s receive timeout is the daemon closing the
  // connection because of the request, not because it went idle.
  auto d = StartDaemon({"--control_plane.idle_timeout_seconds=600"});
  const rpc::Auth auth = MakeAuth("", "");
  struct Case {
    const char* what;
    std::string frame;
  };
  const std::vector<Case> cases = {
      // An argument field of a type that does not exist (0x55): the arguments do not parse.
      {"unknown field type", ControlFrame("Health", 0x80010001u, std::string("\x55\x00\x01", 3))},
      // The frame ends inside the Auth struct.
      {"truncated arguments", ControlFrame("Health", 0x80010001u, std::string("\x0c\x00\x01", 3))},
      // Message type 5 is neither a call nor a oneway call.
      {"invalid message type", ControlFrame("Health", 0x80010005u, std::string(1, '\0'))},
      // A non-strict header announcing a 2 GB method name.
      {"oversized method name", std::string("\x00\x00\x00\x08\x7f\xff\xff\xff" "abcd", 12)},
      // A list of 25 million keys in a 33-byte call (its size bound is a quarter of the frame).
      {"announced list beyond the frame", LookupPrefixAnnouncing(25000000)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    int fd = RawConnect(d->ports().control, 5);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(send(fd, c.frame.data(), c.frame.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(c.frame.size()));
    EXPECT_TRUE(PeerClosed(fd)) << "malformed request neither answered nor closed in 5 s";
    close(fd);
  }
  // A well-formed call of a method the daemon does not have is answered, not closed.
  int fd = RawConnect(d->ports().control, 5);
  ASSERT_GE(fd, 0);
  const std::string unknown = ControlFrame("NoSuchMethod", 0x80010001u, std::string(1, '\0'));
  ASSERT_EQ(send(fd, unknown.data(), unknown.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(unknown.size()));
  char reply[256];
  EXPECT_GT(recv(fd, reply, sizeof(reply), 0), 4) << "no TApplicationException reply";
  close(fd);
  EXPECT_TRUE(ControlAnswers(*d, auth));
  // Operators see the closes: one per malformed request.
  EXPECT_GE(MetricAtLeast(*d, "kvcomp_control_connections_closed_total{reason=\"malformed\"}",
                          static_cast<double>(cases.size())),
            static_cast<double>(cases.size()));
}

TEST_F(FailClosedTest, StartFailureSaysWhyItFailed) {
  // The control port is taken: the daemon starts its store and engine, fails to listen, stops
  // what it started and says it failed to start and why, not that a drain ran out of time.
  int busy = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  ASSERT_EQ(bind(busy, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(busy, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(busy, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string port = std::to_string(ntohs(addr.sin_port));
  KvcompdProcess d(KVCOMPD_PATH, dir_.path() + "/data-busy", {"--control_plane.port=" + port});
  EXPECT_FALSE(d.Start(20)) << d.Log();
  EXPECT_FALSE(d.running());
  close(busy);
  const std::string log = d.Log();
  EXPECT_TRUE(absl::StrContains(log, "failed to start")) << log;
  EXPECT_TRUE(absl::StrContains(log, "cannot start")) << log;
  EXPECT_TRUE(absl::StrContains(log, "127.0.0.1:" + port)) << log;
  EXPECT_FALSE(absl::StrContains(log, "DEADLINE_EXCEEDED")) << log;
  EXPECT_FALSE(absl::StrContains(log, "grace period")) << log;
  EXPECT_FALSE(absl::StrContains(log, "finishing in-flight work")) << log;
  EXPECT_FALSE(absl::StrContains(log, "stopped (")) << log;
}

TEST_F(FailClosedTest, AnnouncedListSizesDoNotAllocateBeforeAuthentication) {
  // Thrift checks an announced list or string size against its own 100 MB default only: without
  // the daemon's bounds, each of these 33-byte calls made it allocate about 800 MB (25 million
  // empty strings) before any token was read.
  WriteTokens("alpha: secret-a\n");
  auto d = StartDaemon({"--auth.token_file=" + tokens_path()});
  const int pid = d->ports().pid;
  const uint64_t before_kb = ProcStatusKb(pid, "VmHWM");
  ASSERT_GT(before_kb, 0u);
  const std::string frame = LookupPrefixAnnouncing(25'000'000);
  for (int i = 0; i < 4; ++i) {
    int fd = RawConnect(d->ports().control, 2);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(send(fd, frame.data(), frame.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(frame.size()));
    char buf[256];
    (void)recv(fd, buf, sizeof(buf), 0);  // an error reply, a close or the 2 s timeout
    close(fd);
  }
  const uint64_t after_kb = ProcStatusKb(pid, "VmHWM");
  // Generous: the unbounded daemon grew by ~780 MB here.
  EXPECT_LT(after_kb - before_kb, 200u * 1024) << "peak RSS " << before_kb << " kB -> " << after_kb
                                               << " kB";
  EXPECT_TRUE(ControlAnswers(*d, MakeAuth("alpha", "secret-a"))) << d->Log();
}

TEST_F(FailClosedTest, LargestControlRequestFitsTheDefaultFrameLimit) {
  // LookupPrefix with MAX_PREFIX_KEYS keys of the longest length a key may have.
  auto d = StartDaemon();
  ControlClient rpc(d->ports().control);
  std::vector<std::string> keys;
  for (int i = 0; i < rpc::g_kvcomp_constants.MAX_PREFIX_KEYS; ++i) {
    std::string k(1024, 'k');
    std::snprintf(k.data(), 16, "%015d", i);
    keys.push_back(k);
  }
  rpc::LookupPrefixResponse r;
  rpc->LookupPrefix(r, MakeAuth("", ""), "m", keys);
  EXPECT_EQ(r.status.code, rpc::StatusCode::OK) << r.status.message;
  EXPECT_EQ(r.held, 0);
}

TEST_F(FailClosedTest, ThriftConnectionCapAndIdleTimeout) {
  auto d = StartDaemon({"--control_plane.max_connections=4",
                        "--control_plane.idle_timeout_seconds=5",
                        "--control_plane.auth_timeout_seconds=5"});
  const rpc::Auth auth = MakeAuth("", "");
  ControlClient real(d->ports().control);
  rpc::HealthResponse h;
  real->Health(h, auth);
  ASSERT_EQ(h.status.code, rpc::StatusCode::OK);
  std::vector<int> strangers;
  for (int i = 0; i < 3; ++i) {
    strangers.push_back(RawConnect(d->ports().control, 0.2));
    ASSERT_GE(strangers.back(), 0);
  }
  // One of them is a slow sender: a frame header and a few bytes, the rest never.
  const uint32_t be = htonl(100);
  const std::string partial = std::string(reinterpret_cast<const char*>(&be), 4) + "abc";
  ASSERT_EQ(send(strangers[0], partial.data(), partial.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(partial.size()));
  // The cap is reached: a fifth connection is closed on accept.
  int extra = RawConnect(d->ports().control, 2);
  ASSERT_GE(extra, 0);
  EXPECT_TRUE(PeerClosed(extra)) << "connection beyond control_plane.max_connections admitted";
  close(extra);
  for (int fd : strangers) EXPECT_FALSE(PeerClosed(fd)) << "admitted connection closed early";
  EXPECT_GE(MetricAtLeast(*d, "kvcomp_control_connections_closed_total{reason=\"limit\"}", 1), 1);
  // The real client keeps working while strangers hold the rest; strangers that complete no
  // request are closed after the authentication deadline, a client that keeps calling is not.
  const absl::Time until = absl::Now() + absl::Seconds(8);
  while (absl::Now() < until) {
    real->Health(h, auth);
    ASSERT_EQ(h.status.code, rpc::StatusCode::OK);
    absl::SleepFor(absl::Milliseconds(300));
  }
  for (int fd : strangers) {
    EXPECT_TRUE(PeerClosed(fd)) << "idle connection not closed";
    close(fd);
  }
  EXPECT_GE(MetricAtLeast(*d, "kvcomp_control_connections_closed_total{reason=\"unauthenticated\"}",
                         3),
            3);
  // Admission resumes below the cap.
  EXPECT_TRUE(ControlAnswers(*d, auth));
  real->Health(h, auth);
  EXPECT_EQ(h.status.code, rpc::StatusCode::OK);
}

size_t OpenFds(int pid) {
  size_t n = 0;
  if (DIR* dir = opendir(("/proc/" + std::to_string(pid) + "/fd").c_str())) {
    while (struct dirent* e = readdir(dir)) n += e->d_name[0] != '.';
    closedir(dir);
  }
  return n;
}

TEST_F(FailClosedTest, ThriftThreadDeathTakesReadinessAndSaysWhy) {
  auto d = StartDaemon({"--control_plane.max_connections=100000"});
  ASSERT_EQ(HttpGet(d->ports().metrics, "/readyz").code, 200);
  const int pid = d->ports().pid;
  // Leave the daemon a few descriptors: Thrift's accept then fails with EMFILE, which ends its
  // serving thread.
  const rlim_t limit = OpenFds(pid) + 4;
  const rlimit lim{limit, limit};
  ASSERT_EQ(prlimit(pid, RLIMIT_NOFILE, &lim, nullptr), 0) << std::strerror(errno);
  std::vector<int> conns;
  for (int i = 0; i < 16; ++i) {
    int fd = RawConnect(d->ports().control, 0.2);
    if (fd >= 0) conns.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(500));
  for (int fd : conns) close(fd);
  HttpResponse ready;
  for (int i = 0; i < 100; ++i) {
    ready = HttpGet(d->ports().metrics, "/readyz");
    if (ready.code == 503) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(ready.code, 503) << ready.body << "\n" << d->Log();
  EXPECT_TRUE(absl::StrContains(ready.body, "control plane (Thrift) stopped serving")) << ready.body;
  EXPECT_NE(HttpGet(d->ports().metrics, "/healthz").code, 200);
  EXPECT_TRUE(absl::StrContains(d->Log(), "control plane (Thrift) stopped serving")) << d->Log();
  EXPECT_EQ(MetricValue(HttpGet(d->ports().metrics, "/metrics").body, "kvcomp_ready"), 0);
  EXPECT_TRUE(d->running());
}

TEST_F(FailClosedTest, NanOrInfValuesAreRefusedLikeKeys) {
  auto d = StartDaemon();
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  const size_t at = (uint64_t{1} * kTokens + 37) * kLayout.head_dim + 5;  // head 1, token 37
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(bad);
    auto v = Put(*c, "bad-v", 3, at, bad);
    ASSERT_FALSE(v.ok());
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
    EXPECT_TRUE(absl::StrContains(v.status().message(),
                                  "values: NaN or Inf (or a squared norm beyond float32) at "
                                  "head 1, token 37"))
        << v.status();
    auto k = Put(*c, "bad-k", 3, at, bad, /*bad_in_keys=*/true);
    ASSERT_FALSE(k.ok());
    EXPECT_TRUE(absl::StrContains(k.status().message(),
                                  "keys: NaN or Inf (or a squared norm beyond float32) at "
                                  "head 1, token 37"))
        << k.status();
    EXPECT_EQ(c->Lookup("m", "bad-v").status().code(), absl::StatusCode::kNotFound);
  }
  // The largest finite f16 value is within the stated bound, in keys and values alike.
  EXPECT_TRUE(Put(*c, "extreme-v", 4, at, 65504.0f).ok());
  EXPECT_TRUE(Put(*c, "extreme-k", 4, at, -65504.0f, /*bad_in_keys=*/true).ok());
  EXPECT_TRUE(c->Get("m", "extreme-v").ok());
}

}  // namespace
}  // namespace testing
}  // namespace kvcomp
