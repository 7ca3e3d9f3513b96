#include "common/decoding/row_sampling.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "common/decoding/sampling.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

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

}  // namespace
}  // namespace specserve
