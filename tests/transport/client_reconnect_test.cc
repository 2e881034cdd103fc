// The client's connection model: every UcxClient of a process with the same UCX settings is an
// endpoint on one shared UCX context and worker, so reconnecting thousands of times creates no
// context or worker (UCX 1.13 aborts a process that created and destroyed a few thousand
// workers while peers failed). Against a real UcxServer on loopback in another process, UCX over
// TCP.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/core/format.h"
#include "kvcomp/transport/client.h"

namespace kvcomp {
namespace transport {
namespace {

// The server runs in a process of its own (transport_test_server): a process with a UCX worker
// of a server and one of clients is exposed to UCX 1.13's cross-worker async bug, which a
// client process (one worker) is not.
class ClientReconnectTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer(); }
  void TearDown() override { StopServer(); }
  void StartServer() {
    int out[2];
    ASSERT_EQ(pipe(out), 0);
    pid_ = fork();
    ASSERT_GE(pid_, 0);
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      execl(KVCOMP_TEST_SERVER, KVCOMP_TEST_SERVER, static_cast<char*>(nullptr));
      _exit(127);
    }
    close(out[1]);
    std::string line;
    char c = 0;
    while (read(out[0], &c, 1) == 1 && c != '\n') line.push_back(c);
    close(out[0]);
    port_ = static_cast<uint16_t>(std::atoi(line.c_str()));
    ASSERT_GT(port_, 0) << "the test server did not start";
  }
  void StopServer() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  static ClientOptions Options() {
    ClientOptions o;
    o.ucx.overrides["TLS"] = "tcp";
    o.request_timeout = absl::Seconds(20);
    return o;
  }
  absl::StatusOr<std::unique_ptr<UcxClient>> Connect(const ClientOptions& o = Options()) {
    return UcxClient::Connect(Endpoint{"127.0.0.1", port_}, "acme", "secret", o);
  }
  // Endpoints still closing finish in the background; wait (bounded) for the count to settle.
  static uint64_t OpenEndpointsSettled(uint64_t want) {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (GetUcxClientStats().endpoints_open != want && absl::Now() < end) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    return GetUcxClientStats().endpoints_open;
  }

  pid_t pid_ = -1;
  uint16_t port_ = 0;
};

// The regression: a client process reconnecting thousands of times. Each cycle connects (hello),
// pings and closes; the process's UCX contexts and workers stay the one made at first.
TEST_F(ClientReconnectTest, ThousandsOfReconnectsReuseOneWorker) {
  {
    auto warm = Connect();
    ASSERT_TRUE(warm.ok()) << warm.status();
    ASSERT_TRUE((*warm)->Ping().ok());
  }
  const UcxClientStats before = GetUcxClientStats();
  ASSERT_GE(before.workers_created, 1u);
  constexpr int kCycles = 2000;
  for (int i = 0; i < kCycles; ++i) {
    auto c = Connect();
    ASSERT_TRUE(c.ok()) << "cycle " << i << ": " << c.status();
    ASSERT_TRUE((*c)->Ping().ok()) << "cycle " << i;
    (*c)->Close();
    EXPECT_EQ((*c)->Ping().code(), absl::StatusCode::kUnavailable);
  }
  const UcxClientStats after = GetUcxClientStats();
  EXPECT_EQ(after.contexts_created, before.contexts_created);
  EXPECT_EQ(after.workers_created, before.workers_created);
  EXPECT_EQ(after.workers_live, before.workers_live);
  EXPECT_EQ(after.endpoints_created, before.endpoints_created + kCycles);
  EXPECT_EQ(OpenEndpointsSettled(before.endpoints_open), before.endpoints_open);
}

// Several connections on the shared worker at once, from several threads: each reply reaches
// the request that asked for it (puts and gets of distinct caches, compared byte for byte).
TEST_F(ClientReconnectTest, ConcurrentConnectionsGetTheirOwnReplies) {
  const uint64_t workers = [&] {
    auto warm = Connect();
    EXPECT_TRUE(warm.ok());
    return GetUcxClientStats().workers_created;
  }();
  constexpr int kThreads = 4, kRounds = 5;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        auto c = Connect();
        if (!c.ok()) {
          ++failures;
          continue;
        }
        const KvLayout layout{2, 2, 2, 64, DType::kBF16};
        const uint64_t tokens = 16;
        std::vector<uint8_t> k(layout.CacheBytes(tokens) / 2), v(k.size());
        for (size_t i = 0; i < k.size(); ++i) {
          k[i] = static_cast<uint8_t>(t * 31 + round * 7 + i);
          v[i] = static_cast<uint8_t>(t * 17 + round * 3 + i * 5);
        }
        wire::PutBegin b;
        b.layout = layout;
        b.num_tokens = tokens;
        b.model_id = "test/model";
        b.key = absl::StrCat("t", t, "r", round);
        auto put = (*c)->PutBegin(b);
        if (!put.ok()) {
          ++failures;
          continue;
        }
        wire::Block blk;
        blk.put_id = *put;
        blk.layer_begin = 0;
        blk.layer_end = layout.num_layers;
        blk.token_end = tokens;
        blk.key_bytes = k.size();
        blk.value_bytes = v.size();
        if (!(*c)->SendBlock(blk, k.data(), v.data()).ok() ||
            !(*c)->PutCommit(*put, 1).ok()) {
          ++failures;
          continue;
        }
        auto got = (*c)->Get("test/model", b.key);
        if (!got.ok()) {
          ++failures;
          continue;
        }
        absl::StatusOr<CompressedCache> cache = format::ParseCache(got->bytes.view());
        if (!cache.ok() || cache->keys != k || cache->values != v) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(GetUcxClientStats().workers_created, workers);
}

// A connection whose server went away fails with Unavailable; the next Connect (to a server that
// is back) is a new endpoint on the same worker.
TEST_F(ClientReconnectTest, ReconnectAfterTheServerWentAwayReusesTheWorker) {
  auto c = Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  const UcxClientStats before = GetUcxClientStats();
  StopServer();
  const absl::Time end = absl::Now() + absl::Seconds(15);
  absl::Status s;
  do {
    s = (*c)->Ping();
  } while (s.ok() && absl::Now() < end);
  EXPECT_TRUE(absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) << s;
  // `c` stays (broken) while the server restarts: a worker some client holds is kept across
  // the fork that starts it.
  StartServer();
  for (int i = 0; i < 20; ++i) {
    auto again = Connect();
    ASSERT_TRUE(again.ok()) << again.status();
    ASSERT_TRUE((*again)->Ping().ok());
  }
  EXPECT_EQ(GetUcxClientStats().workers_created, before.workers_created);
}

// Clients whose UCX settings differ cannot share a context: the second setting gets a worker of
// its own, once.
TEST_F(ClientReconnectTest, OtherSettingsGetOneWorkerOfTheirOwn) {
  auto first = Connect();
  ASSERT_TRUE(first.ok()) << first.status();
  const uint64_t workers = GetUcxClientStats().workers_created;
  ClientOptions other = Options();
  other.poll_spin = absl::Microseconds(50);
  for (int i = 0; i < 5; ++i) {
    auto c = Connect(other);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE((*c)->Ping().ok());
  }
  EXPECT_EQ(GetUcxClientStats().workers_created, workers + 1);
  auto same = Connect();
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(GetUcxClientStats().workers_created, workers + 1);
}

// Callbacks run on the progress thread all clients share: a synchronous call made there is
// refused at once instead of waiting for itself.
TEST_F(ClientReconnectTest, SynchronousCallFromACallbackIsRefused) {
  auto c = Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  wire::PutBegin b;
  b.layout = KvLayout{1, 1, 1, 64, DType::kBF16};
  b.num_tokens = 4;
  b.model_id = "test/model";
  b.key = "from-callback";
  auto put = (*c)->PutBegin(b);
  ASSERT_TRUE(put.ok()) << put.status();
  std::vector<uint8_t> k(b.layout.LayerBytes(4), 1), v(k.size(), 2);
  wire::Block blk;
  blk.put_id = *put;
  blk.layer_end = 1;
  blk.token_end = 4;
  blk.key_bytes = k.size();
  blk.value_bytes = v.size();
  absl::Notification done;
  absl::Status block_status, ping_status;
  UcxClient* client = c->get();
  client->SendBlockAsync(blk, k.data(), v.data(), [&](absl::Status s) {
    block_status = s;
    ping_status = client->Ping();
    done.Notify();
  });
  done.WaitForNotification();
  EXPECT_TRUE(block_status.ok()) << block_status;
  EXPECT_EQ(ping_status.code(), absl::StatusCode::kFailedPrecondition) << ping_status;
  EXPECT_TRUE((*c)->PutCommit(*put, 1).ok());
}

// A child forked while a client is connected cannot use UCX (its async thread is not
// inherited): Connect says so at once instead of waiting for a connection that cannot complete.
TEST_F(ClientReconnectTest, ConnectInAChildForkedWhileConnectedFailsClearly) {
  auto parent = Connect();
  ASSERT_TRUE(parent.ok()) << parent.status();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto c = Connect();
    _exit(!c.ok() && absl::IsFailedPrecondition(c.status()) ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_TRUE((*parent)->Ping().ok());
}

}  // namespace
}  // namespace transport
}  // namespace kvcomp
