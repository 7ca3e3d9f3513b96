#include "common/decoding/logprobs.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace specserve {
namespace {

TEST(ComputeTokenLogprobsTest, IsLogSoftmaxOfTheRawRow) {
  const std::vector<float> logits = {1.f, 3.f, -2.f, 3.f, 0.5f};
  double z = 0.0;
  for (float x : logits) z += std::exp(static_cast<double>(x));
  for (int token = 0; token < 5; ++token) {
    const TokenLogprobs lp = ComputeTokenLogprobs(logits, token, 0);
    EXPECT_NEAR(lp.logprob, logits[token] - std::log(z), 1e-6);
    EXPECT_TRUE(lp.top.empty());
  }
}

TEST(ComputeTokenLogprobsTest, TopSortedDescendingTiesToLowerId) {
  const std::vector<float> logits = {1.f, 3.f, -2.f, 3.f, 0.5f};
  const TokenLogprobs lp = ComputeTokenLogprobs(logits, 2, 3);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].first, 1);  // tie with 3: the lower id first
  EXPECT_EQ(lp.top[1].first, 3);
  EXPECT_EQ(lp.top[2].first, 0);
  EXPECT_EQ(lp.top[0].second, lp.top[1].second);
  EXPECT_GT(lp.top[1].second, lp.top[2].second);
  // The whole vocabulary: probabilities sum to 1, and each id's entry
  // equals its own logprob.
  const TokenLogprobs all = ComputeTokenLogprobs(logits, 4, 100);
  ASSERT_EQ(all.top.size(), 5u);
  double sum = 0.0;
  for (const auto& [id, l] : all.top) {
    sum += std::exp(static_cast<double>(l));
    EXPECT_FLOAT_EQ(l, ComputeTokenLogprobs(logits, id, 0).logprob);
  }
  EXPECT_NEAR(sum, 1.0, 1e-6);
  EXPECT_EQ(all.top.back().first, 2);
}

TEST(ComputeTokenLogprobsTest, LargeLogitsDoNotOverflow) {
  const std::vector<float> logits = {1000.f, 1000.f, -1000.f};
  const TokenLogprobs lp = ComputeTokenLogprobs(logits, 0, 1);
  EXPECT_NEAR(lp.logprob, -std::log(2.0), 1e-6);
  EXPECT_EQ(lp.top[0].first, 0);
}

TEST(ComputeTokenLogprobsTest, NanAndMaskedLogitsNeverWin) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> logits = {nan, -inf, 0.f, 0.f};
  const TokenLogprobs lp = ComputeTokenLogprobs(logits, 1, 2);
  EXPECT_EQ(lp.logprob, -inf);
  ASSERT_EQ(lp.top.size(), 2u);
  EXPECT_EQ(lp.top[0].first, 2);
  EXPECT_EQ(lp.top[1].first, 3);
  EXPECT_NEAR(lp.top[0].second, -std::log(2.0), 1e-6);
  EXPECT_EQ(ComputeTokenLogprobs(logits, 0, 0).logprob, -inf);
}

}  // namespace
}  // namespace specserve
