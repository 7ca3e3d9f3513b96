#include "target_service/scheduler.h"

#include <utility>

#include "common/scheduling/session_work.h"

namespace specserve {

absl::StatusOr<std::unique_ptr<TargetScheduler>> TargetScheduler::Create(
    ModelRunner* model, Options options,
    BatchScheduler::StepObserver on_step) {
  absl::StatusOr<std::unique_ptr<BatchScheduler>> s =
      BatchScheduler::Create(model, options, std::move(on_step));
  if (!s.ok()) return s.status();
  return std::unique_ptr<TargetScheduler>(
      new TargetScheduler(*std::move(s)));
}

absl::Status TargetScheduler::Submit(TargetSession* session,
                                     std::vector<DraftToken> drafts,
                                     std::vector<int> parents, Done done) {
  // The drafts live in the begin callback until the round begins.
  auto begin = [session, drafts = std::move(drafts),
                parents = std::move(parents)] {
    return session->BeginRound(drafts, parents);
  };
  auto finish = [session, done = std::move(done)](absl::Status status) {
    if (status.ok()) {
      done(session->TakeRoundResult());
    } else {
      done(std::move(status));
    }
  };
  return scheduler_->Submit(std::make_unique<SessionWork>(
      session, std::move(begin), std::move(finish)));
}

}  // namespace specserve
