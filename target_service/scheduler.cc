#include "target_service/scheduler.h"

#include <optional>
#include <utility>

namespace specserve {
namespace {

// One round of one session as scheduler work.
class RoundWork : public BatchedWork {
 public:
  RoundWork(TargetSession* session, std::vector<DraftToken> drafts,
            TargetScheduler::Done done)
      : session_(session), drafts_(std::move(drafts)), done_(std::move(done)) {}

  absl::Status Begin() override { return session_->BeginRound(drafts_); }
  int pending_rows() const override { return session_->pending_rows(); }
  int min_forward_rows() const override {
    return session_->min_forward_rows();
  }
  bool prefilling() const override { return session_->prefilling(); }
  absl::Status PlanForward(int max_rows, SequenceForward* entry) override {
    return session_->PlanForward(max_rows, entry);
  }
  absl::Status CompleteForward(const ForwardOutput& out) override {
    absl::StatusOr<std::optional<RoundResult>> r =
        session_->CompleteForward(out);
    if (!r.ok()) return r.status();
    if (r->has_value()) result_ = **std::move(r);
    return absl::OkStatus();
  }
  void Abort() override { session_->AbortRound(); }
  const KvSequence* sequence() const override {
    return session_->kv_sequence();
  }
  void Finish(absl::Status status) override {
    if (status.ok()) {
      done_(std::move(result_));
    } else {
      done_(std::move(status));
    }
  }

 private:
  TargetSession* const session_;
  const std::vector<DraftToken> drafts_;
  TargetScheduler::Done done_;
  RoundResult result_;
};

}  // namespace

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
                                     Done done) {
  return scheduler_->Submit(
      std::make_unique<RoundWork>(session, std::move(drafts), std::move(done)));
}

}  // namespace specserve
