#include "common/cuda/prefill_tuning.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace specserve {
namespace {

PrefillPathTrial Trial(std::string name, double seconds, bool agrees = true,
                       bool ran = true) {
  PrefillPathTrial t;
  t.name = std::move(name);
  t.seconds = seconds;
  t.agrees = agrees;
  t.ran = ran;
  if (!ran) t.note = "not supported";
  return t;
}

TEST(PrefillTuningTest, MaxRelDiffIsScaledByTheReference) {
  const std::vector<float> ref = {1.0f, -4.0f, 2.0f};
  EXPECT_DOUBLE_EQ(MaxRelDiff(ref, ref), 0.0);
  EXPECT_DOUBLE_EQ(MaxRelDiff(ref, {1.0f, -4.0f, 3.0f}), 0.25);
  EXPECT_DOUBLE_EQ(MaxRelDiff({0.0f, 0.0f}, {1.0f, 2.0f}), 0.0);
  EXPECT_TRUE(std::isinf(MaxRelDiff(ref, {1.0f, 2.0f})));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isinf(MaxRelDiff(ref, {1.0f, nan, 2.0f})));
}

TEST(PrefillTuningTest, TopOneAgreesUpToANearTie) {
  const std::vector<float> ref = {0.0f, 10.0f, 9.95f, -3.0f};
  EXPECT_TRUE(TopOneAgrees(ref, ref));
  // The candidate prefers token 2, 0.05 below the reference's top-1: a
  // tie within 1e-2 x 10.
  EXPECT_TRUE(TopOneAgrees(ref, {0.0f, 9.9f, 9.97f, -3.0f}));
  // Token 0 is 10 below: a different answer.
  EXPECT_FALSE(TopOneAgrees(ref, {11.0f, 10.0f, 9.95f, -3.0f}));
  // A tighter tolerance rejects the near tie.
  EXPECT_FALSE(TopOneAgrees(ref, {0.0f, 9.9f, 9.97f, -3.0f}, 1e-3));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(TopOneAgrees(ref, {nan, 10.0f, 9.95f, -3.0f}));
  EXPECT_FALSE(TopOneAgrees(ref, {0.0f, 10.0f}));
  EXPECT_FALSE(TopOneAgrees({}, {}));
}

TEST(PrefillTuningTest, MedianOfOddAndEvenCounts) {
  EXPECT_DOUBLE_EQ(MedianSeconds({}), 0.0);
  EXPECT_DOUBLE_EQ(MedianSeconds({3.0, 1.0, 2.0}), 2.0);
  EXPECT_DOUBLE_EQ(MedianSeconds({4.0, 1.0, 2.0, 3.0}), 2.5);
}

TEST(PrefillTuningTest, KeepsTheFastestThatAgrees) {
  EXPECT_EQ(ChoosePrefillTrial({}), -1);
  EXPECT_EQ(ChoosePrefillTrial({Trial("flash", 0.10)}), 0);
  EXPECT_EQ(ChoosePrefillTrial({Trial("flash", 0.10), Trial("mma", 0.03)}),
            1);
  EXPECT_EQ(ChoosePrefillTrial({Trial("flash", 0.10), Trial("mma", 0.12)}),
            0);
  // Faster but wrong, or not run: not kept.
  EXPECT_EQ(ChoosePrefillTrial(
                {Trial("flash", 0.10), Trial("mma", 0.03, /*agrees=*/false)}),
            0);
  EXPECT_EQ(ChoosePrefillTrial({Trial("flash", 0.10),
                                Trial("cudnn", 0.0, true, /*ran=*/false)}),
            0);
  // A reference that did not run is still the fallback.
  EXPECT_EQ(ChoosePrefillTrial({Trial("flash", 0, true, /*ran=*/false),
                                Trial("mma", 0.05, /*agrees=*/false)}),
            0);
  EXPECT_EQ(ChoosePrefillTrial({Trial("flash", 0, true, /*ran=*/false),
                                Trial("mma", 0.05)}),
            1);
}

TEST(PrefillTuningTest, TheLibraryWinsWithinItsMargin) {
  const std::vector<PrefillPathTrial> close = {
      Trial("flash", 0.100), Trial("mma", 0.030), Trial("cudnn", 0.0314)};
  EXPECT_EQ(ChoosePrefillTrial(close), 2);  // 4.7% slower than mma
  const std::vector<PrefillPathTrial> far = {
      Trial("flash", 0.100), Trial("mma", 0.030), Trial("cudnn", 0.0316)};
  EXPECT_EQ(ChoosePrefillTrial(far), 1);  // 5.3% slower
  EXPECT_EQ(ChoosePrefillTrial(far, "cudnn", 0.10), 2);
  const std::vector<PrefillPathTrial> wrong = {
      Trial("flash", 0.100), Trial("mma", 0.030),
      Trial("cudnn", 0.020, /*agrees=*/false)};
  EXPECT_EQ(ChoosePrefillTrial(wrong), 1);
}

TEST(PrefillTuningTest, DescriptionNamesTheChoiceAndEveryTrial) {
  PrefillTuning t;
  t.context_tokens = 8192;
  t.chunk_rows = 2048;
  t.trials = {Trial("flash", 0.1102), Trial("mma", 0.03052),
              Trial("cudnn", 0, true, /*ran=*/false)};
  t.trials[1].max_rel_diff = 2.1e-3;
  t.chosen = 1;
  const std::string s = DescribePrefillTuning(t);
  EXPECT_EQ(s,
            "prefill attention: mma (tuned on a 2048-row chunk at 8192 "
            "tokens: flash 110.20 ms (reference); mma 30.52 ms, rel diff "
            "2.1e-03, agrees; cudnn not run: not supported)");
}

}  // namespace
}  // namespace specserve
