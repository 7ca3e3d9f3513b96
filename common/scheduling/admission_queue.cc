#include "common/scheduling/admission_queue.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace specserve {

AdmissionQueue::AdmissionQueue(Options options, Runner run, Observer observer)
    : options_(std::move(options)),
      run_(std::move(run)),
      observer_(std::move(observer)) {}

void AdmissionQueue::NotifyLocked() const {
  // Under the lock, so that gauges see the changes in order.
  if (observer_) observer_(running_, static_cast<int>(waiting_.size()));
}

absl::StatusOr<uint64_t> AdmissionQueue::AdmitOrWait(
    std::function<void()> on_admit) {
  uint64_t ticket = 0;
  {
    absl::MutexLock lock(&mu_);
    if (waiting_.empty() && running_ < options_.max_running) {
      ++running_;
    } else if (static_cast<int>(waiting_.size()) >= options_.max_waiting) {
      return absl::ResourceExhaustedError(
          options_.max_waiting == 0
              ? absl::StrCat(options_.running_flag, " reached: ", running_,
                             " are live")
              : absl::StrCat(options_.running_flag, " reached: ", running_,
                             " are active, and ", waiting_.size(),
                             " requests wait (", options_.waiting_flag, " ",
                             options_.max_waiting, ")"));
    } else {
      ticket = next_ticket_++;
      waiting_.push_back(Waiter{ticket, std::move(on_admit)});
    }
    NotifyLocked();
  }
  return ticket;
}

bool AdmissionQueue::CancelWaiting(uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  auto it = waiting_.begin();
  while (it != waiting_.end() && it->ticket != ticket) ++it;
  if (it == waiting_.end()) return false;
  waiting_.erase(it);
  NotifyLocked();
  return true;
}

void AdmissionQueue::Release() {
  std::vector<std::function<void()>> admitted;
  {
    absl::MutexLock lock(&mu_);
    if (running_ > 0) --running_;
    while (!waiting_.empty() && running_ < options_.max_running) {
      ++running_;
      admitted.push_back(std::move(waiting_.front().on_admit));
      waiting_.pop_front();
    }
    NotifyLocked();
  }
  // Outside the lock: a callback may admit or release again.
  for (auto& f : admitted) {
    if (!f) continue;
    if (run_) {
      run_(std::move(f));
    } else {
      f();
    }
  }
}

int AdmissionQueue::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

int AdmissionQueue::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(waiting_.size());
}

}  // namespace specserve
