#ifndef SPECSERVE_COMMON_SERVICE_EXECUTOR_H_
#define SPECSERVE_COMMON_SERVICE_EXECUTOR_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace specserve {

/// A fixed pool of worker threads that runs model work (forwards) off the
/// gRPC callback threads, which must never block. FIFO; Submit never
/// blocks. The destructor drains the queue and joins the workers.
class Executor {
 public:
  /// `num_threads` >= 1 workers.
  explicit Executor(int num_threads);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  /// Queues `fn` to run on a worker.
  void Submit(std::function<void()> fn);
  /// Tasks queued but not yet started.
  size_t pending() const;

 private:
  void Loop();

  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SERVICE_EXECUTOR_H_
