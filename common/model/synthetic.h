#ifndef SPECSERVE_COMMON_MODEL_SYNTHETIC_H_
#define SPECSERVE_COMMON_MODEL_SYNTHETIC_H_

// Synthetic random-weight checkpoints with the shapes of real Llama models,
// for speed measurements at realistic sizes (speed does not depend on weight
// values; real larger checkpoints cannot be downloaded here). See
// models/README.md.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model/config.h"
#include "common/model/safetensors.h"

namespace specserve {

/// The preset names. Real sizes: "llama2-15m", "llama2-110m" (llama2.c
/// TinyStories shapes, Llama-2 vocab), "llama-3.2-1b", "llama-3.2-3b",
/// "llama-3.1-8b" (Meta's config.json values, llama3 rope_scaling
/// included), "qwen2.5-0.5b", "qwen2.5-7b" (q/k/v biases), "qwen3-0.6b",
/// "qwen3-8b" (q/k norms, head_dim 128); the 7B / 8B ones are untied;
/// "llama-3-draft-small" (2 layers, hidden 256, Llama 3's vocabulary and
/// rope_scaling: a speculator for llama-3.2-1b on CPU machines). Test
/// sizes (vocab 512, 2 layers): "llama-tiny", "llama3-tiny",
/// "llama-linear-tiny", "qwen2-tiny", "qwen2-yarn-tiny", "qwen3-tiny",
/// "llama-bias-tiny" (attention_bias: q/k/v and o biases).
std::vector<std::string> PresetNames();

/// The config of preset `name`. NOT_FOUND listing the known names otherwise.
absl::StatusOr<ModelConfig> PresetConfig(const std::string& name);

/// Parameters of a model with `config`: embeddings, per-layer projections,
/// biases and norms, final norm, and lm_head unless tied.
int64_t CountParameters(const ModelConfig& config);

/// Writes `dir`/config.json and `dir`/model.safetensors (creating `dir`) for
/// preset `preset`, with weights drawn from N(0, 0.02^2) (0.2^2 for the
/// *-tiny presets) (approximated by a
/// scaled sum of four uniforms, so |w| < 0.07) from a counter-based
/// SplitMix64 stream per tensor seeded by `seed`: the same seed gives the
/// same bytes. RMSNorm weights are 1; biases are N(0, 0.1^2) and Qwen3's
/// q/k norm weights 1 + N(0, 0.1^2) (same approximation). `dtype` is the stored type: "F32",
/// "BF16" or "F16". Every core (a ThreadPool of hardware_concurrency
/// threads) draws and writes 1M-element chunks in place (about 6 MB of
/// memory per core, whatever the model's size); the bytes do not depend on
/// the thread count. Errors: NOT_FOUND for an unknown preset, INVALID_ARGUMENT for an
/// unknown dtype, INTERNAL naming the path on I/O failure.
absl::Status WriteSyntheticCheckpoint(const std::string& preset,
                                      const std::string& dir, uint64_t seed,
                                      std::string dtype = "F32");

/// As WriteSyntheticCheckpoint, for any valid `config`.
absl::Status WriteSyntheticCheckpointForConfig(const ModelConfig& config,
                                               const std::string& dir,
                                               uint64_t seed, DType dtype);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_MODEL_SYNTHETIC_H_
