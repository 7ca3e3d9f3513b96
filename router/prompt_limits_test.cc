#include "router/prompt_limits.h"

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/tokenizer/tokenizer.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

// The premise of the byte bound: no text has more bytes per token than
// MaxBytesPerToken, checked on the bundled tokenizers (sentencepiece and
// tokenizer.json) over random texts built from their own longest pieces,
// words and whitespace runs.
TEST(MaxBytesPerTokenTest, BoundsEveryTextsBytesPerToken) {
  for (const char* dir : {"models/stories260K", "models/tinystories-656K"}) {
    auto tok = LoadTokenizer(dir);
    ASSERT_TRUE(tok.ok()) << tok.status();
    const int max_bytes = MaxBytesPerToken(**tok);
    ASSERT_GT(max_bytes, 1) << dir;
    // The decoded tokens, longest first, as material.
    std::vector<std::string> pieces;
    for (int id = 0; id < (*tok)->vocab_size(); ++id) {
      auto t = (*tok)->Decode({id});
      ASSERT_TRUE(t.ok());
      EXPECT_LT(static_cast<int>(t->size()), max_bytes) << dir << " " << id;
      if (!t->empty()) pieces.push_back(*t);
    }
    std::mt19937 rng(7);
    for (int trial = 0; trial < 200; ++trial) {
      std::string text;
      const int n = 1 + rng() % 200;
      for (int i = 0; i < n; ++i) {
        text += pieces[rng() % pieces.size()];
        if (rng() % 4 == 0) text += std::string(1 + rng() % 3, ' ');
      }
      auto ids = (*tok)->Encode(text, /*add_bos=*/false);
      ASSERT_TRUE(ids.ok()) << ids.status();
      EXPECT_LE(text.size(), ids->size() * static_cast<size_t>(max_bytes))
          << dir << ": " << text;
    }
  }
}

TEST(MaxPromptBytesTest, ScalesWithContextAndIsOffWithoutOne) {
  EXPECT_EQ(MaxPromptBytes(512, 10), 512 * 10 * 3);
  EXPECT_EQ(MaxPromptBytes(131072, 200), int64_t{131072} * 200 * 3);
  EXPECT_EQ(MaxPromptBytes(0, 10), 0);
  EXPECT_EQ(MaxPromptBytes(512, 0), 0);
}

}  // namespace
}  // namespace specserve
