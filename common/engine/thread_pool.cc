#include "common/engine/thread_pool.h"

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <memory>

namespace specserve {
namespace {

// How long an idle worker spins before blocking.
constexpr auto kSpin = std::chrono::microseconds(50);
// Chunks per thread: small enough to rebalance, large enough to amortise.
constexpr int kChunksPerThread = 4;

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < std::max(1, num_threads); ++i) {
    workers_.emplace_back([this] { Loop(); });
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_.store(true);
  }
  for (auto& t : workers_) t.join();
}

void ThreadPool::RunChunks(uint32_t generation) {
  for (;;) {
    uint64_t cur = claim_.load(std::memory_order_acquire);
    if (static_cast<uint32_t>(cur >> 32) != generation) return;
    const uint32_t idx = static_cast<uint32_t>(cur & 0xffffffffu);
    if (idx >= static_cast<uint32_t>(num_chunks_.load(std::memory_order_relaxed))) {
      return;  // all claimed, or the job is being set up (idx = ~0u)
    }
    if (!claim_.compare_exchange_weak(cur, cur + 1,
                                      std::memory_order_acq_rel)) {
      continue;
    }
    // The claim succeeded for the live job, whose fields stay put until
    // every chunk has completed.
    const int chunk = chunk_.load(std::memory_order_relaxed);
    const int n = n_.load(std::memory_order_relaxed);
    const int b = static_cast<int>(idx) * chunk;
    (*fn_.load(std::memory_order_relaxed))(b, std::min(n, b + chunk));
    completed_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::Loop() {
  uint32_t seen = 0;
  for (;;) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen &&
           !stop_.load(std::memory_order_relaxed)) {
      _mm_pause();
      if (++spins % 64 == 0 && std::chrono::steady_clock::now() > until) {
        absl::MutexLock lock(&mu_);
        struct Arg {
          ThreadPool* pool;
          uint32_t seen;
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
    RunChunks(seen);
  }
}

void ThreadPool::ParallelFor(int n, int grain,
                             const std::function<void(int, int)>& fn) {
  if (n <= 0) return;
  const int threads = num_threads();
  grain = std::max(1, grain);
  const int units = (n + grain - 1) / grain;
  if (threads == 1 || units < 2) {
    fn(0, n);
    return;
  }
  absl::MutexLock call_lock(&call_mu_);
  const int chunks = std::min(units, threads * kChunksPerThread);
  const int chunk = ((units + chunks - 1) / chunks) * grain;
  const int num_chunks = (n + chunk - 1) / chunk;
  const uint32_t gen = generation_.load(std::memory_order_relaxed) + 1;
  // Close the previous job to late claimers before touching its fields: a
  // worker still holding the old (generation, index) pair fails its CAS.
  claim_.store((static_cast<uint64_t>(gen) << 32) | 0xffffffffu,
               std::memory_order_seq_cst);
  fn_.store(&fn, std::memory_order_relaxed);
  n_.store(n, std::memory_order_relaxed);
  chunk_.store(chunk, std::memory_order_relaxed);
  num_chunks_.store(num_chunks, std::memory_order_relaxed);
  completed_.store(0, std::memory_order_relaxed);
  {
    // Publishing under mu_ wakes any worker blocked in Await.
    absl::MutexLock lock(&mu_);
    claim_.store(static_cast<uint64_t>(gen) << 32, std::memory_order_release);
    generation_.store(gen, std::memory_order_release);
  }
  RunChunks(gen);
  // Only chunks a worker has already claimed can be outstanding here.
  for (int spins = 0;
       completed_.load(std::memory_order_acquire) < num_chunks; ++spins) {
    if (spins < 2000) {
      _mm_pause();
    } else {
      sched_yield();  // the worker holding a chunk may need this core
    }
  }
}

void ThreadPool::Wake() {
  if (workers_.empty()) return;
  absl::MutexLock call_lock(&call_mu_);
  // An empty job: its index is past num_chunks_, so no worker claims
  // anything, but each sees a new generation and restarts its spin.
  const uint32_t gen = generation_.load(std::memory_order_relaxed) + 1;
  claim_.store((static_cast<uint64_t>(gen) << 32) | 0xffffffffu,
               std::memory_order_seq_cst);
  absl::MutexLock lock(&mu_);
  generation_.store(gen, std::memory_order_release);
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
