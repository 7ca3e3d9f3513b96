#include "common/decoding/stop.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using ::testing::HasSubstr;

StopConditions Conditions(int max_new, std::vector<int> eos,
                          std::vector<int> stop, int max_context) {
  StopConditions c;
  c.max_new_tokens = max_new;
  c.eos_token_ids = std::move(eos);
  c.stop_token_ids = std::move(stop);
  c.max_context = max_context;
  return c;
}

void ExpectResult(StopChecker::Result r, int num_emit, FinishReason reason) {
  EXPECT_EQ(r.num_emit, num_emit);
  EXPECT_EQ(r.reason, reason) << FinishReasonName(r.reason);
}

TEST(StopCheckerTest, MaxTokensInTheMiddleOfARoundTruncates) {
  StopChecker s(Conditions(5, {2}, {}, 0), /*start_position=*/10);
  ExpectResult(s.Append({7, 8, 9}), 3, FinishReason::kNone);
  // A verify round of 4 tokens; only 2 fit.
  ExpectResult(s.Append({10, 11, 12, 13}), 2, FinishReason::kLength);
  EXPECT_EQ(s.num_emitted(), 5);
  EXPECT_TRUE(s.finished());
  ExpectResult(s.Append({14}), 0, FinishReason::kLength);
  EXPECT_EQ(s.num_emitted(), 5);
}

TEST(StopCheckerTest, LengthIsReportedWithTheLastToken) {
  StopChecker s(Conditions(2, {}, {}, 0), 0);
  ExpectResult(s.Append({5, 6}), 2, FinishReason::kLength);
  // An EOS that would come after the budget is never looked at.
  StopChecker t(Conditions(2, {9}, {}, 0), 0);
  ExpectResult(t.Append({5, 6, 9}), 2, FinishReason::kLength);
}

TEST(StopCheckerTest, EosInTheMiddleIsNotEmitted) {
  StopChecker s(Conditions(100, {2, 128009}, {}, 0), 3);
  ExpectResult(s.Append({5, 128009, 7}), 1, FinishReason::kEos);
  EXPECT_EQ(s.num_emitted(), 1);
  ExpectResult(s.Append({8}), 0, FinishReason::kEos);
}

TEST(StopCheckerTest, EosFirst) {
  StopChecker s(Conditions(100, {2}, {}, 0), 3);
  ExpectResult(s.Append({2, 4}), 0, FinishReason::kEos);
  EXPECT_EQ(s.num_emitted(), 0);
}

TEST(StopCheckerTest, StopTokenIsNotEmitted) {
  StopChecker s(Conditions(100, {2}, {13, 14}, 0), 0);
  ExpectResult(s.Append({5, 6}), 2, FinishReason::kNone);
  ExpectResult(s.Append({7, 14, 2}), 1, FinishReason::kStopToken);
  EXPECT_EQ(s.num_emitted(), 3);
}

TEST(StopCheckerTest, ContextLimit) {
  // Positions 7, 8, 9 are free in a 10-position window.
  StopChecker s(Conditions(100, {}, {}, 10), 7);
  ExpectResult(s.Append({1, 1}), 2, FinishReason::kNone);
  ExpectResult(s.Append({1, 1, 1}), 1, FinishReason::kContextLimit);
  EXPECT_EQ(s.num_emitted(), 3);
}

TEST(StopCheckerTest, ContextLimitReachedExactlyIsReportedAtOnce) {
  StopChecker s(Conditions(100, {}, {}, 10), 7);
  ExpectResult(s.Append({1, 1, 1}), 3, FinishReason::kContextLimit);
}

TEST(StopCheckerTest, LengthWinsOverSimultaneousContextLimit) {
  StopChecker s(Conditions(3, {}, {}, 10), 7);
  ExpectResult(s.Append({1, 1, 1, 1}), 3, FinishReason::kLength);
}

TEST(StopCheckerTest, BudgetSpentAtStart) {
  StopChecker full(Conditions(10, {}, {}, 8), 8);
  EXPECT_EQ(full.reason(), FinishReason::kContextLimit);
  ExpectResult(full.Append({1}), 0, FinishReason::kContextLimit);
  StopChecker zero(Conditions(0, {}, {}, 0), 0);
  EXPECT_EQ(zero.reason(), FinishReason::kLength);
  ExpectResult(zero.Append({1}), 0, FinishReason::kLength);
}

TEST(StopCheckerTest, UnlimitedContextAndEmptyAppend) {
  StopChecker s(Conditions(1000, {}, {}, 0), 1 << 30);
  ExpectResult(s.Append({}), 0, FinishReason::kNone);
  ExpectResult(s.Append({1, 2, 3}), 3, FinishReason::kNone);
}

TEST(StopCheckerTest, ExternalFinish) {
  StopChecker s(Conditions(10, {}, {}, 0), 0);
  s.Append({1});
  s.Finish(FinishReason::kCancelled);
  EXPECT_EQ(s.reason(), FinishReason::kCancelled);
  ExpectResult(s.Append({2}), 0, FinishReason::kCancelled);
  s.Finish(FinishReason::kError);  // first reason sticks
  EXPECT_EQ(s.reason(), FinishReason::kCancelled);
  EXPECT_EQ(s.num_emitted(), 1);
}

TEST(FinishReasonNameTest, Names) {
  EXPECT_EQ(FinishReasonName(FinishReason::kNone), "none");
  EXPECT_EQ(FinishReasonName(FinishReason::kLength), "length");
  EXPECT_EQ(FinishReasonName(FinishReason::kEos), "eos");
  EXPECT_EQ(FinishReasonName(FinishReason::kStopToken), "stop_token");
  EXPECT_EQ(FinishReasonName(FinishReason::kContextLimit), "context_limit");
  EXPECT_EQ(FinishReasonName(FinishReason::kStopString), "stop");
  EXPECT_EQ(FinishReasonName(FinishReason::kCancelled), "cancelled");
  EXPECT_EQ(FinishReasonName(FinishReason::kError), "error");
}

TEST(ValidateStopConditionsTest, NamesTheField) {
  EXPECT_TRUE(ValidateStopConditions(Conditions(0, {2}, {3}, 0), 10).ok());
  EXPECT_TRUE(ValidateStopConditions(Conditions(5, {99}, {}, 0), 0).ok());
  struct Case {
    StopConditions c;
    const char* field;
  };
  const Case cases[] = {
      {Conditions(-1, {}, {}, 0), "max_new_tokens"},
      {Conditions(1, {}, {}, -5), "max_context"},
      {Conditions(1, {-1}, {}, 0), "eos_token_ids[0]"},
      {Conditions(1, {2}, {3, 10}, 0), "stop_token_ids[1]"},
  };
  for (const Case& c : cases) {
    const absl::Status s = ValidateStopConditions(c.c, 10);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.field));
  }
  StopConditions min = Conditions(5, {2}, {}, 0);
  for (int m : {0, 5}) {
    min.min_new_tokens = m;
    EXPECT_TRUE(ValidateStopConditions(min, 10).ok()) << m;
  }
  for (int m : {-1, 6}) {
    min.min_new_tokens = m;
    EXPECT_THAT(std::string(ValidateStopConditions(min, 10).message()),
                HasSubstr("min_new_tokens must be in [0, max_new_tokens = 5]"))
        << m;
  }
}

TEST(StopStringFilterTest, HoldsBackPossibleStartsAndCutsAtTheFirstMatch) {
  StopStringFilter f({"abc", "", "xy"});
  EXPECT_EQ(f.Append("12a"), "12");  // "a" may start "abc"
  EXPECT_EQ(f.Append("b"), "");
  EXPECT_EQ(f.Append("d"), "abd");
  EXPECT_EQ(f.Append("x"), "");
  EXPECT_EQ(f.Append("zab"), "xz");
  EXPECT_EQ(f.Append("cxy tail"), "");  // "abc" completes first
  EXPECT_TRUE(f.matched());
  EXPECT_EQ(f.Append("more"), "");
  EXPECT_EQ(f.Flush(), "");

  StopStringFilter g({"xy", "abc"});
  EXPECT_EQ(g.Append("--ab"), "--");
  EXPECT_EQ(g.Flush(), "ab");  // end of stream: held text is real text
  EXPECT_FALSE(g.matched());
  StopStringFilter h({"é!"});
  EXPECT_EQ(h.Append("caf\xc3\xa9"), "caf");
  EXPECT_EQ(h.Append("!"), "");
  EXPECT_TRUE(h.matched());
}

// include_stop (vLLM's include_stop_str_in_output): the text at a match
// ends with the stop string, the longest one where two match at one place.
TEST(StopStringFilterTest, IncludedStopStringsEndTheText) {
  StopStringFilter f({"b", "xy"}, /*include_stop=*/true);
  EXPECT_EQ(f.Append("12x"), "12");
  EXPECT_EQ(f.Append("y tail"), "xy");
  EXPECT_TRUE(f.matched());
  StopStringFilter g({"a", "ab"}, true);
  EXPECT_EQ(g.Append("-ab-"), "-ab");
}

// Text that may not end a match (min_tokens): a stop string inside it is
// not one, but one that starts in it and ends in later text is.
TEST(StopStringFilterTest, ProtectedTextCanStartButNotEndAMatch) {
  StopStringFilter f({"abc"});
  EXPECT_EQ(f.Append("xxabc", /*can_match=*/false), "xxabc");
  EXPECT_FALSE(f.matched());
  EXPECT_EQ(f.Append("-ab", false), "-");  // held: may start "abc"
  EXPECT_EQ(f.Append("c tail"), "");       // straddles the boundary
  EXPECT_TRUE(f.matched());

  // A shorter stop string held inside a longer one's prefix stays
  // unmatched while protected, and matches once it ends in new text.
  StopStringFilter g({"abc", "b"});
  EXPECT_EQ(g.Append("ab", false), "");
  EXPECT_FALSE(g.matched());
  EXPECT_EQ(g.Append("x"), "abx");
  EXPECT_FALSE(g.matched());
  EXPECT_EQ(g.Append("yb"), "y");
  EXPECT_TRUE(g.matched());

  // Protection ends with the protected text: the same text matches after.
  StopStringFilter h({"."});
  EXPECT_EQ(h.Append("a.", false), "a.");
  EXPECT_EQ(h.Append("b."), "b");
  EXPECT_TRUE(h.matched());
}

}  // namespace
}  // namespace specserve
