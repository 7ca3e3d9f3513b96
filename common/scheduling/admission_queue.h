#ifndef SPECSERVE_COMMON_SCHEDULING_ADMISSION_QUEUE_H_
#define SPECSERVE_COMMON_SCHEDULING_ADMISSION_QUEUE_H_

// Request admission in front of a model's BatchScheduler (vLLM's
// max_num_seqs and waiting queue): at most `max_running` requests hold a
// session at once; the next `max_waiting` wait, first come first served;
// the rest get RESOURCE_EXHAUSTED. Both model services use it: the target
// queues Generate streams (max_waiting_requests), the speculator refuses
// sessions past max_sessions (max_waiting 0). Memory is not admission's
// business: the scheduler hands out KV blocks step by step.

#include <cstdint>
#include <deque>
#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace specserve {

/// Thread-safe.
class AdmissionQueue {
 public:
  struct Options {
    int max_running = 64;  ///< admitted at once, >= 1.
    int max_waiting = 0;   ///< queued behind them, >= 0 (0 = refuse).
    /// Names the limits in RESOURCE_EXHAUSTED messages.
    std::string running_flag = "max_sessions";
    std::string waiting_flag = "max_waiting_requests";
  };
  /// Runs an admitted waiter's callback (e.g. on an executor: Release's
  /// caller may hold locks the callback takes).
  using Runner = std::function<void(std::function<void()>)>;
  /// Called after every change with the counts then (for gauges), under
  /// the queue's lock: it must not call back into the queue.
  using Observer = std::function<void(int running, int waiting)>;

  /// `run` null = call the callback inline.
  AdmissionQueue(Options options, Runner run = nullptr,
                 Observer observer = nullptr);

  /// Admits now and returns 0 when fewer than max_running run and nobody
  /// waits (nobody overtakes a waiter); else queues `on_admit` and returns
  /// a ticket > 0 (`on_admit` runs through the Runner once admitted);
  /// RESOURCE_EXHAUSTED naming both limits when max_waiting already wait.
  absl::StatusOr<uint64_t> AdmitOrWait(std::function<void()> on_admit);
  /// Leaves the queue; false if the ticket was already admitted (or never
  /// queued).
  bool CancelWaiting(uint64_t ticket);
  /// Ends one admitted request and admits waiters in order.
  void Release();

  int running() const;
  int waiting() const;
  const Options& options() const { return options_; }

 private:
  struct Waiter {
    uint64_t ticket;
    std::function<void()> on_admit;
  };
  void NotifyLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const Runner run_;
  const Observer observer_;
  mutable absl::Mutex mu_;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<Waiter> waiting_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SCHEDULING_ADMISSION_QUEUE_H_
