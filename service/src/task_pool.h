// A fixed set of threads running closures from a queue. TrySubmit refuses work beyond the
// queue's capacity (the caller answers busy); Submit always queues (internal follow-up work whose
// memory is already bounded elsewhere). Thread-safe.
#ifndef KVCOMP_SERVICE_SRC_TASK_POOL_H_
#define KVCOMP_SERVICE_SRC_TASK_POOL_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvcomp {
namespace service {

class TaskPool {
 public:
  // `init` runs once on each thread before it takes work (e.g. to create a backend); its
  // argument is the thread's index.
  TaskPool(int threads, size_t capacity, std::function<void(int)> init = {});
  ~TaskPool();  // runs what is queued, then joins

  bool TrySubmit(absl::AnyInvocable<void()> task);
  void Submit(absl::AnyInvocable<void()> task);
  // Queued plus running tasks.
  size_t depth() const;
  // Waits until nothing is queued or running, or `timeout` passes; false on timeout.
  bool WaitIdle(absl::Duration timeout) const;
  void Shutdown();  // as the destructor

 private:
  void Run(int index);

  const size_t capacity_;
  std::function<void(int)> init_;
  mutable absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void()>> queue_ ABSL_GUARDED_BY(mu_);
  size_t running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_TASK_POOL_H_
