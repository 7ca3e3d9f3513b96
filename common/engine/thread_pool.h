#ifndef SPECSERVE_COMMON_ENGINE_THREAD_POOL_H_
#define SPECSERVE_COMMON_ENGINE_THREAD_POOL_H_

#include <atomic>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace specserve {

/// A small persistent pool for the engine's own data-parallel kernels
/// (OpenBLAS has its own threads for GEMMs). ParallelFor splits [0, n)
/// into one contiguous range per thread; the caller runs the first range,
/// so a 1-thread pool runs inline. Workers spin briefly (~50 us) after a
/// job before sleeping, so the back-to-back small kernels of a decode step
/// do not pay a futex wake-up each (as ggml's thread pool does). One
/// ParallelFor at a time per pool (concurrent callers are serialised).
class ThreadPool {
 public:
  /// `num_threads` >= 1 including the calling thread.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  /// Runs fn(begin, end) over a partition of [0, n) and returns when all
  /// ranges are done. Range boundaries are multiples of `grain`.
  void ParallelFor(int n, int grain, const std::function<void(int, int)>& fn);

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  /// The engine's shared pool; sized by SetEngineThreads (default 2).
  static ThreadPool& Default();
  /// Replaces the default pool with one of `n` threads (n >= 1).
  static void SetDefaultThreads(int n);

 private:
  void Loop(int index);

  absl::Mutex call_mu_;  // serialises ParallelFor callers
  absl::Mutex mu_;       // sleeping workers wait on generation_ here
  std::atomic<int> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int, int)>* fn_ = nullptr;  // set before a job
  std::vector<std::pair<int, int>> ranges_;             // set before a job
  std::vector<std::thread> workers_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_THREAD_POOL_H_
