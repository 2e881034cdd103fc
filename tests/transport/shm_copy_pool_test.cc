// The shared-memory copy threads (CopyPool): threads made as work arrives and no more than
// asked, queued work run before Stop returns, ForEach's parts each run once with the caller
// taking its share, and no wait that cannot end (a ForEach from the pool's own work, a stopped
// pool).
#include "kvcomp/transport/shm_copy_pool.h"

#include <atomic>
#include <chrono>
#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace kvcomp {
namespace transport {
namespace {

TEST(CopyPoolTest, ThreadsAreMadeAsWorkArrivesAndNeverMoreThanAsked) {
  CopyPool pool(3);
  EXPECT_EQ(pool.max_threads(), 3);
  EXPECT_EQ(pool.threads(), 0);  // none before the first piece of work
  absl::Notification go;
  std::atomic<int> started{0}, ran{0};
  absl::Mutex mu;
  std::set<std::thread::id> ids;
  for (int i = 0; i < 10; ++i) {
    pool.Run([&] {
      started++;
      go.WaitForNotification();
      absl::MutexLock lock(&mu);
      ids.insert(std::this_thread::get_id());
      ran++;
    });
  }
  // Three pieces block their threads; the other seven wait in the queue.
  while (started.load() < 3) std::this_thread::yield();
  EXPECT_EQ(pool.threads(), 3);
  EXPECT_EQ(started.load(), 3);
  go.Notify();
  pool.Stop();  // runs the queue first
  EXPECT_EQ(ran.load(), 10);
  EXPECT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids.count(std::this_thread::get_id()), 0u);
}

TEST(CopyPoolTest, AnIdleThreadTakesTheNextPieceInsteadOfANewThread) {
  CopyPool pool(4);
  for (int i = 0; i < 20; ++i) {
    absl::Notification done;
    pool.Run([&] { done.Notify(); });
    done.WaitForNotification();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // back to waiting by now
  }
  // One at a time: an idle thread was there for each later piece (a second one only if a
  // piece arrived before the first went back to waiting).
  EXPECT_LE(pool.threads(), 2);
}

TEST(CopyPoolTest, ForEachRunsEveryPartOnceOnTheCallerAndThePool) {
  CopyPool pool(3);
  for (int parts : {1, 2, 3, 4, 17}) {
    std::vector<std::atomic<int>> count(parts);
    absl::Mutex mu;
    std::set<std::thread::id> ids;
    pool.ForEach(parts, [&](int i) {
      count[i]++;
      // Long enough that helpers get parts too.
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      absl::MutexLock lock(&mu);
      ids.insert(std::this_thread::get_id());
    });
    for (int i = 0; i < parts; ++i) EXPECT_EQ(count[i].load(), 1) << parts << " parts, part " << i;
    EXPECT_LE(ids.size(), static_cast<size_t>(std::min(parts, 4)));
    if (parts >= 4) {
      EXPECT_GE(ids.size(), 2u) << "the pool took none of " << parts << " parts";
    }
  }
  pool.ForEach(0, [](int) { FAIL() << "no part to run"; });
}

TEST(CopyPoolTest, AForEachFromThePoolsOwnWorkEndsWithEveryThreadBusy) {
  // One thread, busy with the work that asks for four parts: the caller runs them all.
  CopyPool pool(1);
  std::atomic<int> parts{0};
  absl::Notification done;
  pool.Run([&] {
    pool.ForEach(4, [&](int) { parts++; });
    done.Notify();
  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(parts.load(), 4);
  EXPECT_EQ(pool.threads(), 1);
}

TEST(CopyPoolTest, AStoppedPoolRunsOnTheCaller) {
  CopyPool pool(2);
  pool.Stop();
  std::thread::id where;
  pool.Run([&] { where = std::this_thread::get_id(); });
  EXPECT_EQ(where, std::this_thread::get_id());
  std::set<std::thread::id> ids;
  pool.ForEach(5, [&](int) { ids.insert(std::this_thread::get_id()); });
  EXPECT_EQ(ids, std::set<std::thread::id>{std::this_thread::get_id()});
  EXPECT_EQ(pool.threads(), 0);
  pool.Stop();  // again: nothing to do
}

TEST(CopyPoolTest, WorkQueuedByWorkRunsBeforeStopReturns) {
  std::atomic<int> ran{0};
  {
    CopyPool pool(2);
    for (int i = 0; i < 8; ++i) {
      pool.Run([&] {
        ran++;
        pool.Run([&] { ran++; });  // queued while the pool runs, or here once it stopped
      });
    }
  }  // the destructor stops it
  EXPECT_EQ(ran.load(), 16);
}

}  // namespace
}  // namespace transport
}  // namespace kvcomp
