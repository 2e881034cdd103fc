#include "task_pool.h"

#include <utility>

namespace kvcomp {
namespace service {

TaskPool::TaskPool(int threads, size_t capacity, std::function<void(int)> init)
    : capacity_(capacity), init_(std::move(init)) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this, i] { Run(i); });
}

TaskPool::~TaskPool() { Shutdown(); }

void TaskPool::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
  }
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

bool TaskPool::TrySubmit(absl::AnyInvocable<void()> task) {
  absl::MutexLock lock(&mu_);
  if (stopping_ || queue_.size() + running_ >= capacity_) return false;
  queue_.push_back(std::move(task));
  return true;
}

void TaskPool::Submit(absl::AnyInvocable<void()> task) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
}

size_t TaskPool::depth() const {
  absl::MutexLock lock(&mu_);
  return queue_.size() + running_;
}

bool TaskPool::WaitIdle(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto idle = [this]()
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && running_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

void TaskPool::Run(int index) {
  if (init_) init_(index);
  while (true) {
    absl::AnyInvocable<void()> task;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || stopping_; };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    task();
    absl::MutexLock lock(&mu_);
    --running_;
  }
}

}  // namespace service
}  // namespace kvcomp
