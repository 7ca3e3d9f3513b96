#ifndef SPECSERVE_COMMON_UTIL_CLOCK_H_
#define SPECSERVE_COMMON_UTIL_CLOCK_H_

#include <chrono>
#include <cstdint>

namespace specserve {

/// Nanoseconds on the monotonic clock (std::chrono::steady_clock), for
/// measuring durations (phase timings, latencies); not wall-clock time.
inline int64_t MonotonicNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace specserve

#endif  // SPECSERVE_COMMON_UTIL_CLOCK_H_
