#include "router/tool_calls.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace specserve {
namespace {

const std::vector<std::string> kTools = {"get_weather", "now"};

TEST(ParseToolCallsTest, HermesAndQwenBlocks) {
  const ParsedAnswer a = ParseToolCalls(
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
      "{\"where\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>\n"
      "<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>",
      kTools);
  ASSERT_EQ(a.calls.size(), 2u);
  EXPECT_EQ(a.calls[0].name, "get_weather");
  EXPECT_EQ(a.calls[0].arguments, R"({"where":"Paris","unit":"c"})");
  EXPECT_EQ(a.calls[1].name, "now");
  EXPECT_EQ(a.calls[1].arguments, "{}");
  EXPECT_EQ(a.content, "Let me check.");
  // The last block cut before its closing tag still counts; arguments as
  // a JSON string are read.
  const ParsedAnswer b = ParseToolCalls(
      "<tool_call>{\"name\": \"now\", \"arguments\": \"{\\\"tz\\\": 1}\"}",
      kTools);
  ASSERT_EQ(b.calls.size(), 1u);
  EXPECT_EQ(b.calls[0].arguments, R"({"tz":1})");
  EXPECT_EQ(b.content, "");
}

TEST(ParseToolCallsTest, Llama3JsonAnswers) {
  ParsedAnswer a = ParseToolCalls(
      " {\"name\": \"get_weather\", \"parameters\": {\"where\": \"Oslo\"}} ",
      kTools);
  ASSERT_EQ(a.calls.size(), 1u);
  EXPECT_EQ(a.calls[0].arguments, R"({"where":"Oslo"})");
  EXPECT_EQ(a.content, "");
  a = ParseToolCalls(
      "{\"name\": \"now\", \"parameters\": {}}; {\"name\": \"get_weather\", "
      "\"parameters\": {\"where\": \"Rome\"}}",
      kTools);
  ASSERT_EQ(a.calls.size(), 2u);
  EXPECT_EQ(a.calls[1].name, "get_weather");
  a = ParseToolCalls(
      "[{\"name\": \"now\", \"arguments\": {}}, {\"name\": \"now\", "
      "\"arguments\": {\"tz\": 2}}]",
      kTools);
  ASSERT_EQ(a.calls.size(), 2u);
  EXPECT_EQ(a.calls[1].arguments, R"({"tz":2})");
}

// Anything that is not a well-formed call of a known tool stays text.
TEST(ParseToolCallsTest, EverythingElseIsContent) {
  for (const char* text : {
           "Once upon a time.",
           "{\"name\": \"delete_all\", \"parameters\": {}}",
           "{\"name\": \"now\"}",
           "{\"name\": \"now\", \"parameters\": 3}",
           "{\"a\": 1}",
           "<tool_call>{\"name\": \"now\", \"arguments\": {}</tool_call>",
           "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>",
           "{\"name\": \"now\", \"parameters\": {}}; not json",
           "",
       }) {
    const ParsedAnswer a = ParseToolCalls(text, kTools);
    EXPECT_TRUE(a.calls.empty()) << text;
    EXPECT_EQ(a.content, text);
  }
}

}  // namespace
}  // namespace specserve
