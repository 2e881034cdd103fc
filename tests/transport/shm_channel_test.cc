// A client's copies into its shared put region (ShmChannel through the regions) against the
// daemon's real attach socket (ShmAcceptor, in this process) and a stand-in connection that
// records the block frames it is asked to send: with several copy lanes, blocks of mixed sizes
// are copied several at once yet posted in the caller's order, each only once all its bytes are
// in the region; with one lane each block is copied and posted before SendBlock returns, on the
// calling thread.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvcomp/transport/client.h"
#include "kvcomp/transport/shm_copy_pool.h"
#include "kvcomp/transport/shm_link.h"

namespace kvcomp {
namespace transport {
namespace {

// Threads of this process that are shared-memory copy threads.
int CopyThreads() {
  int n = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream in(task.path() / "comm");
    std::string name;
    std::getline(in, name);
    n += name == kCopyThreadName ? 1 : 0;
  }
  return n;
}

// The bytes of block `i` (keys then values).
uint8_t Byte(uint64_t i, uint64_t at) { return static_cast<uint8_t>(i * 131 + at * 7 + (at >> 12)); }

// A connection that records the shared-memory block frames it is asked to send and checks, at
// that moment, that the block's bytes are all in the region the daemon mapped; acknowledges
// each at once.
class RecordingClient : public UcxClient {
 public:
  RecordingClient(wire::HelloOk hello, std::shared_ptr<ShmGrant> grant)
      : hello_(std::move(hello)), grant_(std::move(grant)) {}

  void SendSharedBlockAsync(const wire::Block& block,
                            absl::AnyInvocable<void(absl::Status)> done) override {
    bool intact = false;
    if (std::shared_ptr<ShmMapping> m = grant_->Region(kShmPutRegion); m != nullptr) {
      intact = block.shm_offset + block.payload_bytes() <= m->size();
      const uint64_t i = block.token_begin;
      const uint8_t* p = m->data() + block.shm_offset;
      for (uint64_t at = 0; intact && at < block.payload_bytes(); ++at) {
        intact = p[at] == Byte(i, at);
      }
    }
    {
      absl::MutexLock lock(&mu_);
      order_.push_back(block.token_begin);
      intact_.push_back(intact);
      flags_ok_ = flags_ok_ && block.flags == wire::kBlockSharedMemory;
    }
    done(absl::OkStatus());
  }
  std::vector<uint64_t> order() {
    absl::MutexLock lock(&mu_);
    return order_;
  }
  std::vector<bool> intact() {
    absl::MutexLock lock(&mu_);
    return intact_;
  }
  bool flags_ok() {
    absl::MutexLock lock(&mu_);
    return flags_ok_;
  }

  const wire::HelloOk& server_info() const override { return hello_; }
  bool connected() const override { return true; }
  absl::Status DevicePayloads() const override { return Unused(); }
  bool LocalCudaMemory() const override { return false; }
  absl::StatusOr<uint64_t> PutBegin(const wire::PutBegin&) override { return Unused(); }
  absl::Status SendBlock(const wire::Block&, const void*, const void*, MemoryType) override {
    return Unused();
  }
  void SendBlockAsync(const wire::Block&, const void*, const void*,
                      absl::AnyInvocable<void(absl::Status)> done, MemoryType) override {
    done(Unused());
  }
  absl::StatusOr<wire::CacheSummary> PutCommit(uint64_t, uint64_t) override { return Unused(); }
  absl::Status PutAbort(uint64_t) override { return Unused(); }
  absl::StatusOr<FetchedCache> Get(absl::string_view, absl::string_view,
                                   wire::Representation, absl::Time) override {
    return Unused();
  }
  absl::StatusOr<size_t> GetInto(absl::string_view, absl::string_view, wire::Representation,
                                 void*, size_t, MemoryType, absl::Time) override {
    return Unused();
  }
  absl::StatusOr<wire::CacheSummary> Lookup(absl::string_view, absl::string_view,
                                            absl::Time) override {
    return Unused();
  }
  absl::Status Delete(absl::string_view, absl::string_view) override { return Unused(); }
  absl::Status Ping() override { return Unused(); }
  absl::StatusOr<RawReply> SendRawForTesting(uint64_t, std::string, absl::string_view) override {
    return Unused();
  }
  ShmChannel* SharedMemory() override { return nullptr; }
  void SendLinkBlockAsync(const wire::Block&, std::string,
                          absl::AnyInvocable<void(absl::Status)> done) override {
    done(Unused());
  }
  absl::StatusOr<wire::GetReply> GetOverLink(const wire::Get&, std::string,
                                             absl::Time) override {
    return Unused();
  }
  uint64_t GetSharedAsync(const wire::Get&, void*, size_t, absl::Time,
                          absl::AnyInvocable<void(absl::StatusOr<SharedGet>)> done) override {
    done(Unused());
    return 0;
  }
  void Close() override {}

 private:
  static absl::Status Unused() { return absl::UnimplementedError("not used by this test"); }
  const wire::HelloOk hello_;
  const std::shared_ptr<ShmGrant> grant_;
  absl::Mutex mu_;
  std::vector<uint64_t> order_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> intact_ ABSL_GUARDED_BY(mu_);
  bool flags_ok_ ABSL_GUARDED_BY(mu_) = true;
};

class ShmChannelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto a = ShmAcceptor::Start(uint64_t{1} << 30, [](const std::string&) {});
    ASSERT_TRUE(a.ok()) << a.status();
    acceptor_ = std::move(*a);
    grant_ = acceptor_->Enroll();
    hello_.server_flags = wire::kServerSharedMemory;
    hello_.shm_socket = acceptor_->name();
    hello_.shm_token = grant_->token();
    hello_.shm_max_region_bytes = uint64_t{1} << 30;
  }
  // Block `i` of `bytes` (half keys, half values), its bytes Byte(i, .).
  static std::shared_ptr<std::vector<uint8_t>> Source(uint64_t i, uint64_t bytes) {
    auto v = std::make_shared<std::vector<uint8_t>>(bytes);
    for (uint64_t at = 0; at < bytes; ++at) (*v)[at] = Byte(i, at);
    return v;
  }
  // Sends `sizes.size()` blocks (block i: token_begin i) and waits for all; their sources stay
  // alive until then.
  void SendAll(ShmChannel& channel, const std::vector<uint64_t>& sizes) {
    std::vector<std::shared_ptr<Completion>> done;
    std::vector<std::shared_ptr<std::vector<uint8_t>>> sources;
    for (uint64_t i = 0; i < sizes.size(); ++i) {
      sources.push_back(Source(i, sizes[i]));
      uint8_t* p = sources.back()->data();
      const uint64_t half = sizes[i] / 2;
      wire::Block b;
      b.put_id = 1;
      b.layer_begin = 0;
      b.layer_end = 1;
      b.token_begin = i;
      b.token_end = i + 1;
      b.parts = wire::kPartBoth;
      b.key_bytes = half;
      b.value_bytes = sizes[i] - half;
      auto posted = channel.SendBlock(b, {p, half, MemoryKind::kHost},
                                      {p + half, sizes[i] - half, MemoryKind::kHost},
                                      absl::Now() + absl::Seconds(30));
      ASSERT_TRUE(posted.ok()) << posted.status();
      done.push_back(*posted);
    }
    for (auto& d : done) EXPECT_TRUE(d->Wait(absl::Now() + absl::Seconds(30)).ok());
  }

  std::unique_ptr<ShmAcceptor> acceptor_;
  std::shared_ptr<ShmGrant> grant_;
  wire::HelloOk hello_;
};

TEST_F(ShmChannelTest, BlocksCopiedSeveralAtOnceArePostedInOrderEachWhenComplete) {
  RecordingClient client(hello_, grant_);
  ShmChannelOptions o;
  o.direct = false;
  o.put_region_bytes = 8 << 20;  // the ring wraps several times
  o.copy_lanes = 3;
  // Large blocks (split over the lanes) followed by small ones (one range, done first).
  std::vector<uint64_t> sizes;
  for (int i = 0; i < 48; ++i) {
    sizes.push_back(i % 3 == 0 ? (uint64_t{3} << 20) + 4096 * i : 4096 + 100 * i);
  }
  uint64_t large = 0;
  for (uint64_t s : sizes) large += s >= 2 * kShmMinClientLaneBytes ? 1 : 0;
  {
    ShmChannel channel(&client, o);
    EXPECT_EQ(channel.copy_lanes(), 3);
    SendAll(channel, sizes);
    const ShmChannel::Stats st = channel.stats();
    EXPECT_EQ(st.blocks_copied, sizes.size());
    EXPECT_EQ(st.blocks_split, large);
    EXPECT_GE(CopyThreads(), 1);
    EXPECT_LE(CopyThreads(), 3);
  }
  EXPECT_EQ(CopyThreads(), 0);  // joined with the channel
  std::vector<uint64_t> want(sizes.size());
  for (uint64_t i = 0; i < want.size(); ++i) want[i] = i;
  EXPECT_EQ(client.order(), want);
  EXPECT_EQ(client.intact(), std::vector<bool>(sizes.size(), true));
  EXPECT_TRUE(client.flags_ok());
}

TEST_F(ShmChannelTest, WithOneLaneABlockIsPostedBeforeSendBlockReturns) {
  RecordingClient client(hello_, grant_);
  ShmChannelOptions o;
  o.direct = false;
  o.put_region_bytes = 8 << 20;
  o.copy_lanes = 1;
  ShmChannel channel(&client, o);
  EXPECT_EQ(channel.copy_lanes(), 1);
  for (uint64_t i = 0; i < 6; ++i) {
    auto src = Source(i, uint64_t{2} << 20);
    const uint64_t half = src->size() / 2;
    wire::Block b;
    b.put_id = 1;
    b.layer_end = 1;
    b.token_begin = i;
    b.token_end = i + 1;
    b.parts = wire::kPartBoth;
    b.key_bytes = b.value_bytes = half;
    auto posted = channel.SendBlock(b, {src->data(), half, MemoryKind::kHost},
                                    {src->data() + half, half, MemoryKind::kHost},
                                    absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(posted.ok()) << posted.status();
    src.reset();  // the caller's memory may go at once: the copy is done
    EXPECT_EQ(client.order().size(), i + 1);
    EXPECT_TRUE((*posted)->Wait(absl::Now() + absl::Seconds(30)).ok());
  }
  EXPECT_EQ(client.intact(), std::vector<bool>(6, true));
  EXPECT_EQ(channel.stats().blocks_split, 0u);
  EXPECT_EQ(CopyThreads(), 0);
}

}  // namespace
}  // namespace transport
}  // namespace kvcomp
