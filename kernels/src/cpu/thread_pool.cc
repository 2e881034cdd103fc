#include "thread_pool.h"

#include <algorithm>

namespace kvcomp {
namespace {
// Set while a thread runs a task, so nested ParallelFor calls run inline instead of deadlocking.
thread_local bool in_pool_task = false;
}  // namespace

ThreadPool::ThreadPool(int num_threads)
    : num_threads_(num_threads > 0
                       ? num_threads
                       : std::max(1, static_cast<int>(std::thread::hardware_concurrency()))) {
  threads_.reserve(num_threads_ - 1);
  for (int i = 1; i < num_threads_; ++i) threads_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (auto& t : threads_) t.join();
}

void ThreadPool::RunJob(Job* job) {
  const bool was_in_task = in_pool_task;
  in_pool_task = true;
  for (;;) {
    const size_t i = job->next.fetch_add(1, std::memory_order_relaxed);
    if (i >= job->n) break;
    (*job->fn)(i);
    job->done.fetch_add(1, std::memory_order_release);
  }
  in_pool_task = was_in_task;
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    Job* job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this, &seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || (job_ != nullptr && generation_ != seen);
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      seen = generation_;
      job = job_;
      ++active_;
    }
    RunJob(job);
    absl::MutexLock lock(&mu_);
    --active_;
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (n == 1 || threads_.empty() || in_pool_task) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  Job job;
  job.fn = &fn;
  job.n = n;
  {
    absl::MutexLock lock(&mu_);
    job_ = &job;
    ++generation_;
  }
  RunJob(&job);
  absl::MutexLock lock(&mu_);
  // Retire the job: no new worker may pick it up, and those running it must leave before `job`
  // goes out of scope.
  job_ = nullptr;
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_ == 0; };
  mu_.Await(absl::Condition(&idle));
}

}  // namespace kvcomp
