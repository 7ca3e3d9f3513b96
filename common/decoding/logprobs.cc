#include "common/decoding/logprobs.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace specserve {

TokenLogprobs ComputeTokenLogprobs(absl::Span<const float> logits, int token,
                                   int top_n) {
  const int vocab = static_cast<int>(logits.size());
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  auto value = [&](int i) {
    const float x = logits[i];
    return std::isnan(x) ? kNegInf : static_cast<double>(x);
  };
  double max = kNegInf;
  for (int i = 0; i < vocab; ++i) max = std::max(max, value(i));
  double log_z = kNegInf;
  if (std::isfinite(max)) {
    double sum = 0.0;
    for (int i = 0; i < vocab; ++i) sum += std::exp(value(i) - max);
    log_z = max + std::log(sum);
  } else if (max > 0) {  // +inf logits: they share the mass
    log_z = max;
  }
  auto logprob = [&](int i) -> float {
    const double v = value(i);
    if (!std::isfinite(log_z)) {
      return static_cast<float>(log_z > 0 && v == log_z ? 0.0 : kNegInf);
    }
    return static_cast<float>(v - log_z);
  };
  TokenLogprobs out;
  out.logprob = logprob(token);
  top_n = std::clamp(top_n, 0, vocab);
  if (top_n == 0) return out;
  std::vector<int> ids(vocab);
  for (int i = 0; i < vocab; ++i) ids[i] = i;
  auto better = [&](int a, int b) {
    const double va = value(a), vb = value(b);
    return va != vb ? va > vb : a < b;
  };
  std::partial_sort(ids.begin(), ids.begin() + top_n, ids.end(), better);
  out.top.reserve(top_n);
  for (int j = 0; j < top_n; ++j) out.top.emplace_back(ids[j], logprob(ids[j]));
  return out;
}

}  // namespace specserve
