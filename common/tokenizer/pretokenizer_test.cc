#include "common/tokenizer/pretokenizer.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Llama 3's Split pattern, as its tokenizer.json has it.
constexpr char kLlama3Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::vector<std::string> Matches(const std::string& pattern,
                                 const std::string& text) {
  auto re = OnigRegex::Compile(pattern);
  EXPECT_TRUE(re.ok()) << re.status();
  std::vector<ByteRange> ranges;
  (*re)->FindAll(text, &ranges);
  std::vector<std::string> out;
  for (const auto& [b, e] : ranges) out.push_back(text.substr(b, e - b));
  return out;
}

TEST(OnigRegexTest, Llama3PatternSplitsLikeHf) {
  EXPECT_THAT(Matches(kLlama3Pattern, "Hello world's 12345   x\n\n"),
              ElementsAre("Hello", " world", "'s", " ", "123", "45", "  ", " x",
                          "\n\n"));
  // Case-insensitive contractions, Unicode letters and digits.
  EXPECT_THAT(Matches(kLlama3Pattern, "I'M café ٣٤٥٦"),
              ElementsAre("I", "'M", " café", " ", "٣٤٥", "٦"));
}

TEST(OnigRegexTest, EmptyMatchesAdvance) {
  // "a*" matches empty between letters; the scan must terminate and skip
  // the empty match right after "aa".
  EXPECT_THAT(Matches("a*", "baab"), ElementsAre("", "aa", ""));
}

TEST(OnigRegexTest, BadPatternIsInvalidArgument) {
  auto re = OnigRegex::Compile("[unclosed");
  EXPECT_EQ(re.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(re.status().message(), HasSubstr("[unclosed"));
}

std::vector<std::string> SplitWith(SplitBehavior behavior, bool invert) {
  // "-" delimiters in "a-b--c-".
  const std::string text = "a-b--c-";
  std::vector<ByteRange> matches = {{1, 2}, {3, 4}, {4, 5}, {6, 7}};
  std::vector<ByteRange> pieces;
  SplitByMatches(text.size(), matches, behavior, invert, &pieces);
  std::vector<std::string> out;
  for (const auto& [b, e] : pieces) out.push_back(text.substr(b, e - b));
  return out;
}

// The examples of HF tokenizers' SplitDelimiterBehavior.
TEST(SplitByMatchesTest, Behaviors) {
  EXPECT_THAT(SplitWith(SplitBehavior::kRemoved, false),
              ElementsAre("a", "b", "c"));
  EXPECT_THAT(SplitWith(SplitBehavior::kIsolated, false),
              ElementsAre("a", "-", "b", "-", "-", "c", "-"));
  EXPECT_THAT(SplitWith(SplitBehavior::kMergedWithPrevious, false),
              ElementsAre("a-", "b-", "-", "c-"));
  EXPECT_THAT(SplitWith(SplitBehavior::kMergedWithNext, false),
              ElementsAre("a", "-b", "-", "-c", "-"));
  EXPECT_THAT(SplitWith(SplitBehavior::kContiguous, false),
              ElementsAre("a", "-", "b", "--", "c", "-"));
  // Inverted: the letters are the delimiters; each former match stays a
  // run of its own (HF does not coalesce them).
  EXPECT_THAT(SplitWith(SplitBehavior::kRemoved, true),
              ElementsAre("-", "-", "-", "-"));
  EXPECT_THAT(SplitWith(SplitBehavior::kMergedWithPrevious, true),
              ElementsAre("a", "-b", "-", "-c", "-"));
}

std::vector<std::string> Words(const std::string& json,
                               const std::string& text) {
  auto pre = PreTokenizer::FromJson(nlohmann::json::parse(json));
  EXPECT_TRUE(pre.ok()) << pre.status();
  std::vector<std::string> words;
  if (pre.ok()) (*pre)->Split(text, &words);
  return words;
}

TEST(PreTokenizerTest, SequenceOfSplitAndByteLevel) {
  const std::string json = std::string(R"({"type": "Sequence",
      "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": )") +
                           nlohmann::json(kLlama3Pattern).dump() + R"(},
         "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false,
         "use_regex": false}]})";
  EXPECT_THAT(Words(json, "Hi there\n"),
              ElementsAre("Hi", "\xC4\xA0there", "\xC4\x8A"));
}

TEST(PreTokenizerTest, ByteLevelWithGpt2RegexAndPrefixSpace) {
  EXPECT_THAT(
      Words(R"({"type": "ByteLevel", "add_prefix_space": true})", "Hi  you"),
      ElementsAre("\xC4\xA0Hi", "\xC4\xA0", "\xC4\xA0you"));
  EXPECT_THAT(Words(R"({"type": "ByteLevel", "add_prefix_space": false,
                        "use_regex": false})",
                    "Hi  you"),
              ElementsAre("Hi\xC4\xA0\xC4\xA0you"));
}

TEST(PreTokenizerTest, StringPatternAndRemovedBehavior) {
  EXPECT_THAT(Words(R"({"type": "Split", "pattern": {"String": ", "},
                        "behavior": "Removed", "invert": false})",
                    "a, b, , c"),
              ElementsAre("a", "b", "c"));
}

TEST(PreTokenizerTest, InvalidUtf8BytesArePiecesOfTheirOwn) {
  // Oniguruma never sees the 0xFF; it becomes its own mapped word.
  EXPECT_THAT(Words(R"({"type": "ByteLevel", "add_prefix_space": false})",
                    "ab\xFF"
                    "cd"),
              ElementsAre("ab", "\xC3\xBF", "cd"));
}

TEST(PreTokenizerTest, UnsupportedTypesAreUnimplemented) {
  auto pre = PreTokenizer::FromJson(
      nlohmann::json::parse(R"({"type": "Whitespace"})"));
  EXPECT_EQ(pre.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(pre.status().message(), HasSubstr("Whitespace"));
}

}  // namespace
}  // namespace specserve
