#ifndef SPECSERVE_COMMON_DECODING_STATS_H_
#define SPECSERVE_COMMON_DECODING_STATS_H_

#include <cstdint>

#include "absl/types/span.h"

namespace specserve {

/// Upper tail P(X >= stat) of a chi-square variable with `dof` degrees of
/// freedom: the regularized upper incomplete gamma Q(dof/2, stat/2), computed
/// with the series (x < a+1) or Lentz continued fraction (otherwise) of
/// Numerical Recipes 3rd ed. section 6.2; relative accuracy ~1e-12.
/// stat <= 0 -> 1; stat = +inf -> 0; dof < 1 or NaN stat -> NaN.
double ChiSquarePValue(double stat, int dof);

/// Result of a Pearson goodness-of-fit test.
struct ChiSquareResult {
  double statistic = 0.0;
  int dof = 0;           ///< bins after pooling, minus 1.
  double p_value = 1.0;  ///< ChiSquarePValue(statistic, dof); 1 if dof == 0.
};

/// Pearson chi-square test of observed counts against expected probabilities
/// (same length; probabilities are renormalised to sum 1). Bins with an
/// expected count below `min_expected` (Cochran's rule: 5) are pooled into
/// one bin; if that pool is still below min_expected it joins the smallest
/// remaining bin. A count in a bin of probability 0 is impossible under the
/// hypothesis: statistic = +inf, p_value = 0.
ChiSquareResult ChiSquareTest(absl::Span<const int64_t> observed,
                              absl::Span<const double> expected_probs,
                              double min_expected = 5.0);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_DECODING_STATS_H_
