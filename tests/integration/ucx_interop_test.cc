// A client and kvcompd on different UCX releases work together with no UCX_ variable set: the
// daemon (data_plane.ucx_interop auto) says its release in hello-ok, and the client applies what
// that pair of releases needs (kvcomp/transport/ucx.h, UcxInteropSettings; docs/protocol.md, "UCX
// releases"). Clients and daemons of this and of earlier kvcomp releases on one UCX release
// before 1.14 work together whichever side was upgraded first.
//
// make test builds this test against UCX 1.22 (NVIDIA's libucx-cu13 wheel, scripts/run_tests.sh)
// and runs its first test against the main build's kvcompd on the system's UCX (Debian 12:
// 1.13.1), with KVCOMP_EXPECT_DAEMON_UCX=1.13 so that it fails if the two were not on those
// releases. The main build's ctest runs all of them against its own kvcompd (one release on both
// sides).
//
// KVCOMP_KVCOMPD: the kvcompd to start. Every UCX_ variable is removed from the environment
// first (the client's and so the daemon's): the pair must work on the defaults.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "block_put.h"
#include "gtest/gtest.h"
#include "kvcomp/transport/client.h"
#include "kvcomp/transport/protocol.h"
#include "kvcomp/transport/shm_link.h"
#include "kvcomp/transport/ucx.h"
#include "kvcompd_process.h"

extern char** environ;

namespace kvcomp {
namespace testing {
namespace {

namespace wire = transport::wire;

void RemoveUcxVariables() {
  std::vector<std::string> names;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    if (absl::StartsWith(entry, "UCX_")) names.push_back(entry.substr(0, entry.find('=')));
  }
  for (const std::string& n : names) unsetenv(n.c_str());
}

class UcxInteropTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* daemon = std::getenv("KVCOMP_KVCOMPD");
    ASSERT_NE(daemon, nullptr) << "set KVCOMP_KVCOMPD to the kvcompd to test against";
    binary_ = daemon;
    RemoveUcxVariables();
    char tmpl[] = "/tmp/kvcomp-ucx-interop.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  // Starts kvcompd with `flags`; `env` ("UCX_...=value") for the daemon only.
  void StartDaemon(std::vector<std::string> flags, std::vector<std::string> env = {}) {
    daemon_ = std::make_unique<KvcompdProcess>(binary_, dir_ + "/data", std::move(flags));
    for (std::string& e : env) daemon_->SetEnv(std::move(e));
    ASSERT_TRUE(daemon_->Start()) << daemon_->Log();
  }
  void TearDown() override {
    daemon_.reset();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  // A client on UCX's defaults (plus `overrides`); `shared_memory` false keeps every payload on
  // UCX.
  std::unique_ptr<transport::UcxClient> Connect(
      bool shared_memory, std::map<std::string, std::string> overrides = {}) {
    transport::ClientOptions o;
    o.shared_memory = shared_memory;
    o.ucx.overrides = std::move(overrides);
    auto c = transport::UcxClient::Connect(
        *transport::Endpoint::Parse(daemon_->data_endpoint()), "", "", o);
    EXPECT_TRUE(c.ok()) << c.status() << "\n" << daemon_->Log();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // Blocks of 4 MiB of keys and 4 MiB of values: UCX sends them (and the get's reply) by
  // rendezvous, the protocol that needs the pair's settings.
  wire::PutBegin Begin(const std::string& key) const {
    wire::PutBegin b = MakePutBegin(KvLayout{2, 4, 4, 128, DType::kF16}, 4096, "m", key);
    b.has_policy = true;
    b.policy.ratio = 0;  // lossless: the stored bytes follow from the input alone
    b.policy.moments = false;
    return b;
  }

  // Put over UCX, then lookups and the stored cache back over UCX: each must pass.
  void PutGetLookup(transport::UcxClient& c, const std::string& key) {
    absl::StatusOr<wire::CacheSummary> put = PutRandomF16(c, Begin(key), 11);
    ASSERT_TRUE(put.ok()) << put.status() << "\n" << daemon_->Log();
    absl::StatusOr<wire::CacheSummary> look = c.Lookup("m", key);
    ASSERT_TRUE(look.ok()) << look.status();
    EXPECT_EQ(look->stored_bytes, put->stored_bytes);
    EXPECT_TRUE(absl::IsNotFound(c.Lookup("m", "absent").status()));
    absl::StatusOr<transport::FetchedCache> got = c.Get("m", key);
    ASSERT_TRUE(got.ok()) << got.status() << "\n" << daemon_->Log();
    EXPECT_EQ(got->bytes.size(), put->stored_bytes);
  }

  std::string binary_;
  std::string dir_;
  std::unique_ptr<KvcompdProcess> daemon_;
};

bool Before114(transport::UcxVersion v) { return v.major == 1 && v.minor < 14; }

// kvcompd with data_plane.ucx_interop auto: a client on any UCX release connects (one on the
// daemon's release before 1.14 after the daemon's hello timeout, 1 s here: the test below).
TEST_F(UcxInteropTest, PutGetAndLookupPassOnTheDefaults) {
  StartDaemon({"--data_plane.ucx_interop=auto", "--data_plane.hello_timeout_seconds=1"});
  const transport::UcxVersion local = transport::LocalUcxVersion();
  std::unique_ptr<transport::UcxClient> ucx = Connect(/*shared_memory=*/false);
  ASSERT_NE(ucx, nullptr);
  const wire::HelloOk& hello = ucx->server_info();
  const transport::UcxVersion daemon{hello.ucx_major, hello.ucx_minor, hello.ucx_release};
  std::printf("client on UCX %s, kvcompd on UCX %s\n", local.ToString().c_str(),
              daemon.ToString().c_str());
  ASSERT_TRUE(daemon.known()) << "the daemon did not say its UCX release";
  if (const char* want = std::getenv("KVCOMP_EXPECT_DAEMON_UCX"); want != nullptr) {
    EXPECT_TRUE(absl::StartsWith(daemon.ToString(), std::string(want) + "."))
        << "kvcompd is on UCX " << daemon.ToString() << ", expected " << want;
    EXPECT_FALSE(absl::StartsWith(local.ToString(), std::string(want) + "."))
        << "the client is on the daemon's UCX release; the test needs another";
  }

  // Put over UCX (rendezvous), then get the stored and the decoded cache back over UCX.
  absl::StatusOr<wire::CacheSummary> put = PutRandomF16(*ucx, Begin("a"), 7);
  ASSERT_TRUE(put.ok()) << put.status() << "\n" << daemon_->Log();
  EXPECT_EQ(put->original_bytes, uint64_t{2} * 2 * 4 * 4096 * 128 * 2);
  absl::StatusOr<wire::CacheSummary> look = ucx->Lookup("m", "a");
  ASSERT_TRUE(look.ok()) << look.status();
  EXPECT_EQ(look->stored_bytes, put->stored_bytes);
  EXPECT_TRUE(absl::IsNotFound(ucx->Lookup("m", "absent").status()));
  absl::StatusOr<transport::FetchedCache> got = ucx->Get("m", "a");
  ASSERT_TRUE(got.ok()) << got.status() << "\n" << daemon_->Log();
  ASSERT_EQ(got->bytes.size(), put->stored_bytes);
  absl::StatusOr<transport::FetchedCache> decoded =
      ucx->Get("m", "a", wire::Representation::kDecoded);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_GE(decoded->bytes.size(), put->original_bytes);
  std::vector<char> into(got->bytes.size());
  absl::StatusOr<size_t> n = ucx->GetInto("m", "a", wire::Representation::kStored, into.data(),
                                          into.size());
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(absl::string_view(into.data(), *n), got->bytes.view());

  // The same data put by a second client (same-host shared memory where the daemon offers it):
  // the daemon stored the same bytes, and a get through that client returns them too.
  std::unique_ptr<transport::UcxClient> shm = Connect(/*shared_memory=*/true);
  ASSERT_NE(shm, nullptr);
  absl::StatusOr<wire::CacheSummary> again = PutRandomF16(*shm, Begin("b"), 7);
  ASSERT_TRUE(again.ok()) << again.status();
  absl::StatusOr<transport::FetchedCache> b = ucx->Get("m", "b");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->bytes.view(), got->bytes.view());
  absl::StatusOr<transport::FetchedCache> b2 = shm->Get("m", "b");
  ASSERT_TRUE(b2.ok()) << b2.status();
  EXPECT_EQ(b2->bytes.view(), got->bytes.view());
  EXPECT_TRUE(absl::IsNotFound(shm->Get("m", "absent").status()));

  // A reconnect applies what the pair needs from the start (one connection, no refusal first).
  const transport::UcxClientStats before = transport::GetUcxClientStats();
  std::unique_ptr<transport::UcxClient> third = Connect(/*shared_memory=*/false);
  ASSERT_NE(third, nullptr);
  EXPECT_EQ(transport::GetUcxClientStats().endpoints_created, before.endpoints_created + 1);
  absl::StatusOr<transport::FetchedCache> c = third->Get("m", "a");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->bytes.view(), got->bytes.view());
}

// The tests below need a client on the daemon's UCX release before 1.14 (the main build's
// ctest); scripts/run_tests.sh runs only the test above with the client on UCX 1.22.

// kvcompd on its default (ucx_interop defaults, UCX's defaults): a client of an earlier kvcomp release
// on the same UCX (UCX's default CM_USE_ALL_DEVICES=y, forced here) connects and works, and so
// does a client of this release, on its first connection request.
TEST_F(UcxInteropTest, EarlierReleaseClientsConnectToTheDefault) {
  const transport::UcxVersion local = transport::LocalUcxVersion();
  if (!Before114(local)) GTEST_SKIP() << "needs a client on UCX before 1.14";
  StartDaemon({});
  EXPECT_TRUE(absl::StrContains(daemon_->Log(), "ucx_interop defaults")) << daemon_->Log();
  std::unique_ptr<transport::UcxClient> earlier =
      Connect(/*shared_memory=*/false, {{"CM_USE_ALL_DEVICES", "y"}});
  ASSERT_NE(earlier, nullptr);
  PutGetLookup(*earlier, "earlier");
  const transport::UcxClientStats before = transport::GetUcxClientStats();
  std::unique_ptr<transport::UcxClient> now = Connect(/*shared_memory=*/false);
  ASSERT_NE(now, nullptr);
  EXPECT_EQ(transport::GetUcxClientStats().endpoints_created, before.endpoints_created + 1);
  absl::StatusOr<transport::FetchedCache> got = now->Get("m", "earlier");
  ASSERT_TRUE(got.ok()) << got.status();
  PutGetLookup(*now, "now");
}

// An earlier kvcompd on the same UCX (UCX's defaults, simulated by UCX_CM_USE_ALL_DEVICES=y in
// its environment, over ucx_interop auto): a client of this release connects on its first
// request and works.
TEST_F(UcxInteropTest, ClientConnectsToAnEarlierDaemon) {
  const transport::UcxVersion local = transport::LocalUcxVersion();
  if (!Before114(local)) GTEST_SKIP() << "needs a client on UCX before 1.14";
  StartDaemon({"--data_plane.ucx_interop=auto"}, {"UCX_CM_USE_ALL_DEVICES=y"});
  EXPECT_TRUE(absl::StrContains(daemon_->Log(), "UCX_CM_USE_ALL_DEVICES=y as set"))
      << daemon_->Log();
  const transport::UcxClientStats before = transport::GetUcxClientStats();
  std::unique_ptr<transport::UcxClient> c = Connect(/*shared_memory=*/true);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(transport::GetUcxClientStats().endpoints_created, before.endpoints_created + 1);
  PutGetLookup(*c, "a");
}

// kvcompd with ucx_interop auto (UCX_CM_USE_ALL_DEVICES=n) on the client's release: the client's
// first request (UCX's defaults) is never answered and the daemon closes it at its hello
// timeout; the client connects again with CM_USE_ALL_DEVICES=n and works, and a reconnect to
// the same endpoint uses that at once. A client that insists on UCX's default (an earlier
// kvcomp release) is shut out, with an error.
TEST_F(UcxInteropTest, ClientFallsBackToOneDeviceAgainstAnInteropDaemon) {
  const transport::UcxVersion local = transport::LocalUcxVersion();
  if (!Before114(local)) GTEST_SKIP() << "needs a client on UCX before 1.14";
  StartDaemon({"--data_plane.ucx_interop=auto", "--data_plane.hello_timeout_seconds=0.5"});
  EXPECT_TRUE(absl::StrContains(daemon_->Log(), "ucx_interop auto: UCX_CM_USE_ALL_DEVICES=n"))
      << daemon_->Log();
  transport::UcxClientStats before = transport::GetUcxClientStats();
  absl::Time start = absl::Now();
  std::unique_ptr<transport::UcxClient> c = Connect(/*shared_memory=*/false);
  ASSERT_NE(c, nullptr);
  std::printf("connected through the fallback in %.2f s (daemon hello timeout 0.5 s)\n",
              absl::ToDoubleSeconds(absl::Now() - start));
  EXPECT_EQ(transport::GetUcxClientStats().endpoints_created, before.endpoints_created + 2);
  PutGetLookup(*c, "a");

  before = transport::GetUcxClientStats();
  start = absl::Now();
  std::unique_ptr<transport::UcxClient> again = Connect(/*shared_memory=*/true);
  ASSERT_NE(again, nullptr);
  std::printf("reconnected in %.3f s\n", absl::ToDoubleSeconds(absl::Now() - start));
  EXPECT_EQ(transport::GetUcxClientStats().endpoints_created, before.endpoints_created + 1);
  PutGetLookup(*again, "b");

  transport::ClientOptions o;
  o.ucx.overrides["CM_USE_ALL_DEVICES"] = "y";
  auto earlier = transport::UcxClient::Connect(
      *transport::Endpoint::Parse(daemon_->data_endpoint()), "", "", o);
  ASSERT_FALSE(earlier.ok());
  EXPECT_TRUE(absl::IsUnavailable(earlier.status()) ||
              absl::IsDeadlineExceeded(earlier.status()))
      << earlier.status();
}

// A connection that fails before its hello in any other way than a daemon's close at its hello
// timeout is not tried again with CM_USE_ALL_DEVICES=n (against a daemon on UCX's defaults that
// would make UCX 1.13 abort the client): here a listener that resets every connection at once,
// five connects (UCX reports such a reset before or after the hello is queued, by chance).
TEST_F(UcxInteropTest, AConnectionResetAtOnceIsNotTriedAgainWithOneDevice) {
  const transport::UcxVersion local = transport::LocalUcxVersion();
  if (!Before114(local)) GTEST_SKIP() << "needs a client on UCX before 1.14";
  const int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(ls, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(ls, 16), 0);
  socklen_t len = sizeof(a);
  ASSERT_EQ(getsockname(ls, reinterpret_cast<sockaddr*>(&a), &len), 0);
  std::atomic<bool> stop{false};
  std::atomic<int> reset{0};
  std::thread resetter([&] {
    while (!stop.load()) {
      pollfd p = {ls, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      const int c = accept(ls, nullptr, nullptr);
      if (c < 0) continue;
      const linger l = {1, 0};  // closed with a reset
      setsockopt(c, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
      close(c);
      reset++;
    }
  });
  transport::ClientOptions o;
  o.shared_memory = false;
  o.connect_timeout = absl::Seconds(2);
  for (int i = 0; i < 5; ++i) {
    const transport::UcxClientStats before = transport::GetUcxClientStats();
    auto c = transport::UcxClient::Connect(
        *transport::Endpoint::Parse(absl::StrCat("127.0.0.1:", ntohs(a.sin_port))), "", "", o);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(transport::GetUcxClientStats().endpoints_created, before.endpoints_created + 1)
        << "connect " << i << ": " << c.status();
  }
  stop = true;
  resetter.join();
  close(ls);
  EXPECT_GE(reset.load(), 5);
}

// A client that fell back to CM_USE_ALL_DEVICES=n for a kvcompd with ucx_interop auto loses its
// connection when that daemon exits, and forgets the setting: a kvcompd started on the same
// ports with ucx_interop defaults (y) is met on UCX's defaults, on the first request. (Meeting a
// daemon on y with n makes UCX 1.13 abort the client's process.)
TEST_F(UcxInteropTest, ClientForgetsOneDeviceWhenItsConnectionIsLost) {
  const transport::UcxVersion local = transport::LocalUcxVersion();
  if (!Before114(local)) GTEST_SKIP() << "needs a client on UCX before 1.14";
  const std::vector<std::string> ports = {absl::StrCat("--data_plane.port=", FreeLoopbackPort()),
                                          absl::StrCat("--control_plane.port=", FreeLoopbackPort()),
                                          absl::StrCat("--metrics.port=", FreeLoopbackPort())};
  std::vector<std::string> flags = ports;
  flags.push_back("--data_plane.ucx_interop=auto");
  flags.push_back("--data_plane.hello_timeout_seconds=0.5");
  StartDaemon(flags);
  std::unique_ptr<transport::UcxClient> c = Connect(/*shared_memory=*/false);
  ASSERT_NE(c, nullptr);
  PutGetLookup(*c, "a");
  daemon_->Kill(SIGKILL);
  // The client sees the connection go.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (c->Lookup("m", "a").ok() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_FALSE(c->Lookup("m", "a").ok());
  c.reset();

  StartDaemon(ports);
  EXPECT_TRUE(absl::StrContains(daemon_->Log(), "ucx_interop defaults")) << daemon_->Log();
  const transport::UcxClientStats before = transport::GetUcxClientStats();
  std::unique_ptr<transport::UcxClient> again = Connect(/*shared_memory=*/false);
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(transport::GetUcxClientStats().endpoints_created, before.endpoints_created + 1);
  absl::StatusOr<transport::FetchedCache> got = again->Get("m", "a");  // the same data dir
  EXPECT_TRUE(got.ok()) << got.status();
  PutGetLookup(*again, "b");
}

}  // namespace
}  // namespace testing
}  // namespace kvcomp
