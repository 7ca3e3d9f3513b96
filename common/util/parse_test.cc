#include "common/util/parse.h"

#include "gtest/gtest.h"

namespace specserve {
namespace {

TEST(ParseIntListTest, ParsesAndRejects) {
  EXPECT_EQ(*ParseIntList("1,5, 9", "ids"), (std::vector<int>{1, 5, 9}));
  EXPECT_TRUE(ParseIntList("", "ids")->empty());
  auto bad = ParseIntList("1,x", "token_ids");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("token_ids"), std::string::npos);
  EXPECT_FALSE(ParseIntList("1,,2", "ids").ok());
}

}  // namespace
}  // namespace specserve
