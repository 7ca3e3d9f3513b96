#ifndef SPECSERVE_COMMON_CUDA_PHASE_TIMER_H_
#define SPECSERVE_COMMON_CUDA_PHASE_TIMER_H_

// Where a forward's GPU time goes, phase by phase (projections, attention,
// the KV gather, element-wise kernels), measured with CUDA events between
// the phases' launches on one stream. For profiling (gpu_bench
// --phase_times), not for serving: each event costs a microsecond or two of
// launch time, and the events of a step are read after it synchronised.

#include <cuda_runtime_api.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace specserve {

/// Accumulates seconds per named phase of work enqueued on one stream.
/// Usage per timed step: Start(stream), Mark(phase, stream) after each
/// phase's launches (the interval since the previous event is that
/// phase's), the stream synchronised, then Collect(). Not thread-safe.
class PhaseTimer {
 public:
  /// `names`: the phases, indexed by Mark's `phase`.
  explicit PhaseTimer(std::vector<std::string> names);
  ~PhaseTimer();
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

  /// Records the step's first event on `stream` (discarding marks of a
  /// step never collected). INTERNAL when an event cannot be created or
  /// recorded.
  absl::Status Start(cudaStream_t stream);
  /// Records an event ending phase `phase` (INVALID_ARGUMENT outside
  /// [0, names.size())); FAILED_PRECONDITION before Start.
  absl::Status Mark(int phase, cudaStream_t stream);
  /// After the stream passed the last mark: adds each interval to its
  /// phase and ends the step. Errors of cudaEventElapsedTime as INTERNAL.
  absl::Status Collect();
  /// Seconds per phase since the last Take, in `names` order, with the
  /// number of steps collected; resets both.
  std::vector<std::pair<std::string, double>> Take(int* steps = nullptr);

 private:
  // Records the next event; `phase` -1 for the step's first.
  absl::Status Record(int phase, cudaStream_t stream);

  const std::vector<std::string> names_;
  std::vector<double> seconds_;
  int steps_ = 0;
  std::vector<cudaEvent_t> events_;  // reused from step to step
  std::vector<int> phase_of_;        // per recorded event after the first
  int recorded_ = 0;                 // events recorded this step
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_PHASE_TIMER_H_
