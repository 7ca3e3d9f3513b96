#include "common/decoding/logits_processors.h"

#include <limits>
#include <algorithm>
#include <random>
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


// The edits of a row make it what the processors make it, bit for bit, for
// random prompts, outputs, pending drafts, biases, penalties (each on or
// off) and masks, including ids outside the row.
TEST(LogitEditsTest, EditedRowsEqualProcessedRows) {
  std::mt19937 gen(7);
  const int vocab = 50;
  std::uniform_int_distribution<int> id(-2, vocab + 3);
  std::uniform_real_distribution<float> logit(-6.f, 6.f);
  for (int trial = 0; trial < 300; ++trial) {
    SamplingParams p;
    p.presence_penalty = trial % 2 ? 0.f : logit(gen) / 3.f;
    p.frequency_penalty = trial % 3 ? 0.f : logit(gen) / 3.f;
    p.repetition_penalty = trial % 5 < 2 ? 1.f : 0.5f + (trial % 7) * 0.3f;
    for (int b = 0; b < 1 + trial % 4; ++b) {
      const int bid = (b * 13 + trial) % (vocab + 5);
      if (p.logit_bias.empty() || bid > p.logit_bias.back().first) {
        p.logit_bias.push_back({bid, logit(gen) * 10.f});
      }
    }
    if (trial % 4 == 0) p.logit_bias.clear();
    std::vector<int> prompt(trial % 30), output(trial % 11), pending(trial % 5),
        masked(trial % 3);
    for (std::vector<int>* ids : {&prompt, &output, &pending, &masked}) {
      for (int& x : *ids) x = id(gen);
    }
    PenaltyTracker t(prompt);
    t.AddOutput(output);
    std::vector<float> row(vocab);
    for (float& x : row) x = logit(gen);
    if (trial % 6 == 0) row[trial % vocab] = 0.f;
    std::vector<float> want = row;
    ApplyLogitBias(p, absl::MakeSpan(want));
    t.Apply(p, pending, absl::MakeSpan(want));
    for (const int m : masked) {
      if (m >= 0 && m < vocab) want[m] = -std::numeric_limits<float>::infinity();
    }
    LogitEdits edits;
    AppendRowEdits(p, nullptr, {}, {}, vocab, &edits);  // row 0: bias only
    AppendRowEdits(p, &t, pending, masked, vocab, &edits);
    ASSERT_EQ(edits.rows(), 2);
    for (int r = 0; r < 2; ++r) {
      for (int i = edits.offsets[r] + 1; i < edits.offsets[r + 1]; ++i) {
        ASSERT_LT(edits.edits[i - 1].id, edits.edits[i].id);  // distinct
      }
    }
    std::vector<float> got = row;
    ApplyLogitEdits(edits, 1, absl::MakeSpan(got));
    for (int v = 0; v < vocab; ++v) {
      EXPECT_EQ(got[v], want[v]) << "trial " << trial << " id " << v;
    }
    std::vector<float> bias_only = row, bias_want = row;
    ApplyLogitEdits(edits, 0, absl::MakeSpan(bias_only));
    ApplyLogitBias(p, absl::MakeSpan(bias_want));
    EXPECT_EQ(bias_only, bias_want) << "trial " << trial;
  }
}

// Without bias, penalties or mask a row has no edits: it costs nothing.
TEST(LogitEditsTest, NothingToDoIsNoEdits) {
  PenaltyTracker t({1, 2});
  t.AddOutput({3});
  LogitEdits edits;
  AppendRowEdits(SamplingParams(), &t, {4}, {}, 10, &edits);
  ASSERT_EQ(edits.rows(), 1);
  EXPECT_TRUE(edits.edits.empty());
  EXPECT_FALSE(edits.has_masks());
}

// Token masks: a masked row is the edited row with every disallowed id at
// -inf (the same as masking them with edits), rows without a mask (before
// it: -1; after the entries: none) are only edited; vocabularies that are
// not a multiple of 32 keep their last word's tail bits clear.
TEST(LogitEditsTest, TokenMasksEqualMaskingEdits) {
  std::mt19937 g(4);
  for (const int vocab : {1, 31, 32, 33, 100, 1000}) {
    SamplingParams sp;
    sp.logit_bias = {{0, 1.5f}};
    std::vector<int> disallowed;
    for (int id = 0; id < vocab; ++id) {
      if (g() % 3 != 0) disallowed.push_back(id);
    }
    std::shuffle(disallowed.begin(), disallowed.end(), g);
    LogitEdits masked, as_edits;
    AppendRowEdits(sp, nullptr, {}, {}, vocab, &masked);      // row 0
    AppendRowEdits(sp, nullptr, {}, {}, vocab, &masked);      // row 1
    MaskLastRow(disallowed, vocab, &masked);
    AppendRowEdits(sp, nullptr, {}, {}, vocab, &masked);      // row 2
    AppendRowEdits(sp, nullptr, {}, {}, vocab, &as_edits);
    AppendRowEdits(sp, nullptr, {}, disallowed, vocab, &as_edits);
    ASSERT_EQ(masked.rows(), 3);
    EXPECT_EQ(masked.mask_of_row, (std::vector<int>{-1, 0}));
    EXPECT_EQ(masked.mask_words, (vocab + 31) / 32);
    if (vocab % 32 != 0) {
      EXPECT_EQ(masked.allowed.back() >> (vocab % 32), 0u) << vocab;
    }
    std::vector<float> row(vocab);
    for (float& x : row) x = static_cast<float>(g() % 1000) / 100.f - 5.f;
    for (int r = 0; r < 3; ++r) {
      std::vector<float> got = row, want = row;
      ApplyLogitEdits(masked, r, absl::MakeSpan(got));
      ApplyLogitEdits(as_edits, r == 1 ? 1 : 0, absl::MakeSpan(want));
      EXPECT_EQ(got, want) << "vocab " << vocab << " row " << r;
    }
  }
}

}  // namespace
}  // namespace specserve
