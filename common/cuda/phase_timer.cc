#include "common/cuda/phase_timer.h"

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_status.h"

namespace specserve {

PhaseTimer::PhaseTimer(std::vector<std::string> names)
    : names_(std::move(names)), seconds_(names_.size(), 0.0) {}

PhaseTimer::~PhaseTimer() {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
}

absl::Status PhaseTimer::Start(cudaStream_t stream) {
  recorded_ = 0;
  phase_of_.clear();
  return Record(-1, stream);
}

absl::Status PhaseTimer::Mark(int phase, cudaStream_t stream) {
  if (recorded_ == 0) {
    return absl::FailedPreconditionError("PhaseTimer::Mark before Start");
  }
  if (phase < 0 || phase >= static_cast<int>(names_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("PhaseTimer::Mark: phase ", phase, " outside [0, ",
                     names_.size(), ")"));
  }
  return Record(phase, stream);
}

absl::Status PhaseTimer::Record(int phase, cudaStream_t stream) {
  if (recorded_ == static_cast<int>(events_.size())) {
    cudaEvent_t e;
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
    events_.push_back(e);
  }
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[recorded_], stream));
  if (phase >= 0) phase_of_.push_back(phase);
  ++recorded_;
  return absl::OkStatus();
}

absl::Status PhaseTimer::Collect() {
  for (int i = 1; i < recorded_; ++i) {
    float ms = 0.0f;
    SPECSERVE_CUDA_RETURN_IF_ERROR(
        cudaEventElapsedTime(&ms, events_[i - 1], events_[i]));
    seconds_[phase_of_[i - 1]] += 1e-3 * ms;
  }
  if (recorded_ > 0) ++steps_;
  recorded_ = 0;
  phase_of_.clear();
  return absl::OkStatus();
}

std::vector<std::pair<std::string, double>> PhaseTimer::Take(int* steps) {
  std::vector<std::pair<std::string, double>> out;
  for (size_t p = 0; p < names_.size(); ++p) {
    out.emplace_back(names_[p], seconds_[p]);
    seconds_[p] = 0.0;
  }
  if (steps != nullptr) *steps = steps_;
  steps_ = 0;
  return out;
}

}  // namespace specserve
