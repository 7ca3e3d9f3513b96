#ifndef SPECSERVE_COMMON_SCHEDULING_SESSION_WORK_H_
#define SPECSERVE_COMMON_SCHEDULING_SESSION_WORK_H_

#include <functional>
#include <utility>

#include "absl/status/status.h"
#include "common/scheduling/batch_scheduler.h"
#include "common/scheduling/session.h"

namespace specserve {

/// One operation of one Session as BatchScheduler work, for both services:
/// `begin` starts it (DraftSession::BeginScore / BeginDraft,
/// TargetSession::BeginRound), the forwards in between are the session's
/// own steps, and `finish` takes the result (TakeScoreResult, TakeDrafts,
/// TakeRoundResult) or gets the error that ended it, on the scheduler
/// thread. The session must outlive the work.
class SessionWork : public BatchedWork {
 public:
  SessionWork(Session* session, std::function<absl::Status()> begin,
              std::function<void(absl::Status)> finish)
      : session_(session),
        begin_(std::move(begin)),
        finish_(std::move(finish)) {}

  absl::Status Begin() override { return begin_(); }
  int pending_rows() const override { return session_->pending_rows(); }
  int min_forward_rows() const override {
    return session_->min_forward_rows();
  }
  bool prefilling() const override { return session_->prefilling(); }
  absl::Status PlanForward(int max_rows, SequenceForward* entry) override {
    return session_->PlanForward(max_rows, entry);
  }
  absl::Status CompleteForward(const ForwardOutput& out) override {
    return session_->CompleteForward(out);
  }
  void Abort() override { session_->Abort(); }
  void Finish(absl::Status status) override { finish_(std::move(status)); }
  const KvSequence* sequence() const override {
    return session_->kv_sequence();
  }
  Session* session() const override { return session_; }

 private:
  Session* const session_;
  std::function<absl::Status()> begin_;
  std::function<void(absl::Status)> finish_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SCHEDULING_SESSION_WORK_H_
