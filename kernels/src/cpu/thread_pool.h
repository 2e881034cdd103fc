// The CPU backend's worker pool: a fixed set of threads and a blocking ParallelFor. The calling
// thread takes part, so a pool of N threads runs N workers at once with N-1 spawned threads.
//
// Thread-safety: ParallelFor may be called from one thread at a time per pool (a Backend is used
// by one thread); nested calls from inside a task run inline.
#ifndef KVCOMP_KERNELS_SRC_CPU_THREAD_POOL_H_
#define KVCOMP_KERNELS_SRC_CPU_THREAD_POOL_H_

#include <atomic>
#include <cstddef>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvcomp {

class ThreadPool {
 public:
  // `num_threads` workers in all (the caller counts as one); 0 = hardware threads.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Runs fn(i) for every i in [0, n), spread over the workers (dynamic, one index at a time);
  // returns when all are done.
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

 private:
  struct Job {
    const std::function<void(size_t)>* fn = nullptr;
    size_t n = 0;
    std::atomic<size_t> next{0};
    std::atomic<size_t> done{0};
  };
  void WorkerLoop();
  static void RunJob(Job* job);

  const int num_threads_;
  std::vector<std::thread> threads_;
  absl::Mutex mu_;
  Job* job_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int active_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CPU_THREAD_POOL_H_
