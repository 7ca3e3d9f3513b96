#ifndef SPECSERVE_COMMON_MODEL_SYNTHETIC_H_
#define SPECSERVE_COMMON_MODEL_SYNTHETIC_H_

// Synthetic random-weight checkpoints with the shapes of real Llama models,
// for speed measurements at realistic sizes (speed does not depend on weight
// values; real larger checkpoints cannot be downloaded here). See
// models/README.md and docs REFERENCE.md section 5.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model/config.h"
#include "common/model/safetensors.h"

namespace specserve {

/// The preset names: "llama2-15m", "llama2-110m" (llama2.c TinyStories
/// shapes, Llama-2 vocab), "llama-3.2-1b", "llama-3.1-8b" (Meta's shapes,
/// without their llama3 rope_scaling, which the engine does not support).
/// All are tied except llama-3.1-8b.
std::vector<std::string> PresetNames();

/// The config of preset `name`. NOT_FOUND listing the known names otherwise.
absl::StatusOr<ModelConfig> PresetConfig(const std::string& name);

/// Parameters of a Llama model with `config`: embeddings, per-layer
/// projections and norms, final norm, and lm_head unless tied.
int64_t CountParameters(const ModelConfig& config);

/// Writes `dir`/config.json and `dir`/model.safetensors (creating `dir`) for
/// preset `preset`, with weights drawn from N(0, 0.02^2) (approximated by a
/// scaled sum of four uniforms, so |w| < 0.07) from a counter-based
/// SplitMix64 stream per tensor seeded by `seed`: the same seed gives the
/// same bytes. RMSNorm weights are 1. `dtype` is the stored type: "F32",
/// "BF16" or "F16". Streams to disk (memory use is O(1 MB) whatever the
/// size). Errors: NOT_FOUND for an unknown preset, INVALID_ARGUMENT for an
/// unknown dtype, INTERNAL naming the path on I/O failure.
absl::Status WriteSyntheticCheckpoint(const std::string& preset,
                                      const std::string& dir, uint64_t seed,
                                      std::string dtype = "F32");

/// As WriteSyntheticCheckpoint, for any valid Llama `config`.
absl::Status WriteSyntheticCheckpointForConfig(const ModelConfig& config,
                                               const std::string& dir,
                                               uint64_t seed, DType dtype);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_MODEL_SYNTHETIC_H_
