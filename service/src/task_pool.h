// A fixed set of threads running closures from per-key queues (a key is a tenant), taken round
// robin across keys so that one key's backlog never delays another key's next task by more than
// one task per thread. TrySubmit refuses work beyond the pool's capacity or beyond one key's
// share of it (the caller answers busy); Submit always queues (internal follow-up work whose
// memory is already bounded elsewhere) but counts towards the key's share. Thread-safe.
#ifndef KVCOMP_SERVICE_SRC_TASK_POOL_H_
#define KVCOMP_SERVICE_SRC_TASK_POOL_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvcomp {
namespace service {

class TaskPool {
 public:
  // `capacity`: queued plus running tasks accepted by TrySubmit. `key_share` in (0, 1]: the
  // share of `capacity` one key may hold (at least one task). `init` runs once on each thread
  // before it takes work (e.g. to create a backend); its argument is the thread's index.
  TaskPool(int threads, size_t capacity, std::function<void(int)> init = {},
           double key_share = 1.0);
  ~TaskPool();  // runs what is queued, then joins

  bool TrySubmit(absl::AnyInvocable<void()> task) { return TrySubmit("", std::move(task)); }
  bool TrySubmit(absl::string_view key, absl::AnyInvocable<void()> task);
  void Submit(absl::AnyInvocable<void()> task) { Submit("", std::move(task)); }
  void Submit(absl::string_view key, absl::AnyInvocable<void()> task);
  // As above, for tasks that take the index of the thread running them (0..threads-1), e.g. to
  // use that thread's backend.
  using WorkerTask = absl::AnyInvocable<void(int worker)>;
  bool TrySubmitToWorker(absl::string_view key, WorkerTask task);
  void SubmitToWorker(absl::string_view key, WorkerTask task);
  // Queued plus running tasks.
  size_t depth() const;
  // Waits until nothing is queued or running, or `timeout` passes; false on timeout.
  bool WaitIdle(absl::Duration timeout) const;
  void Shutdown();  // as the destructor

 private:
  struct Lane {
    std::deque<WorkerTask> tasks;
    size_t held = 0;  // queued plus running
  };
  void Run(int index);
  void Push(absl::string_view key, WorkerTask task)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t capacity_;
  const size_t key_capacity_;
  std::function<void(int)> init_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Lane> lanes_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> ready_ ABSL_GUARDED_BY(mu_);  // keys with queued tasks, in turn
  size_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  size_t running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_TASK_POOL_H_
