#include "common/service/executor.h"

namespace specserve {

Executor::Executor(int num_threads) {
  for (int i = 0; i < std::max(1, num_threads); ++i) {
    workers_.emplace_back([this] { Loop(); });
  }
}

Executor::~Executor() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (auto& t : workers_) t.join();
}

void Executor::Submit(std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(fn));
}

size_t Executor::pending() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

void Executor::Loop() {
  for (;;) {
    std::function<void()> fn;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Executor* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(e->mu_) {
            return e->stop_ || !e->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping and drained
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    fn();
  }
}

}  // namespace specserve
