#include "common/decoding/logits_processors.h"

#include <vector>

#include "gtest/gtest.h"

namespace specserve {
namespace {

SamplingParams Penalties(float presence, float frequency, float repetition) {
  SamplingParams p;
  p.presence_penalty = presence;
  p.frequency_penalty = frequency;
  p.repetition_penalty = repetition;
  return p;
}

TEST(PenaltiesTest, OffLeavesTheRowAlone) {
  PenaltyTracker t({1, 2, 3});
  t.AddOutput({2, 2, 4});
  std::vector<float> row = {0.5f, 1.f, -2.f, 3.f, 4.f};
  const std::vector<float> before = row;
  t.Apply(SamplingParams(), {1, 0}, absl::MakeSpan(row));
  EXPECT_EQ(row, before);
}

TEST(PenaltiesTest, PresenceAndFrequencyCountOutputIdsOnly) {
  // Prompt {0, 1}; output 1 once, 3 twice, 4 once; pending 4 and 5.
  PenaltyTracker t({0, 1});
  t.AddOutput({3, 1, 3, 4});
  EXPECT_EQ(t.output_count(3), 2);
  EXPECT_EQ(t.output_count(0), 0);
  std::vector<float> row(7, 1.f);
  t.Apply(Penalties(0.5f, 0.25f, 1.f), {4, 5}, absl::MakeSpan(row));
  EXPECT_FLOAT_EQ(row[0], 1.f);  // prompt only: no presence / frequency
  EXPECT_FLOAT_EQ(row[1], 1.f - 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(row[2], 1.f);
  EXPECT_FLOAT_EQ(row[3], 1.f - 0.5f - 2 * 0.25f);
  EXPECT_FLOAT_EQ(row[4], 1.f - 0.5f - 2 * 0.25f);  // once + once pending
  EXPECT_FLOAT_EQ(row[5], 1.f - 0.5f - 0.25f);      // pending only
  EXPECT_FLOAT_EQ(row[6], 1.f);
}

TEST(PenaltiesTest, RepetitionShrinksPositiveAndGrowsNegativeLogits) {
  PenaltyTracker t({0, 1});
  t.AddOutput({2});
  std::vector<float> row = {3.f, -3.f, 2.f, 3.f, -1.f};
  t.Apply(Penalties(0.f, 0.f, 1.5f), {4}, absl::MakeSpan(row));
  EXPECT_FLOAT_EQ(row[0], 2.f);    // prompt, positive: / 1.5
  EXPECT_FLOAT_EQ(row[1], -4.5f);  // prompt, negative: * 1.5
  EXPECT_FLOAT_EQ(row[2], 2.f / 1.5f);  // output
  EXPECT_FLOAT_EQ(row[3], 3.f);         // never seen
  EXPECT_FLOAT_EQ(row[4], -1.5f);       // pending
  // A penalty below 1 favours repeats instead.
  std::vector<float> favour = {3.f};
  PenaltyTracker({0}).Apply(Penalties(0.f, 0.f, 0.5f), {},
                            absl::MakeSpan(favour));
  EXPECT_FLOAT_EQ(favour[0], 6.f);
}

TEST(PenaltiesTest, RepetitionComesBeforeFrequencyAndPresence) {
  PenaltyTracker t({});
  t.AddOutput({0, 0});
  std::vector<float> row = {4.f};
  t.Apply(Penalties(1.f, 0.5f, 2.f), {}, absl::MakeSpan(row));
  EXPECT_FLOAT_EQ(row[0], 4.f / 2.f - 2 * 0.5f - 1.f);
  EXPECT_FLOAT_EQ(PenalizeLogit(4.f, 2, false, Penalties(1.f, 0.5f, 2.f)),
                  row[0]);
}

TEST(PenaltiesTest, EachIdIsPenalizedOnce) {
  // 1 is in the prompt, the output and pending: one division, one count of
  // 3 (output twice, pending once).
  PenaltyTracker t({1, 1, 1});
  t.AddOutput({1, 1});
  std::vector<float> row = {0.f, 8.f};
  t.Apply(Penalties(0.f, 1.f, 2.f), {1}, absl::MakeSpan(row));
  EXPECT_FLOAT_EQ(row[1], 8.f / 2.f - 3.f);
  EXPECT_FLOAT_EQ(row[0], 0.f);
}

TEST(PenaltiesTest, IdsOutsideTheRowAreSkipped) {
  PenaltyTracker t({-1, 9});
  t.AddOutput({-3, 7});
  std::vector<float> row = {1.f, 1.f};
  t.Apply(Penalties(1.f, 1.f, 2.f), {5, -2}, absl::MakeSpan(row));
  EXPECT_FLOAT_EQ(row[0], 1.f);
  EXPECT_FLOAT_EQ(row[1], 1.f);
  EXPECT_EQ(t.output_count(-3), 0);
}

TEST(LogitBiasTest, AddsToTheListedIdsOnly) {
  SamplingParams p;
  p.logit_bias = {{0, -100.f}, {2, 5.5f}, {9, 1.f}};
  std::vector<float> row = {1.f, 2.f, 3.f, 4.f};
  ApplyLogitBias(p, absl::MakeSpan(row));
  EXPECT_FLOAT_EQ(row[0], -99.f);
  EXPECT_FLOAT_EQ(row[1], 2.f);
  EXPECT_FLOAT_EQ(row[2], 8.5f);
  EXPECT_FLOAT_EQ(row[3], 4.f);  // id 9 is past the row
  EXPECT_TRUE(p.adjusts_logits());
  EXPECT_FALSE(p.has_penalties());
  SamplingParams min_p;
  min_p.temperature = 1.f;
  min_p.min_p = 0.1f;
  EXPECT_FALSE(min_p.adjusts_logits());  // the sampling transform's job
}

}  // namespace
}  // namespace specserve
