// The threads that copy shared-memory payloads (shm_link.h), at both ends: kvcompd's blocks out
// of clients' memory and a direct get split into lanes (ShmAcceptor, ShmGrant), and a client's
// blocks into its put region (ShmChannel). One small pool: at most `threads` threads, made as
// work arrives and none is idle, kept until the pool stops.
//
// Run queues one piece of work; ForEach splits one copy into parts and returns when all ran,
// the calling thread taking parts itself (so a ForEach never waits on a queue that cannot move:
// called from one of the pool's own threads, with every thread busy, or where no thread can be
// made, its caller runs every part). Work queued when the pool stops runs before Stop returns;
// after that, Run and ForEach run on the caller. Where a thread cannot be made, the work waits
// for the threads there are, or runs on the caller when there are none. Thread-safe.
#ifndef KVCOMP_TRANSPORT_SHM_COPY_POOL_H_
#define KVCOMP_TRANSPORT_SHM_COPY_POOL_H_

#include <cstddef>
#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace kvcomp {
namespace transport {

// The name the pool's threads carry (/proc/<pid>/task/<tid>/comm).
inline constexpr char kCopyThreadName[] = "kvcomp-shmcopy";

class CopyPool {
 public:
  // At most `threads` threads (at least 1).
  explicit CopyPool(int threads);
  ~CopyPool();  // Stop()
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  int max_threads() const { return max_threads_; }
  // Threads made so far.
  int threads() const;

  // Runs `work` on one of the pool's threads (on the caller when the pool has stopped or has no
  // thread and cannot make one).
  void Run(absl::AnyInvocable<void() &&> work);
  // Runs fn(0) .. fn(parts - 1), at once on the calling thread and up to parts - 1 of the
  // pool's; returns when every part ran. Each part runs exactly once.
  void ForEach(int parts, absl::FunctionRef<void(int)> fn);
  // Runs what is queued, then joins the threads. Not from one of the pool's threads.
  void Stop();

 private:
  void Loop();

  const int max_threads_;
  mutable absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool start_failed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace transport
}  // namespace kvcomp

#endif  // KVCOMP_TRANSPORT_SHM_COPY_POOL_H_
