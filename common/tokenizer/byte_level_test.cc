#include "common/tokenizer/byte_level.h"

#include <string>

#include "gtest/gtest.h"

namespace specserve {
namespace {

TEST(ByteLevelTest, MapsBytesLikeGpt2) {
  std::string out;
  ByteLevelEncode("a !~", &out);
  EXPECT_EQ(out, "a\xC4\xA0!~");  // ' ' -> U+0120 "Ġ".
  out.clear();
  ByteLevelEncode(std::string("\n\t\0", 3), &out);
  EXPECT_EQ(out, "\xC4\x8A\xC4\x89\xC4\x80");  // U+010A, U+0109, U+0100.
  out.clear();
  ByteLevelEncode("\x7F\xA0\xA1\xAD\xAE\xFF", &out);
  // 0x7F..0xA0 and 0xAD are remapped; 0xA1, 0xAE, 0xFF keep their value.
  EXPECT_EQ(out, "\xC4\xA1\xC5\x82\xC2\xA1\xC5\x83\xC2\xAE\xC3\xBF");
}

TEST(ByteLevelTest, RoundTripsEveryByte) {
  std::string bytes;
  for (int b = 0; b < 256; ++b) bytes.push_back(static_cast<char>(b));
  std::string mapped;
  ByteLevelEncode(bytes, &mapped);
  std::string back;
  ASSERT_TRUE(ByteLevelDecode(mapped, &back));
  EXPECT_EQ(back, bytes);
}

TEST(ByteLevelTest, DecodeRejectsCharactersOutsideTheMap) {
  std::string out = "keep";
  EXPECT_FALSE(ByteLevelDecode("a\xE4\xBD\xA0", &out));  // "a你"
  EXPECT_FALSE(ByteLevelDecode(" ", &out));  // A raw space is not mapped.
  EXPECT_FALSE(ByteLevelDecode("\xC1\xA1", &out));  // Overlong "a".
  EXPECT_FALSE(ByteLevelDecode("\xC4", &out));      // Truncated.
  EXPECT_EQ(out, "keep");  // Nothing appended on failure.
}

}  // namespace
}  // namespace specserve
