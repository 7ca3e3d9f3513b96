#include "common/engine/thread_pool.h"

#include <algorithm>
#include <memory>

namespace specserve {

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < std::max(1, num_threads); ++i) {
    workers_.emplace_back([this, i] { Loop(i); });
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (auto& t : workers_) t.join();
}

void ThreadPool::Loop(int index) {
  int seen = 0;
  for (;;) {
    const std::function<void(int, int)>* fn;
    std::pair<int, int> range;
    {
      absl::MutexLock lock(&mu_);
      struct Arg {
        ThreadPool* pool;
        int seen;
      } arg{this, seen};
      mu_.Await(absl::Condition(
          +[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return a->pool->stop_ || a->pool->generation_ != a->seen;
          },
          &arg));
      if (stop_) return;
      seen = generation_;
      fn = fn_;
      range = ranges_[index];
    }
    if (range.first < range.second) (*fn)(range.first, range.second);
    absl::MutexLock lock(&mu_);
    --remaining_;
  }
}

void ThreadPool::ParallelFor(int n, int grain,
                             const std::function<void(int, int)>& fn) {
  if (n <= 0) return;
  const int threads = num_threads();
  grain = std::max(1, grain);
  if (threads == 1 || n <= grain) {
    fn(0, n);
    return;
  }
  absl::MutexLock call_lock(&call_mu_);
  const int units = (n + grain - 1) / grain;
  std::vector<std::pair<int, int>> ranges(threads);
  for (int t = 0; t < threads; ++t) {
    const int b = static_cast<int>(int64_t(units) * t / threads) * grain;
    const int e = static_cast<int>(int64_t(units) * (t + 1) / threads) * grain;
    ranges[t] = {std::min(b, n), std::min(e, n)};
  }
  {
    absl::MutexLock lock(&mu_);
    fn_ = &fn;
    ranges_ = ranges;
    remaining_ = threads - 1;
    ++generation_;
  }
  if (ranges[0].first < ranges[0].second) fn(ranges[0].first, ranges[0].second);
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* r) { return *r == 0; }, &remaining_));
}

namespace {
absl::Mutex default_mu;
std::unique_ptr<ThreadPool>& DefaultSlot() {
  static auto* slot = new std::unique_ptr<ThreadPool>();
  return *slot;
}
}  // namespace

ThreadPool& ThreadPool::Default() {
  absl::MutexLock lock(&default_mu);
  auto& slot = DefaultSlot();
  if (!slot) slot = std::make_unique<ThreadPool>(2);
  return *slot;
}

void ThreadPool::SetDefaultThreads(int n) {
  absl::MutexLock lock(&default_mu);
  DefaultSlot() = std::make_unique<ThreadPool>(std::max(1, n));
}

}  // namespace specserve
