#ifndef SPECSERVE_COMMON_DECODING_SYNTHETIC_MODELS_H_
#define SPECSERVE_COMMON_DECODING_SYNTHETIC_MODELS_H_

// Synthetic "models" for the verification tests: logits are a fixed
// pseudo-random function of the context, so a target and a draft that
// often (not always) agree are deterministic and cost nothing to query.

#include <cstdint>
#include <vector>

#include "common/decoding/sampling.h"

namespace specserve {
namespace testing_models {

/// SplitMix64's output function (Steele, Lea, Flood 2014).
inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// [vocab] logits uniform in [-scale, scale), a hash of `context` and
/// `salt`.
inline std::vector<float> SyntheticLogits(const std::vector<int>& context,
                                          int vocab, uint64_t salt,
                                          float scale) {
  uint64_t h = SplitMix64(salt);
  for (int t : context) h = SplitMix64(h ^ static_cast<uint64_t>(t + 1));
  std::vector<float> logits(vocab);
  for (int v = 0; v < vocab; ++v) {
    const double u = (SplitMix64(h + v) >> 11) * 0x1.0p-53;
    logits[v] = static_cast<float>(scale * (2.0 * u - 1.0));
  }
  return logits;
}

/// The target: salt 1, scale 3.
inline std::vector<float> TargetLogits(const std::vector<int>& ctx,
                                       int vocab) {
  return SyntheticLogits(ctx, vocab, 1, 3.f);
}

/// The draft: the target plus independent noise (salt 2, scale 2).
inline std::vector<float> DraftLogits(const std::vector<int>& ctx, int vocab) {
  std::vector<float> l = TargetLogits(ctx, vocab);
  const std::vector<float> noise = SyntheticLogits(ctx, vocab, 2, 2.f);
  for (int v = 0; v < vocab; ++v) l[v] += noise[v];
  return l;
}

/// `d` as [vocab] probabilities (0 off its support).
inline std::vector<double> Dense(const SparseDist& d, int vocab) {
  std::vector<double> p(vocab, 0.0);
  for (const auto& e : d) p[e.first] = e.second;
  return p;
}

}  // namespace testing_models
}  // namespace specserve

#endif  // SPECSERVE_COMMON_DECODING_SYNTHETIC_MODELS_H_
