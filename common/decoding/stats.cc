#include "common/decoding/stats.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace specserve {
namespace {

constexpr double kEps = 1e-15;
constexpr double kTiny = 1e-300;
constexpr int kMaxIter = 10000;

// log of the common prefactor x^a e^-x / Gamma(a).
double LogPrefactor(double a, double x) {
  return a * std::log(x) - x - std::lgamma(a);
}

// Regularized lower gamma P(a, x) by its power series; for x < a + 1.
double LowerSeries(double a, double x) {
  double ap = a;
  double del = 1.0 / a;
  double sum = del;
  for (int n = 0; n < kMaxIter; ++n) {
    ap += 1.0;
    del *= x / ap;
    sum += del;
    if (std::fabs(del) < std::fabs(sum) * kEps) break;
  }
  return sum * std::exp(LogPrefactor(a, x));
}

// Regularized upper gamma Q(a, x) by its continued fraction (modified
// Lentz); for x >= a + 1.
double UpperContinuedFraction(double a, double x) {
  double b = x + 1.0 - a;
  double c = 1.0 / kTiny;
  double d = 1.0 / b;
  double h = d;
  for (int i = 1; i < kMaxIter; ++i) {
    const double an = -i * (i - a);
    b += 2.0;
    d = an * d + b;
    if (std::fabs(d) < kTiny) d = kTiny;
    c = b + an / c;
    if (std::fabs(c) < kTiny) c = kTiny;
    d = 1.0 / d;
    const double del = d * c;
    h *= del;
    if (std::fabs(del - 1.0) < kEps) break;
  }
  return std::exp(LogPrefactor(a, x)) * h;
}

}  // namespace

double ChiSquarePValue(double stat, int dof) {
  if (dof < 1 || std::isnan(stat)) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  if (stat <= 0.0) return 1.0;
  if (std::isinf(stat)) return 0.0;
  const double a = 0.5 * dof;
  const double x = 0.5 * stat;
  if (x < a + 1.0) return std::clamp(1.0 - LowerSeries(a, x), 0.0, 1.0);
  return std::clamp(UpperContinuedFraction(a, x), 0.0, 1.0);
}

ChiSquareResult ChiSquareTest(absl::Span<const int64_t> observed,
                              absl::Span<const double> expected_probs,
                              double min_expected) {
  ChiSquareResult result;
  const size_t n_bins = std::min(observed.size(), expected_probs.size());
  double total_prob = 0.0;
  int64_t n = 0;
  for (size_t i = 0; i < n_bins; ++i) {
    total_prob += expected_probs[i];
    n += observed[i];
  }
  if (n == 0 || !(total_prob > 0.0)) return result;

  struct Bin {
    double expected;
    double observed;
  };
  std::vector<Bin> bins;
  Bin pool{0.0, 0.0};
  for (size_t i = 0; i < n_bins; ++i) {
    const double e = expected_probs[i] / total_prob * static_cast<double>(n);
    const double o = static_cast<double>(observed[i]);
    if (e <= 0.0) {
      if (o > 0.0) {  // an impossible outcome happened
        result.statistic = std::numeric_limits<double>::infinity();
        result.p_value = 0.0;
        result.dof = 1;
        return result;
      }
      continue;
    }
    if (e < min_expected) {
      pool.expected += e;
      pool.observed += o;
    } else {
      bins.push_back({e, o});
    }
  }
  if (pool.expected > 0.0) {
    if (pool.expected >= min_expected || bins.empty()) {
      bins.push_back(pool);
    } else {
      auto smallest = std::min_element(
          bins.begin(), bins.end(),
          [](const Bin& a, const Bin& b) { return a.expected < b.expected; });
      smallest->expected += pool.expected;
      smallest->observed += pool.observed;
    }
  }
  for (const Bin& b : bins) {
    const double diff = b.observed - b.expected;
    result.statistic += diff * diff / b.expected;
  }
  result.dof = static_cast<int>(bins.size()) - 1;
  result.p_value =
      result.dof >= 1 ? ChiSquarePValue(result.statistic, result.dof) : 1.0;
  return result;
}

}  // namespace specserve
