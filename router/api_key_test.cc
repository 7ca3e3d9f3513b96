#include "router/api_key.h"

#include <string>

#include "gtest/gtest.h"

namespace specserve {
namespace {

TEST(ConstantTimeEqualsTest, ComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("sk-1", "sk-1"));
  EXPECT_FALSE(ConstantTimeEquals("sk-2", "sk-1"));
  EXPECT_FALSE(ConstantTimeEquals("sk-1x", "sk-1"));
  EXPECT_FALSE(ConstantTimeEquals("sk-", "sk-1"));
  EXPECT_FALSE(ConstantTimeEquals("", "sk-1"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_FALSE(ConstantTimeEquals(std::string("ab\0", 3), "ab"));
}

TEST(BearerTokenMatchesTest, SchemeIsCaseInsensitive) {
  EXPECT_TRUE(BearerTokenMatches("Bearer sk-1", "sk-1"));
  EXPECT_TRUE(BearerTokenMatches("bearer sk-1", "sk-1"));
  EXPECT_TRUE(BearerTokenMatches("BEARER sk-1", "sk-1"));
  EXPECT_TRUE(BearerTokenMatches("Bearer   sk-1", "sk-1"));
}

TEST(BearerTokenMatchesTest, RefusesOtherSchemesAndKeys) {
  EXPECT_FALSE(BearerTokenMatches("Basic sk-1", "sk-1"));
  EXPECT_FALSE(BearerTokenMatches("Bearersk-1", "sk-1"));
  EXPECT_FALSE(BearerTokenMatches("Bearer sk-2", "sk-1"));
  EXPECT_FALSE(BearerTokenMatches("Bearer sk-1 ", "sk-1"));
  EXPECT_FALSE(BearerTokenMatches("Bearer ", "sk-1"));
  EXPECT_FALSE(BearerTokenMatches("sk-1", "sk-1"));
  EXPECT_FALSE(BearerTokenMatches("", "sk-1"));
}

TEST(CheckApiKeyTest, NoKeyConfiguredLetsEverythingIn) {
  EXPECT_TRUE(CheckApiKey("", "", "x").ok());
  EXPECT_TRUE(CheckApiKey("Bearer whatever", "", "x").ok());
}

TEST(CheckApiKeyTest, WrongKeyIsUnauthenticatedNamingTheDoor) {
  const absl::Status st =
      CheckApiKey("Bearer nope", "sk-1", "the metadata 'authorization");
  EXPECT_EQ(st.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(st.message().find("'authorization: Bearer <key>'"),
            std::string::npos)
      << st;
  EXPECT_TRUE(CheckApiKey("bearer sk-1", "sk-1", "x").ok());
}

}  // namespace
}  // namespace specserve
