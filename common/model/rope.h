#ifndef SPECSERVE_COMMON_MODEL_ROPE_H_
#define SPECSERVE_COMMON_MODEL_ROPE_H_

// Rotary-embedding frequencies of a config, shared by every backend so the
// CPU and CUDA engines and the Python reference rotate by the same angles.

#include <vector>

#include "common/model/config.h"

namespace specserve {

/// What RoPE needs from the config: dimension i (< head_dim / 2) of every
/// head pairs with i + head_dim / 2 and rotates by position * inv_freq[i];
/// cos and sin are multiplied by `attention_factor` (YaRN's mscale, so the
/// q.k logits scale by its square; 1 otherwise), as HF transformers'
/// rotary embeddings do.
struct RopeFrequencies {
  std::vector<double> inv_freq;  ///< [head_dim / 2], radians per position.
  double attention_factor = 1.0;
};

/// inv_freq = rope_theta^(-2i / head_dim) (float64), then rescaled per
/// `config.rope_scaling` as transformers' modeling_rope_utils defines it:
/// - linear: inv_freq / factor.
/// - llama3: wavelengths 2 pi / inv_freq above original / low_freq_factor
///   are divided by factor, those below original / high_freq_factor kept,
///   the band between interpolated smoothly.
/// - yarn: a linear ramp between the correction dims of beta_fast and
///   beta_slow rotations over original_max_position_embeddings (default
///   max_position_embeddings; floor/ceil unless truncate is false) blends
///   inv_freq (extrapolation) and inv_freq / factor (interpolation);
///   attention_factor = rope_scaling.attention_factor if given, else
///   mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
///   given, else mscale(factor), with mscale(s, m) = 0.1 m ln(s) + 1 for
///   s > 1 and 1 otherwise.
/// The config must be valid (ParseModelConfig's checks); never fails.
RopeFrequencies ComputeRopeFrequencies(const ModelConfig& config);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_MODEL_ROPE_H_
