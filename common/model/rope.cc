#include "common/model/rope.h"

#include <algorithm>
#include <cmath>

namespace specserve {
namespace {

constexpr double kPi = 3.14159265358979323846;

// YaRN's mscale: the attention temperature for an extension by `scale`.
double Mscale(double scale, double m) {
  return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}

void Llama3(const RopeScaling& r, std::vector<double>* inv_freq) {
  const double orig = r.original_max_position_embeddings;
  const double low_wavelen = orig / r.low_freq_factor;    // longest kept
  const double high_wavelen = orig / r.high_freq_factor;  // shortest scaled
  for (double& f : *inv_freq) {
    const double wavelen = 2.0 * kPi / f;
    if (wavelen < high_wavelen) continue;  // high frequencies: unchanged
    if (wavelen > low_wavelen) {            // low frequencies: interpolated
      f /= r.factor;
      continue;
    }
    const double smooth = (orig / wavelen - r.low_freq_factor) /
                          (r.high_freq_factor - r.low_freq_factor);
    f = (1.0 - smooth) * f / r.factor + smooth * f;
  }
}

void Yarn(const ModelConfig& c, std::vector<double>* inv_freq,
          double* attention_factor) {
  const RopeScaling& r = c.rope_scaling;
  const double dim = c.head_dim;
  const double orig = r.original_max_position_embeddings > 0
                          ? r.original_max_position_embeddings
                          : c.max_position_embeddings;
  // The dimension whose wavelength fits `rotations` times into `orig`.
  auto correction_dim = [&](double rotations) {
    return dim * std::log(orig / (rotations * 2.0 * kPi)) /
           (2.0 * std::log(c.rope_theta));
  };
  double low = correction_dim(r.beta_fast);
  double high = correction_dim(r.beta_slow);
  if (r.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1.0);
  if (low == high) high += 0.001;  // avoid a zero-width ramp
  for (size_t i = 0; i < inv_freq->size(); ++i) {
    const double ramp =
        std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation = (*inv_freq)[i];
    const double interpolation = extrapolation / r.factor;
    // ramp 0 (fast dims): extrapolate; ramp 1 (slow dims): interpolate.
    (*inv_freq)[i] = interpolation * ramp + extrapolation * (1.0 - ramp);
  }
  if (r.attention_factor > 0.0) {
    *attention_factor = r.attention_factor;
  } else if (r.mscale != 0.0 && r.mscale_all_dim != 0.0) {
    *attention_factor =
        Mscale(r.factor, r.mscale) / Mscale(r.factor, r.mscale_all_dim);
  } else {
    *attention_factor = Mscale(r.factor, 1.0);
  }
}

}  // namespace

RopeFrequencies ComputeRopeFrequencies(const ModelConfig& c) {
  RopeFrequencies out;
  const int half = c.head_dim / 2;
  out.inv_freq.resize(half);
  for (int i = 0; i < half; ++i) {
    out.inv_freq[i] = std::pow(c.rope_theta, -2.0 * i / c.head_dim);
  }
  const RopeScaling& r = c.rope_scaling;
  if (r.type == "linear") {
    for (double& f : out.inv_freq) f /= r.factor;
  } else if (r.type == "llama3") {
    Llama3(r, &out.inv_freq);
  } else if (r.type == "yarn") {
    Yarn(c, &out.inv_freq, &out.attention_factor);
  }
  return out;
}

}  // namespace specserve
