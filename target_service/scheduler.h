#ifndef SPECSERVE_TARGET_SERVICE_SCHEDULER_H_
#define SPECSERVE_TARGET_SERVICE_SCHEDULER_H_

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/engine/model_runner.h"
#include "common/scheduling/batch_scheduler.h"
#include "common/speculation/target_session.h"

namespace specserve {

/// The target's continuous batching: every stream's round (a prefill, a
/// decode step or a verify round of 1 + k rows) is a BatchedWork of the
/// model's one BatchScheduler, so the rounds of all streams share each
/// forward; prefills go in chunks after the decode and verify rows
/// (common/scheduling/batch_scheduler.h). Thread-safe.
class TargetScheduler {
 public:
  using Options = BatchScheduler::Options;
  using StepStats = BatchScheduler::StepStats;
  /// Runs on the loop thread when a round ends: its result, or the error
  /// that ended it (the session's KV cache is then rolled back to where
  /// the round began).
  using Done = std::function<void(absl::StatusOr<RoundResult>)>;

  /// INVALID_ARGUMENT for a null model or max_num_batched_tokens < 1.
  static absl::StatusOr<std::unique_ptr<TargetScheduler>> Create(
      ModelRunner* model, Options options,
      BatchScheduler::StepObserver on_step = nullptr);

  /// Queues the next round of `session` with `drafts` (a chain, or a tree
  /// when `parents` is not empty: TargetSession::BeginRound). `session` must stay
  /// alive and untouched until `done` has run. Errors of the round
  /// (invalid drafts, a finished session, a forward failure) reach `done`;
  /// Submit itself fails only with UNAVAILABLE once shutting down (then
  /// `done` is not called). Rounds still queued at destruction end with
  /// CANCELLED.
  absl::Status Submit(TargetSession* session, std::vector<DraftToken> drafts,
                      std::vector<int> parents, Done done);

  /// Rounds queued or in flight.
  int num_rounds() const { return scheduler_->num_works(); }

 private:
  explicit TargetScheduler(std::unique_ptr<BatchScheduler> scheduler)
      : scheduler_(std::move(scheduler)) {}
  std::unique_ptr<BatchScheduler> scheduler_;
};

}  // namespace specserve

#endif  // SPECSERVE_TARGET_SERVICE_SCHEDULER_H_
