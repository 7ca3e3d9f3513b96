#include "common/engine/thread_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <memory>

namespace specserve {
namespace {

// How long an idle worker spins before blocking.
constexpr auto kSpin = std::chrono::microseconds(50);

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  ranges_.resize(std::max(1, num_threads));
  for (int i = 1; i < std::max(1, num_threads); ++i) {
    workers_.emplace_back([this, i] { Loop(i); });
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_.store(true);
  }
  for (auto& t : workers_) t.join();
}

void ThreadPool::Loop(int index) {
  int seen = 0;
  for (;;) {
    // Spin for a while: the next kernel usually follows within microseconds.
    const auto until = std::chrono::steady_clock::now() + kSpin;
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen &&
           !stop_.load(std::memory_order_relaxed)) {
      _mm_pause();
      if (++spins % 64 == 0 && std::chrono::steady_clock::now() > until) {
        absl::MutexLock lock(&mu_);
        struct Arg {
          ThreadPool* pool;
          int seen;
        } arg{this, seen};
        mu_.Await(absl::Condition(
            +[](Arg* a) {
              return a->pool->stop_.load() ||
                     a->pool->generation_.load() != a->seen;
            },
            &arg));
        break;
      }
    }
    if (stop_.load()) return;
    seen = generation_.load(std::memory_order_acquire);
    const auto range = ranges_[index];
    if (range.first < range.second) (*fn_)(range.first, range.second);
    remaining_.fetch_sub(1, std::memory_order_acq_rel);
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
  for (int t = 0; t < threads; ++t) {
    const int b = static_cast<int>(int64_t(units) * t / threads) * grain;
    const int e = static_cast<int>(int64_t(units) * (t + 1) / threads) * grain;
    ranges_[t] = {std::min(b, n), std::min(e, n)};
  }
  fn_ = &fn;
  remaining_.store(threads - 1, std::memory_order_release);
  {
    // Publishing under mu_ wakes any worker blocked in Await.
    absl::MutexLock lock(&mu_);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  if (ranges_[0].first < ranges_[0].second) fn(ranges_[0].first, ranges_[0].second);
  while (remaining_.load(std::memory_order_acquire) != 0) _mm_pause();
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
