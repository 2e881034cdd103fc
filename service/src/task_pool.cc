#include "task_pool.h"

#include <algorithm>
#include <utility>

namespace kvcomp {
namespace service {

TaskPool::TaskPool(int threads, size_t capacity, std::function<void(int)> init, double key_share)
    : capacity_(capacity),
      key_capacity_(std::max<size_t>(
          1, static_cast<size_t>(static_cast<double>(capacity) * std::clamp(key_share, 0.0, 1.0)))),
      init_(std::move(init)) {
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

void TaskPool::Push(absl::string_view key, WorkerTask task) {
  Lane& lane = lanes_[key];
  lane.tasks.push_back(std::move(task));
  ++lane.held;
  if (lane.tasks.size() == 1) ready_.emplace_back(key);
  ++queued_;
}

bool TaskPool::TrySubmit(absl::string_view key, absl::AnyInvocable<void()> task) {
  return TrySubmitToWorker(key, [task = std::move(task)](int) mutable { task(); });
}

void TaskPool::Submit(absl::string_view key, absl::AnyInvocable<void()> task) {
  SubmitToWorker(key, [task = std::move(task)](int) mutable { task(); });
}

bool TaskPool::TrySubmitToWorker(absl::string_view key, WorkerTask task) {
  absl::MutexLock lock(&mu_);
  if (stopping_ || queued_ + running_ >= capacity_) return false;
  auto it = lanes_.find(key);
  if (it != lanes_.end() && it->second.held >= key_capacity_) return false;
  Push(key, std::move(task));
  return true;
}

void TaskPool::SubmitToWorker(absl::string_view key, WorkerTask task) {
  absl::MutexLock lock(&mu_);
  Push(key, std::move(task));
}

size_t TaskPool::depth() const {
  absl::MutexLock lock(&mu_);
  return queued_ + running_;
}

bool TaskPool::WaitIdle(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queued_ == 0 && running_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

void TaskPool::Run(int index) {
  if (init_) init_(index);
  while (true) {
    WorkerTask task;
    std::string key;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queued_ > 0 || stopping_; };
      mu_.Await(absl::Condition(&ready));
      if (queued_ == 0) return;  // stopping and drained
      key = std::move(ready_.front());
      ready_.pop_front();
      Lane& lane = lanes_[key];
      task = std::move(lane.tasks.front());
      lane.tasks.pop_front();
      if (!lane.tasks.empty()) ready_.push_back(key);  // its next task waits for the others
      --queued_;
      ++running_;
    }
    task(index);
    task = nullptr;  // whatever it captured goes before the pool counts it done
    absl::MutexLock lock(&mu_);
    --running_;
    auto it = lanes_.find(key);
    if (it != lanes_.end() && --it->second.held == 0 && it->second.tasks.empty()) lanes_.erase(it);
  }
}

}  // namespace service
}  // namespace kvcomp
