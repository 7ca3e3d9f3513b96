#ifndef SPECSERVE_COMMON_ENGINE_THREAD_POOL_H_
#define SPECSERVE_COMMON_ENGINE_THREAD_POOL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace specserve {

/// A small persistent pool for the engine's own data-parallel kernels
/// (OpenBLAS has its own threads for GEMMs).
///
/// ParallelFor cuts [0, n) into a few chunks per thread that the caller and
/// the workers claim from one atomic counter, so the caller never waits for
/// a worker that has not started: if the OS has given the other core to
/// another process, the caller simply runs every chunk itself (a fixed
/// per-thread split would stall the whole forward on a descheduled worker).
/// Idle workers spin for ~50 us before sleeping, so the back-to-back small
/// kernels of a decode step rarely pay a futex wake-up. One ParallelFor at
/// a time per pool (concurrent callers are serialised).
class ThreadPool {
 public:
  /// `num_threads` >= 1 including the calling thread.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  /// Runs fn(begin, end) over disjoint ranges covering [0, n) and returns
  /// when all are done. Range boundaries are multiples of `grain`.
  void ParallelFor(int n, int grain, const std::function<void(int, int)>& fn);

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  /// Wakes sleeping workers without giving them work, and returns at once:
  /// they spin (~50 us) waiting for the next ParallelFor. A caller that
  /// knows a ParallelFor is coming calls it first, so the futex wake-up
  /// (tens of microseconds on a virtual machine) overlaps its own work.
  void Wake();

  /// The engine's shared pool; sized by SetEngineThreads (default 2).
  static ThreadPool& Default();
  /// Replaces the default pool with one of `n` threads (n >= 1).
  static void SetDefaultThreads(int n);

 private:
  void Loop();
  // Claims and runs chunks of job `generation` until none are left.
  void RunChunks(uint32_t generation);

  absl::Mutex call_mu_;  // serialises ParallelFor callers
  absl::Mutex mu_;       // sleeping workers wait on generation_ here
  std::atomic<uint32_t> generation_{0};
  // (generation << 32) | next unclaimed chunk: a claim succeeds only for
  // the current job, so a late worker can never run a finished one.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> completed_{0};
  std::atomic<bool> stop_{false};
  // The current job; written before claim_ publishes it.
  std::atomic<const std::function<void(int, int)>*> fn_{nullptr};
  std::atomic<int> n_{0}, chunk_{1}, num_chunks_{0};
  std::vector<std::thread> workers_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_THREAD_POOL_H_
