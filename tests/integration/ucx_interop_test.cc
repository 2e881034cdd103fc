// A client and kvcompd on different UCX releases work together with no UCX_ variable set: the
// daemon says its release in hello-ok, and the client applies what that pair of releases needs
// (kvcomp/transport/ucx.h, UcxInteropSettings; docs/protocol.md, "UCX releases").
//
// make test builds this test against UCX 1.22 (NVIDIA's libucx-cu13 wheel, scripts/run_tests.sh)
// and runs it against the main build's kvcompd on the system's UCX (Debian 12: 1.13.1), with
// KVCOMP_EXPECT_DAEMON_UCX=1.13 so that it fails if the two were not on those releases. The main
// build's ctest runs it against its own kvcompd (one release on both sides).
//
// KVCOMP_KVCOMPD: the kvcompd to start. Every UCX_ variable is removed from the environment
// first (the client's and so the daemon's): the pair must work on the defaults.
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
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
    RemoveUcxVariables();
    char tmpl[] = "/tmp/kvcomp-ucx-interop.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    daemon_ = std::make_unique<KvcompdProcess>(daemon, dir_ + "/data");
    ASSERT_TRUE(daemon_->Start()) << daemon_->Log();
  }
  void TearDown() override {
    daemon_.reset();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  // A client on UCX's defaults; `shared_memory` false keeps every payload on UCX.
  std::unique_ptr<transport::UcxClient> Connect(bool shared_memory) {
    transport::ClientOptions o;
    o.shared_memory = shared_memory;
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

  std::string dir_;
  std::unique_ptr<KvcompdProcess> daemon_;
};

TEST_F(UcxInteropTest, PutGetAndLookupPassOnTheDefaults) {
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

}  // namespace
}  // namespace testing
}  // namespace kvcomp
