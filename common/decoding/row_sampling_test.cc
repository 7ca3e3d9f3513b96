#include "common/decoding/row_sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/decoding/sampling.h"
#include "common/decoding/stats.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

std::vector<double> Dense(const SparseDist& d, int vocab) {
  std::vector<double> p(vocab, 0.0);
  for (const auto& e : d) p[e.first] = e.second;
  return p;
}

TEST(SampleFromInIdOrderTest, WalksIdsAscending) {
  // Listed by probability; the draw walks ids 1, 4, 6.
  const SparseDist d = {{4, 0.5f}, {1, 0.25f}, {6, 0.25f}, {2, 0.f}};
  EXPECT_EQ(SampleFromInIdOrder(d, 0.0), 1);
  EXPECT_EQ(SampleFromInIdOrder(d, 0.2499), 1);
  EXPECT_EQ(SampleFromInIdOrder(d, 0.25), 4);
  EXPECT_EQ(SampleFromInIdOrder(d, 0.7499), 4);
  EXPECT_EQ(SampleFromInIdOrder(d, 0.75), 6);
  EXPECT_EQ(SampleFromInIdOrder(d, 0.999999), 6);
  // Unnormalised mass is sampled proportionally; zero mass never wins.
  EXPECT_EQ(SampleFromInIdOrder({{3, 2.f}, {5, 0.f}}, 0.99), 3);
  EXPECT_EQ(SampleFromInIdOrder({}, 0.5), -1);
  EXPECT_EQ(SampleFromInIdOrder({{1, 0.f}}, 0.5), -1);
}

// Large supports take the dense walk, small ones the sorted one: the same
// draws.
TEST(SampleFromInIdOrderTest, DenseWalkEqualsSortedWalk) {
  std::mt19937_64 gen(5);
  std::uniform_real_distribution<float> w(0.f, 1.f);
  for (int size : {3000, 40000}) {
    SparseDist big;
    for (int id = 0; id < size; ++id) {
      if (id % 3 != 1) big.emplace_back((id * 7919) % size, w(gen));
    }
    // As ComputeDistribution lists it: by probability.
    std::sort(big.begin(), big.end(),
              [](const auto& a, const auto& b) { return a.second > b.second; });
    SparseDist sorted = big;
    std::sort(sorted.begin(), sorted.end());
    for (double u : {0.0, 1e-9, 0.25, 0.5, 0.75, 0.999999}) {
      EXPECT_EQ(SampleFromInIdOrder(big, u), SampleAt(sorted, u))
          << size << " u=" << u;
    }
  }
}

TEST(SampleRowTest, AcceptTestIsUTimesQBelowP) {
  // p = softmax of equal logits over 4 ids: 0.25 each.
  const std::vector<float> logits(4, 0.f);
  const SamplingParams params{1.f, 0, 1.f, 0};
  const SparseDist q = {{2, 0.5f}, {0, 0.5f}};
  // p(2) / q(2) = 0.5: u below accepts, u above rejects.
  EXPECT_TRUE(SampleRow(logits, params, 2, q, 0.49, 0.3).accepted);
  EXPECT_EQ(SampleRow(logits, params, 2, q, 0.49, 0.3).token, -1);
  const RowSample r = SampleRow(logits, params, 2, q, 0.51, 0.0);
  EXPECT_FALSE(r.accepted);
  // Residual max(0, p - q) lives on ids 1 and 3 only (0.25 each).
  EXPECT_EQ(r.token, 1);
  EXPECT_EQ(SampleRow(logits, params, 2, q, 0.51, 0.6).token, 3);
  // q == p: the residual is empty and the draw falls back to p.
  const SparseDist q_eq = {{0, 0.25f}, {1, 0.25f}, {2, 0.25f}, {3, 0.25f}};
  // u_accept * 0.25 < 0.25 always accepts; the fallback shows on a draft
  // p does not give (top-k 1 keeps id 0 only).
  const SamplingParams top1{1.f, 1, 1.f, 0};
  const RowSample f = SampleRow(logits, top1, 3, {{0, 1.f}, {3, 0.f}}, 0.0, 0.9);
  EXPECT_FALSE(f.accepted);
  EXPECT_EQ(f.token, 0);
  EXPECT_TRUE(SampleRow(logits, params, 1, q_eq, 0.999, 0.5).accepted);
  // No draft: a plain draw from p; never accepted.
  const RowSample plain = SampleRow(logits, params, -1, q, 0.0, 0.8);
  EXPECT_FALSE(plain.accepted);
  EXPECT_EQ(plain.token, 3);
}

struct RowCase {
  SamplingParams params;
  uint64_t seed;
};

class SampleRowDistributionTest : public ::testing::TestWithParam<RowCase> {};

// Drafting x ~ q and emitting x if accepted, else the row's sample, is
// distributed as p (Leviathan et al. Theorem 1), and a row without a draft
// samples p.
TEST_P(SampleRowDistributionTest, EmittedTokenIsDistributedAsTarget) {
  constexpr int kVocab = 24;
  constexpr int kTrials = 30000;
  const RowCase& c = GetParam();
  std::mt19937_64 gen(c.seed);
  std::normal_distribution<float> normal(0.f, 1.5f);
  std::vector<float> target(kVocab), draft(kVocab);
  for (float& v : target) v = normal(gen);
  for (float& v : draft) v = normal(gen);
  const SparseDist q = ComputeDistribution(draft, c.params);
  const std::vector<double> p =
      Dense(ComputeDistribution(target, c.params), kVocab);
  Rng rng(c.seed + 100);
  std::vector<int64_t> with_draft(kVocab, 0), without(kVocab, 0);
  int64_t accepted = 0;
  for (int t = 0; t < kTrials; ++t) {
    const int x = SampleFrom(q, &rng);
    const double ua = rng.Uniform(), us = rng.Uniform();
    const RowSample r = SampleRow(target, c.params, x, q, ua, us);
    accepted += r.accepted;
    ++with_draft[r.accepted ? x : r.token];
    const RowSample plain =
        SampleRow(target, c.params, -1, {}, rng.Uniform(), rng.Uniform());
    ASSERT_FALSE(plain.accepted);
    ++without[plain.token];
  }
  const ChiSquareResult a = ChiSquareTest(with_draft, p);
  EXPECT_GT(a.p_value, 1e-3) << "chi2=" << a.statistic << " dof=" << a.dof;
  const ChiSquareResult b = ChiSquareTest(without, p);
  EXPECT_GT(b.p_value, 1e-3) << "chi2=" << b.statistic << " dof=" << b.dof;
  // The acceptance rate is sum_x min(p, q) (Leviathan et al. 3.3).
  const std::vector<double> qd = Dense(q, kVocab);
  double alpha = 0.0;
  for (int v = 0; v < kVocab; ++v) alpha += std::min(p[v], qd[v]);
  const double rate = static_cast<double>(accepted) / kTrials;
  EXPECT_NEAR(rate, alpha, 4 * std::sqrt(alpha * (1 - alpha) / kTrials));
}

INSTANTIATE_TEST_SUITE_P(
    Params, SampleRowDistributionTest,
    ::testing::Values(RowCase{{1.f, 0, 1.f, 0}, 1},
                      RowCase{{0.7f, 6, 1.f, 0}, 2},
                      RowCase{{1.f, 0, 0.85f, 0}, 3},
                      RowCase{{1.5f, 10, 0.9f, 0}, 4}));

}  // namespace
}  // namespace specserve
