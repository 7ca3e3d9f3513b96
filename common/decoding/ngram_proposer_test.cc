#include "common/decoding/ngram_proposer.h"

#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(PromptLookupReferenceTest, ProposesWhatFollowedTheLatestEarlierMatch) {
  // "7 8 9" occurs at 0 and 5; the latest earlier one is followed by 4 5.
  const std::vector<int> ctx = {7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 7, 8, 9};
  EXPECT_THAT(PromptLookupReference(ctx, 1, 3, 2), ElementsAre(4, 5));
  EXPECT_THAT(PromptLookupReference(ctx, 1, 3, 10),
              ElementsAre(4, 5, 6, 7, 8, 9));  // up to the context's end
}

TEST(PromptLookupReferenceTest, LongestNWinsAndShorterOnesAreTried) {
  // The 2-gram "1 2" last occurred at 4 (-> 9); the 3-gram "5 1 2" only at
  // 0 (-> 3). max_n 3 takes the 3-gram's continuation.
  const std::vector<int> ctx = {5, 1, 2, 3, 6, 1, 2, 9, 5, 1, 2};
  EXPECT_THAT(PromptLookupReference(ctx, 2, 3, 1), ElementsAre(3));
  EXPECT_THAT(PromptLookupReference(ctx, 2, 2, 1), ElementsAre(9));
  // min_n 4: nothing of length 4 repeats.
  EXPECT_THAT(PromptLookupReference(ctx, 4, 5, 1), IsEmpty());
}

TEST(PromptLookupReferenceTest, OverlappingOccurrenceCountsButNotTheSuffix) {
  // 2 2 2: the last "2 2" (the suffix) is excluded; the one at 0 overlaps it.
  EXPECT_THAT(PromptLookupReference({2, 2, 2}, 2, 2, 3), ElementsAre(2));
  EXPECT_THAT(PromptLookupReference({1, 2, 3}, 1, 3, 3), IsEmpty());
  EXPECT_THAT(PromptLookupReference({4}, 1, 1, 3), IsEmpty());
  EXPECT_THAT(PromptLookupReference({}, 1, 1, 3), IsEmpty());
  EXPECT_THAT(PromptLookupReference({4, 4}, 1, 1, 0), IsEmpty());
}

TEST(NgramProposerTest, MatchesTheReferenceAsTheContextGrows) {
  const std::vector<int> ctx = {5, 1, 2, 3, 6, 1, 2, 9, 5, 1, 2, 3, 6};
  NgramProposer p(2, 3);
  for (size_t i = 0; i < ctx.size(); ++i) {
    p.Append(ctx[i]);
    const std::vector<int> prefix(ctx.begin(), ctx.begin() + i + 1);
    EXPECT_EQ(p.Propose(3), PromptLookupReference(prefix, 2, 3, 3)) << i;
  }
  int n = -1;
  // ... 5 1 2 3 6: "3 6" (n = 3: "2 3 6") matched at 1..4, followed by 1 2 9.
  EXPECT_THAT(p.Propose(3, &n), ElementsAre(1, 2, 9));
  EXPECT_EQ(n, 3);
  EXPECT_THAT(p.Propose(0), IsEmpty());
}

// The index and the scan agree on random sequences over small vocabularies
// (many repeats, overlaps, several n matching at once), for every prefix.
TEST(NgramProposerTest, AgreesWithTheReferenceOnRandomSequences) {
  std::mt19937 rng(1234);
  int proposals = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int vocab = 2 + trial % 6;
    const int len = 1 + static_cast<int>(rng() % 120);
    const int min_n = 1 + static_cast<int>(rng() % 4);
    const int max_n = min_n + static_cast<int>(rng() % 5);
    const int k = 1 + static_cast<int>(rng() % 8);
    NgramProposer p(min_n, max_n);
    std::vector<int> ctx;
    // Sometimes the tokens come in chunks (the prompt, then rounds).
    while (static_cast<int>(ctx.size()) < len) {
      const int chunk = 1 + static_cast<int>(rng() % 5);
      std::vector<int> add;
      for (int j = 0; j < chunk; ++j) {
        add.push_back(static_cast<int>(rng() % vocab));
      }
      p.Append(add);
      ctx.insert(ctx.end(), add.begin(), add.end());
      const std::vector<int> want =
          PromptLookupReference(ctx, min_n, max_n, k);
      ASSERT_EQ(p.Propose(k), want)
          << "trial " << trial << " size " << ctx.size();
      proposals += !want.empty();
    }
    ASSERT_EQ(p.context(), ctx);
  }
  EXPECT_GT(proposals, 1000);  // the comparison saw many real matches
}

TEST(NgramProposerTest, OutOfRangeSizesAreClamped) {
  NgramProposer p(0, 100);
  EXPECT_EQ(p.min_n(), 1);
  EXPECT_EQ(p.max_n(), kMaxPromptLookup);
  NgramProposer q(4, 2);
  EXPECT_EQ(q.min_n(), 4);
  EXPECT_EQ(q.max_n(), 4);
}

}  // namespace
}  // namespace specserve
