#include "router/speculator_client.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/service/grpc_util.h"

namespace specserve {

std::string FallbackReason(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
      return "speculator_unavailable";
    case absl::StatusCode::kDeadlineExceeded:
      return "speculator_deadline";
    case absl::StatusCode::kResourceExhausted:
      // At its session or queue limit: load, not a fault.
      return "speculator_busy";
    default:
      return absl::StrCat("speculator_error: ",
                          absl::StatusCodeToString(s.code()));
  }
}

void ReleaseSessionAsync(std::shared_ptr<grpc::Channel> channel,
                         const std::string& id) {
  struct Call {
    std::unique_ptr<v1::Speculator::Stub> stub;
    grpc::ClientContext ctx;
    v1::ReleaseSessionRequest req;
    v1::ReleaseSessionResponse resp;
  };
  auto* call = new Call;
  call->stub = v1::Speculator::NewStub(std::move(channel));
  call->req.set_session_id(id);
  call->ctx.set_deadline(
      absl::ToChronoTime(absl::Now() + kAbandonedCallDeadline));
  call->stub->async()->ReleaseSession(&call->ctx, &call->req, &call->resp,
                                      [call](grpc::Status) { delete call; });
}

ReplicaPool::InfoFn SpeculatorInfoFn() {
  return [](const std::shared_ptr<grpc::Channel>& channel, absl::Time deadline,
            v1::ModelInfo* info) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    return v1::Speculator::NewStub(channel)->Info(&ctx, v1::InfoRequest(),
                                                  info);
  };
}

DraftStream::DraftStream(const std::shared_ptr<grpc::Channel>& channel,
                         absl::Time deadline)
    : stub_(v1::Speculator::NewStub(channel)) {
  ctx_.set_deadline(absl::ToChronoTime(deadline));
  stub_->async()->Draft(&ctx_, this);
  // Round() starts operations from outside the reactions; without a hold
  // a cancel between rounds lets gRPC run OnDone and free the call, and
  // the next StartWrite uses it after free (UBSan, request_runner_test).
  AddHold();
  StartCall();
}

absl::StatusOr<v1::DraftResponse> DraftStream::Round(
    const v1::DraftRequest& req, absl::Duration timeout) {
  {
    absl::MutexLock lock(&mu_);
    if (broken_) return FailureLocked();
    write_pending_ = read_pending_ = true;
  }
  req_ = req;
  StartWrite(&req_);
  StartRead(&resp_);
  absl::MutexLock lock(&mu_);
  auto settled = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return broken_ || (!write_pending_ && !read_pending_);
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&settled), timeout)) {
    broken_ = timed_out_ = true;
    mu_.Unlock();
    ctx_.TryCancel();
    mu_.Lock();
    return absl::DeadlineExceededError("Draft round timed out");
  }
  if (broken_) {
    // No more operations on a broken stream: let OnDone run. The final
    // status follows the failed read/write shortly.
    mu_.Unlock();
    ReleaseHold();
    mu_.Lock();
    mu_.AwaitWithTimeout(absl::Condition(&done_), absl::Seconds(1));
    return FailureLocked();
  }
  return resp_;
}

bool DraftStream::Close(absl::Duration timeout) {
  bool clean;
  {
    absl::MutexLock lock(&mu_);
    clean = !broken_ && !done_;
  }
  if (clean) {
    StartWritesDone();
  } else {
    ctx_.TryCancel();
  }
  ReleaseHold();
  absl::MutexLock lock(&mu_);
  if (!mu_.AwaitWithTimeout(absl::Condition(&done_), timeout)) {
    clean = false;
    mu_.Unlock();
    ctx_.TryCancel();
    mu_.Lock();
    mu_.Await(absl::Condition(&done_));  // guaranteed after a cancel
  }
  return clean && status_.ok();
}

void DraftStream::OnWriteDone(bool ok) {
  absl::MutexLock lock(&mu_);
  write_pending_ = false;
  if (!ok) broken_ = true;
}

void DraftStream::OnReadDone(bool ok) {
  absl::MutexLock lock(&mu_);
  read_pending_ = false;
  if (!ok) broken_ = true;
}

void DraftStream::OnDone(const grpc::Status& s) {
  absl::MutexLock lock(&mu_);
  status_ = s;
  done_ = true;
}

void DraftStream::ReleaseHold() {
  if (hold_released_) return;
  hold_released_ = true;
  RemoveHold();
}

absl::Status DraftStream::FailureLocked() {
  if (timed_out_) return absl::DeadlineExceededError("Draft timed out");
  if (done_ && !status_.ok()) return FromGrpcStatus(status_);
  return absl::UnavailableError("Draft stream broke");
}

std::shared_ptr<ScoreCall> ScoreCall::Start(
    std::shared_ptr<grpc::Channel> channel, const v1::ScoreRequest& req,
    absl::Time deadline) {
  std::shared_ptr<ScoreCall> call(new ScoreCall(std::move(channel)));
  call->req_ = req;
  call->ctx_.set_deadline(absl::ToChronoTime(deadline));
  call->stub_->async()->Score(
      &call->ctx_, &call->req_, &call->resp_,
      [self = call](grpc::Status s) { self->OnDone(std::move(s)); });
  return call;
}

// or DEADLINE_EXCEEDED (then the call is abandoned, see above).
absl::StatusOr<v1::ScoreResponse> ScoreCall::Wait(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  if (!mu_.AwaitWithTimeout(absl::Condition(&done_), timeout)) {
    abandoned_ = true;
    return absl::DeadlineExceededError(
        "Speculator.Score past --speculator_deadline_ms");
  }
  if (!status_.ok()) return FromGrpcStatus(status_);
  return resp_;
}

ScoreCall::ScoreCall(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)), stub_(v1::Speculator::NewStub(channel_)) {}

void ScoreCall::OnDone(grpc::Status s) {
  absl::MutexLock lock(&mu_);
  status_ = std::move(s);
  done_ = true;
  if (abandoned_ && status_.ok() && !resp_.session_id().empty()) {
    ReleaseSessionAsync(channel_, resp_.session_id());
  }
}

}  // namespace specserve
