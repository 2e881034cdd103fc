// No silent misses, against a real kvcompd on loopback: a client whose control or data address
// names a port that is not a kvcompd control or data port fails with an error naming the address
// and what answered there (an HTTP server, a Thrift service, nothing), instead of finding no
// cache; and a lookup or get against a daemon that is stopped (SIGSTOP) returns within the
// call's deadline (its own ReadOptions::timeout, else the client's lookup_timeout or get_timeout)
// with DeadlineExceeded.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "integration/kvcompd_process.h"
#include "kvcomp/client/client.h"
#include "kvcomp/core/error_detail.h"

namespace kvcomp {
namespace client {
namespace {

using testing::KvcompdProcess;
using testing::TempDir;

constexpr char kModel[] = "test/wrong-port";

class WrongPortTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<KvcompdProcess>(KVCOMPD_PATH, dir_.path() + "/d");
    ASSERT_TRUE(daemon_->Start()) << daemon_->Log();
  }
  void TearDown() override {
    if (daemon_ != nullptr) daemon_->Signal(SIGCONT);
  }
  std::string Addr(int port) const { return absl::StrCat("127.0.0.1:", port); }
  std::unique_ptr<Client> Connect(const std::string& endpoint, ClientOptions o = {}) {
    o.connect_timeout = absl::Seconds(2);
    o.request_timeout = absl::Seconds(10);
    o.ucx_overrides = {{"TLS", "tcp"}};
    auto c = Client::Connect({endpoint}, o, /*connect_now=*/false);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  // A port nothing listens on: bound, then closed.
  static int ClosedPort() {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    close(fd);
    return ntohs(a.sin_port);
  }

  TempDir dir_;
  std::unique_ptr<KvcompdProcess> daemon_;
  const std::vector<std::string> keys_ = {"k0", "k1", "k2"};
};

TEST_F(WrongPortTest, ControlAddressOnTheMetricsPortNamesTheHttpServer) {
  const std::string control = Addr(daemon_->ports().metrics);
  auto c = Connect(daemon_->data_endpoint() + "," + control);
  ASSERT_NE(c, nullptr);
  auto held = c->LookupPrefix(kModel, keys_);
  ASSERT_FALSE(held.ok()) << "answered " << *held;
  EXPECT_EQ(held.status().code(), absl::StatusCode::kFailedPrecondition) << held.status();
  EXPECT_TRUE(absl::StrContains(held.status().message(), control)) << held.status();
  EXPECT_TRUE(absl::StrContains(held.status().message(), "not a kvcompd control port"))
      << held.status();
  EXPECT_TRUE(absl::StrContains(held.status().message(), "HTTP")) << held.status();
  auto chunks = c->GetChunkBytes(kModel, keys_);
  ASSERT_FALSE(chunks.ok());
  EXPECT_EQ(chunks.status().code(), absl::StatusCode::kFailedPrecondition) << chunks.status();
}

TEST_F(WrongPortTest, ControlAddressOnTheDataPortSaysSo) {
  const std::string control = daemon_->data_endpoint();
  auto c = Connect(daemon_->data_endpoint() + "," + control);
  ASSERT_NE(c, nullptr);
  auto held = c->LookupPrefix(kModel, keys_);
  ASSERT_FALSE(held.ok()) << "answered " << *held;
  EXPECT_TRUE(absl::StrContains(held.status().message(), control)) << held.status();
  EXPECT_TRUE(absl::StrContains(held.status().message(), "not a kvcompd control port") ||
              absl::IsDeadlineExceeded(held.status()))
      << held.status();
}

TEST_F(WrongPortTest, ControlAddressWhereNothingListensIsAnErrorNotAMiss) {
  const std::string control = Addr(ClosedPort());
  auto c = Connect(daemon_->data_endpoint() + "," + control);
  ASSERT_NE(c, nullptr);
  auto held = c->LookupPrefix(kModel, keys_);
  ASSERT_FALSE(held.ok()) << "answered " << *held;
  EXPECT_EQ(held.status().code(), absl::StatusCode::kUnavailable) << held.status();
  EXPECT_TRUE(absl::StrContains(held.status().message(), control)) << held.status();
  EXPECT_TRUE(absl::StrContains(held.status().message(), "connection refused")) << held.status();
}

TEST_F(WrongPortTest, DataAddressOnTheControlPortNamesTheThriftService) {
  const std::string data = Addr(daemon_->ports().control);
  auto c = Connect(data);
  ASSERT_NE(c, nullptr);
  auto got = c->GetBytes(kModel, "k0");
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  EXPECT_TRUE(absl::StrContains(got.status().message(), data)) << got.status();
  EXPECT_TRUE(absl::StrContains(got.status().message(), "not a kvcompd data port")) << got.status();
  EXPECT_TRUE(absl::StrContains(got.status().message(), "Thrift")) << got.status();
}

TEST_F(WrongPortTest, DataAddressOnTheMetricsPortNamesTheHttpServer) {
  const std::string data = Addr(daemon_->ports().metrics);
  auto c = Connect(data);
  ASSERT_NE(c, nullptr);
  auto got = c->Lookup(kModel, "k0");
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  EXPECT_TRUE(absl::StrContains(got.status().message(), data)) << got.status();
  EXPECT_TRUE(absl::StrContains(got.status().message(), "HTTP")) << got.status();
  // Said once, not twice ("connect X: connect X: ...").
  EXPECT_FALSE(absl::StrContains(got.status().message(), absl::StrCat(data, ": connect ", data)))
      << got.status();
}

TEST_F(WrongPortTest, LookupAndGetReturnWithinTheirDeadlineWhenTheDaemonIsStopped) {
  ClientOptions o;
  o.lookup_timeout = absl::Milliseconds(300);
  o.get_timeout = absl::Milliseconds(600);
  auto c = Connect(daemon_->client_endpoint(), o);
  ASSERT_NE(c, nullptr);
  auto before = c->LookupPrefix(kModel, keys_);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(*before, 0u);

  daemon_->Signal(SIGSTOP);
  absl::Time t0 = absl::Now();
  auto held = c->LookupPrefix(kModel, keys_);
  const absl::Duration lookup_took = absl::Now() - t0;
  ASSERT_FALSE(held.ok()) << "answered " << *held;
  EXPECT_EQ(held.status().code(), absl::StatusCode::kDeadlineExceeded) << held.status();
  EXPECT_TRUE(absl::StrContains(held.status().message(), "no endpoint answered"))
      << held.status();
  // The deadline, plus scheduling slack on a loaded machine; the request timeout is 10 s.
  EXPECT_LT(lookup_took, absl::Seconds(2)) << lookup_took;

  t0 = absl::Now();
  auto chunks = c->GetChunkBytes(kModel, keys_);
  const absl::Duration get_took = absl::Now() - t0;
  ASSERT_FALSE(chunks.ok());
  EXPECT_EQ(chunks.status().code(), absl::StatusCode::kDeadlineExceeded) << chunks.status();
  EXPECT_LT(get_took, absl::Seconds(3)) << get_took;

  daemon_->Signal(SIGCONT);
  auto after = c->LookupPrefix(kModel, keys_);
  ASSERT_TRUE(after.ok()) << after.status();
}

// The data plane's reads (Get, GetBytes, GetDecoded, GetInto, Lookup) against a stopped daemon:
// each returns within its own deadline (ReadOptions::timeout) with DeadlineExceeded, not after
// the 10 s request timeout nor the client's get_timeout (30 s here); without one, within
// get_timeout; per-call deadlines of the prefix calls replace lookup_timeout / get_timeout. The
// same connection answers again once the daemon runs.
TEST_F(WrongPortTest, EachDataPlaneReadReturnsWithinItsOwnDeadlineWhenTheDaemonIsStopped) {
  ClientOptions o;
  o.get_timeout = absl::Seconds(30);
  o.lookup_timeout = absl::Seconds(30);
  auto c = Connect(daemon_->client_endpoint(), o);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(absl::IsNotFound(c->Lookup(kModel, "k0").status()));  // connected, answering

  daemon_->Signal(SIGSTOP);
  ReadOptions quick;
  quick.timeout = absl::Milliseconds(300);
  std::vector<uint8_t> into(4096);
  const std::vector<std::pair<const char*, std::function<absl::Status()>>> reads = {
      {"Get", [&] { return c->Get(kModel, "k0", quick).status(); }},
      {"GetBytes", [&] { return c->GetBytes(kModel, "k0", quick).status(); }},
      {"GetDecoded", [&] { return c->GetDecoded(kModel, "k0", quick).status(); }},
      {"GetInto",
       [&] { return c->GetInto(kModel, "k0", into.data(), into.size(), false, quick).status(); }},
      {"Lookup", [&] { return c->Lookup(kModel, "k0", quick).status(); }},
      {"LookupPrefix", [&] { return c->LookupPrefix(kModel, keys_, quick).status(); }},
      {"GetChunkBytes", [&] { return c->GetChunkBytes(kModel, keys_, false, quick).status(); }},
  };
  for (const auto& [name, read] : reads) {
    const absl::Time t0 = absl::Now();
    const absl::Status s = read();
    const absl::Duration took = absl::Now() - t0;
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << name << ": " << s;
    if (absl::string_view(name) != "LookupPrefix" && absl::string_view(name) != "GetChunkBytes") {
      // The call's own deadline, typed: the SDK tried nothing more once it passed.
      EXPECT_EQ(DetailOf(s), ErrorDetail::kCallDeadline) << name << ": " << s;
    }
    // The deadline, plus scheduling slack on a loaded machine.
    EXPECT_LT(took, absl::Seconds(2)) << name << " took " << took;
  }
  ReadOptions bad;
  bad.timeout = -absl::Seconds(1);
  EXPECT_TRUE(absl::IsInvalidArgument(c->Get(kModel, "k0", bad).status()));

  daemon_->Signal(SIGCONT);
  EXPECT_TRUE(absl::IsNotFound(c->Get(kModel, "k0", quick).status()));
}

TEST_F(WrongPortTest, AReadWithoutItsOwnDeadlineEndsWithinTheClientsGetTimeout) {
  ClientOptions o;
  o.get_timeout = absl::Milliseconds(500);
  auto c = Connect(daemon_->client_endpoint(), o);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(absl::IsNotFound(c->Lookup(kModel, "k0").status()));
  daemon_->Signal(SIGSTOP);
  for (int i = 0; i < 2; ++i) {
    const absl::Time t0 = absl::Now();
    const absl::Status s = i == 0 ? c->Get(kModel, "k0").status() : c->Lookup(kModel, "k0").status();
    const absl::Duration took = absl::Now() - t0;
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "deadline")) << s;
    EXPECT_EQ(DetailOf(s), ErrorDetail::kCallDeadline) << s;
    EXPECT_LT(took, absl::Seconds(3)) << took;  // the request timeout is 10 s
  }
}

TEST_F(WrongPortTest, DeadlinesMustBePositive) {
  ClientOptions o;
  o.lookup_timeout = absl::ZeroDuration();
  EXPECT_EQ(Client::Connect({daemon_->client_endpoint()}, o, false).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace client
}  // namespace kvcomp
