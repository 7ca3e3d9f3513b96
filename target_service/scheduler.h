#ifndef SPECSERVE_TARGET_SERVICE_SCHEDULER_H_
#define SPECSERVE_TARGET_SERVICE_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/engine/model_runner.h"
#include "common/speculation/target_session.h"

namespace specserve {

/// Continuous batching for the target model: iteration-level scheduling
/// (Orca, Yu et al. OSDI 2022) with chunked prefill (Sarathi, Agrawal et
/// al. 2023) in vLLM v1's shape: one loop per model; each step packs a
/// token budget from the rounds in flight, decode and verify rows first
/// (1 + k rows per round, never split), then chunks of pending prefills, so
/// a long prompt never stalls the streaming sessions; one batched
/// ModelRunner::Forward; then each round's rows go back to its session for
/// verification and sampling.
///
/// Rounds run to completion in submission order within each class; a round
/// that needs more rows than are left this step waits for the next one.
/// Thread-safe: Submit from any thread; callbacks run on the loop thread.
class TargetScheduler {
 public:
  struct Options {
    /// Rows (tokens) per batched forward, >= 1 + the largest draft count.
    int max_num_batched_tokens = 2048;
  };
  /// What one step did (the metrics of the serving loop).
  struct StepStats {
    int sequences = 0;        ///< rounds in the forward
    int rows = 0;             ///< rows (tokens) forwarded
    int prefill_rows = 0;     ///< of those, prompt rows
    int64_t forward_ns = 0;   ///< the batched forward's time
  };
  /// Runs on the loop thread when a round ends: its result, or the error
  /// that ended it (the session's KV cache is then rolled back to where
  /// the round began).
  using Done = std::function<void(absl::StatusOr<RoundResult>)>;
  using StepObserver = std::function<void(const StepStats&)>;

  /// INVALID_ARGUMENT for a null model or max_num_batched_tokens < 1.
  static absl::StatusOr<std::unique_ptr<TargetScheduler>> Create(
      ModelRunner* model, Options options,
      StepObserver on_step = nullptr);
  /// Stops the loop; rounds still queued end with CANCELLED.
  ~TargetScheduler();
  TargetScheduler(const TargetScheduler&) = delete;
  TargetScheduler& operator=(const TargetScheduler&) = delete;

  /// Queues the next round of `session` with `drafts`. `session` must stay
  /// alive and untouched until `done` has run. Errors of the round
  /// (invalid drafts, a finished session, a forward failure) reach `done`;
  /// Submit itself fails only with UNAVAILABLE once shutting down (then
  /// `done` is not called).
  absl::Status Submit(TargetSession* session, std::vector<DraftToken> drafts,
                      Done done);

  /// Rounds queued or in flight.
  int num_rounds() const;
  const Options& options() const { return options_; }

 private:
  struct Round {
    TargetSession* session;
    std::vector<DraftToken> drafts;
    Done done;
    bool begun = false;
  };
  TargetScheduler(ModelRunner* model, Options options, StepObserver on_step);
  void Loop();
  // One step over `rounds` (the loop's own list): plans, forwards,
  // completes; finished rounds are removed and their callbacks collected.
  void Step(std::vector<std::unique_ptr<Round>>* rounds,
            std::vector<std::pair<Done, absl::StatusOr<RoundResult>>>* out);

  ModelRunner* const model_;
  const Options options_;
  const StepObserver on_step_;
  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<Round>> incoming_ ABSL_GUARDED_BY(mu_);
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace specserve

#endif  // SPECSERVE_TARGET_SERVICE_SCHEDULER_H_
