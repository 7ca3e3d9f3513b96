#ifndef SPECSERVE_BENCH_BENCH_UTIL_H_
#define SPECSERVE_BENCH_BENCH_UTIL_H_

// Shared helpers for the benchmark programs: timing, synthetic checkpoints
// cached on disk, machine ceilings (sgemm rate, memory bandwidth).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model/weights.h"

namespace specserve {
namespace bench {

/// Monotonic seconds.
double Now();

/// Loads a bundled model ("models/<name>") or a synthetic preset
/// ("synthetic:<preset>", written once under $SPECSERVE_SYNTHETIC_DIR or
/// /tmp/specserve_synthetic with seed 0 and reused).
absl::StatusOr<std::shared_ptr<const ModelWeights>> LoadBenchModel(
    const std::string& spec);

/// sgemm GFLOP/s for C[m,n] = A[m,k] B[n,k]^T, the engine's layout; best of
/// `reps` timed runs after one warm-up.
double SgemmGflops(int m, int n, int k, int reps = 3);

/// STREAM-triad bandwidth in GB/s (a = b + s*c over 3 x `mib` MiB arrays,
/// `threads` threads), best of 3.
double TriadGBps(int threads, int mib = 256);

/// Linear-layer FLOPs of one token through the decoder stack (2 * params of
/// the q/k/v/o and MLP projections), excluding embedding and lm_head.
double LayerFlopsPerToken(const ModelConfig& c);

/// Attention FLOPs (q.k and p.v) of a causal prefill of n tokens.
double AttentionFlops(const ModelConfig& c, int n);

/// Field `key` of /proc/self/status ("VmRSS", "VmHWM") in bytes (the
/// kernel reports kB); 0 if absent.
double ProcStatusBytes(const std::string& key);

/// The OpenBLAS core type in use (openblas_get_corename()).

}  // namespace bench
}  // namespace specserve

#endif  // SPECSERVE_BENCH_BENCH_UTIL_H_
