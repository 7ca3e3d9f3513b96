#include "bench/eval_util.h"

#include <cmath>
#include <memory>
#include <numeric>

#include "common/engine/cpu_model_runner.h"
#include "common/model/weights.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specserve {
namespace bench {
namespace {

using ::testing::ElementsAre;

TEST(Baselines, KeepCountAndForcedTokens) {
  for (int count : {2, 3, 10, 49}) {
    for (auto kept : {KeepRandom(50, count, 7), KeepRecent(50, count),
                      KeepSinkRecent(50, count, 4)}) {
      ASSERT_EQ(kept.size(), static_cast<size_t>(count));
      EXPECT_EQ(kept.front(), 0);
      EXPECT_EQ(kept.back(), 49);
      EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()));
      EXPECT_EQ(std::adjacent_find(kept.begin(), kept.end()), kept.end());
    }
  }
  EXPECT_THAT(KeepRecent(10, 4), ElementsAre(0, 7, 8, 9));
  EXPECT_THAT(KeepSinkRecent(10, 6, 4), ElementsAre(0, 1, 2, 3, 8, 9));
  EXPECT_THAT(KeepSinkRecent(10, 3, 4), ElementsAre(0, 1, 9));
  EXPECT_EQ(KeepRandom(5, 9, 1).size(), 5u);
  EXPECT_NE(KeepRandom(100, 10, 1), KeepRandom(100, 10, 2));
  EXPECT_EQ(KeepRandom(100, 10, 3), KeepRandom(100, 10, 3));
}

TEST(KlDivergence, MatchesClosedForm) {
  // p = softmax(0, ln 3) = (1/4, 3/4); q = uniform.
  const std::vector<float> p = {0.f, std::log(3.f)}, q = {5.f, 5.f};
  const double want = 0.25 * std::log(0.25 / 0.5) + 0.75 * std::log(0.75 / 0.5);
  EXPECT_NEAR(KlDivergence(p, q), want, 1e-7);
  EXPECT_EQ(KlDivergence(p, p), 0.0);
  // Shift invariance of the logits.
  EXPECT_NEAR(KlDivergence(p, {1.f, 1.f + std::log(3.f)}), 0.0, 1e-7);
}

TEST(MatchRate, PositionWise) {
  EXPECT_EQ(
      MatchRate(std::vector<int>{1, 2, 3, 4}, std::vector<int>{1, 9, 3, 4}),
      0.75);
  EXPECT_EQ(MatchRate(std::vector<int>{1, 2}, std::vector<int>{1, 2, 3, 4}),
            0.5);
  EXPECT_EQ(MatchRate({}, {}), 1.0);
}

TEST(MeanStd, Sample) {
  const MeanStd m = ComputeMeanStd(std::vector<double>{1, 2, 3, 4});
  EXPECT_DOUBLE_EQ(m.mean, 2.5);
  EXPECT_NEAR(m.std, std::sqrt(5.0 / 3.0), 1e-12);
}

class RunPrunedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto w = LoadModelWeights("models/stories260K");
    ASSERT_TRUE(w.ok()) << w.status();
    auto r = CpuModelRunner::CreateForSequences(
        std::make_shared<ModelWeights>(*std::move(w)), 2);
    ASSERT_TRUE(r.ok()) << r.status();
    model_ = *std::move(r);
  }
  std::unique_ptr<CpuModelRunner> model_;
};

TEST_F(RunPrunedTest, AllKeptEqualsFullAndPruningChangesLogits) {
  std::vector<int> prompt = {1, 403, 407, 261, 378, 20, 90, 300, 45, 87, 99};
  std::vector<int> all(prompt.size());
  std::iota(all.begin(), all.end(), 0);
  auto full = RunPruned(*model_, prompt, all, 8);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->continuation.size(), 8u);
  EXPECT_EQ(full->next_logits.size(), 512u);
  auto again = RunPruned(*model_, prompt, all, 8);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(KlDivergence(full->next_logits, again->next_logits), 0.0);
  auto pruned = RunPruned(*model_, prompt, {0, 5, 10}, 8);
  ASSERT_TRUE(pruned.ok()) << pruned.status();
  EXPECT_GT(KlDivergence(full->next_logits, pruned->next_logits), 1e-6);
  // Invalid: kept not ending at the last token; too long for the context.
  EXPECT_FALSE(RunPruned(*model_, prompt, {0, 5}, 8).ok());
  EXPECT_FALSE(RunPruned(*model_, prompt, all, 510).ok());
}

}  // namespace
}  // namespace bench
}  // namespace specserve
