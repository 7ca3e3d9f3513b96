#include "common/decoding/stats.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace specserve {
namespace {

// Closed forms used as independent references:
//   dof = 1:  Q = erfc(sqrt(x / 2)).
//   dof = 2m: Q = e^{-x/2} * sum_{i<m} (x/2)^i / i!  (Poisson tail).
double EvenDofReference(double stat, int dof) {
  const double h = stat / 2.0;
  double term = 1.0;
  double sum = 1.0;
  for (int i = 1; i < dof / 2; ++i) {
    term *= h / i;
    sum += term;
  }
  return std::exp(-h) * sum;
}

TEST(ChiSquarePValueTest, MatchesClosedFormForOneDof) {
  for (double stat : {0.01, 0.5, 1.0, 3.841458820694124, 10.0, 30.0}) {
    const double expected = std::erfc(std::sqrt(stat / 2.0));
    EXPECT_NEAR(ChiSquarePValue(stat, 1), expected, 1e-10 * expected + 1e-15)
        << "stat=" << stat;
  }
  // The textbook 5% critical value for 1 dof.
  EXPECT_NEAR(ChiSquarePValue(3.841458820694124, 1), 0.05, 1e-9);
}

TEST(ChiSquarePValueTest, MatchesClosedFormForEvenDof) {
  for (int dof : {2, 4, 10, 38, 100, 400}) {
    for (double stat : {0.1, 1.0, 5.0, 20.0, 50.0, 120.0, 400.0, 600.0}) {
      const double expected = EvenDofReference(stat, dof);
      EXPECT_NEAR(ChiSquarePValue(stat, dof), expected,
                  1e-9 * expected + 1e-300)
          << "dof=" << dof << " stat=" << stat;
    }
  }
}

TEST(ChiSquarePValueTest, MatchesPublishedCriticalValues) {
  // NIST/SEMATECH e-Handbook table 1.3.6.7.4 (upper-tail critical values).
  EXPECT_NEAR(ChiSquarePValue(18.307, 10), 0.05, 1e-5);
  EXPECT_NEAR(ChiSquarePValue(43.820, 19), 0.001, 1e-5);
  EXPECT_NEAR(ChiSquarePValue(124.342, 100), 0.05, 1e-5);
  EXPECT_NEAR(ChiSquarePValue(11.070, 5), 0.05, 1e-5);
}

TEST(ChiSquarePValueTest, EdgeCases) {
  EXPECT_EQ(ChiSquarePValue(0.0, 3), 1.0);
  EXPECT_EQ(ChiSquarePValue(-1.0, 3), 1.0);
  EXPECT_EQ(ChiSquarePValue(INFINITY, 3), 0.0);
  EXPECT_TRUE(std::isnan(ChiSquarePValue(1.0, 0)));
  EXPECT_TRUE(std::isnan(ChiSquarePValue(NAN, 2)));
}

TEST(ChiSquareTestTest, HandComputedStatistic) {
  // Expected 20 each; stat = (100 + 0 + 100) / 20 = 10; dof 2; Q = e^-5.
  const std::vector<int64_t> obs = {10, 20, 30};
  const std::vector<double> probs = {1.0, 1.0, 1.0};  // renormalised
  const ChiSquareResult r = ChiSquareTest(obs, probs);
  EXPECT_NEAR(r.statistic, 10.0, 1e-12);
  EXPECT_EQ(r.dof, 2);
  EXPECT_NEAR(r.p_value, std::exp(-5.0), 1e-12);
}

TEST(ChiSquareTestTest, PerfectFitHasPValueOne) {
  const ChiSquareResult r = ChiSquareTest(std::vector<int64_t>{50, 30, 20},
                                          std::vector<double>{0.5, 0.3, 0.2});
  EXPECT_NEAR(r.statistic, 0.0, 1e-12);
  EXPECT_NEAR(r.p_value, 1.0, 1e-12);
}

TEST(ChiSquareTestTest, ImpossibleOutcomeGivesZero) {
  const ChiSquareResult r = ChiSquareTest(std::vector<int64_t>{50, 49, 1},
                                          std::vector<double>{0.5, 0.5, 0.0});
  EXPECT_EQ(r.p_value, 0.0);
  EXPECT_TRUE(std::isinf(r.statistic));
}

TEST(ChiSquareTestTest, PoolsSmallBins) {
  // n = 100: bins 2 and 3 expect 2 each (< 5) -> pooled into one bin of 4,
  // still < 5 -> merged into the smallest big bin (expected 16).
  const std::vector<int64_t> obs = {80, 16, 2, 2};
  const std::vector<double> probs = {0.80, 0.16, 0.02, 0.02};
  const ChiSquareResult r = ChiSquareTest(obs, probs);
  EXPECT_EQ(r.dof, 1);
  EXPECT_NEAR(r.statistic, 0.0, 1e-12);
  // Pool big enough on its own: n = 1000, two bins of expected 4 -> 8.
  const ChiSquareResult r2 =
      ChiSquareTest(std::vector<int64_t>{500, 492, 4, 4},
                    std::vector<double>{0.5, 0.492, 0.004, 0.004});
  EXPECT_EQ(r2.dof, 2);
}

}  // namespace
}  // namespace specserve
