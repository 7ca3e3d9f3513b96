// BuiltinSpmTokenizer must give exactly libsentencepiece's ids and text
// (SentencePieceTokenizer) on the stories260K tokenizer: every golden and
// eval prompt, thousands of random strings (ASCII, whitespace runs, Unicode,
// raw bytes) and random id sequences. Prints the counts compared.

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/tokenizer/spm_builtin.h"
#include "gtest/gtest.h"
#if !defined(SPECSERVE_SPM_BUILTIN)
#include "common/tokenizer/sentencepiece_tokenizer.h"
#endif

namespace specserve {
namespace {

#if defined(SPECSERVE_SPM_BUILTIN)

TEST(SpmBuiltinParityTest, NeedsLibsentencepiece) {
  GTEST_SKIP() << "built with --define=spm=builtin: no libsentencepiece";
}

#else

constexpr char kModel[] = "models/stories260K/tokenizer.model";

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> PromptFiles() {
  std::vector<std::string> texts;
  for (const char* dir : {"tests/data/golden/prompts", "bench/eval_prompts"}) {
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      if (e.path().extension() == ".txt") texts.push_back(ReadFile(e.path()));
    }
  }
  return texts;
}

// A random string of one of four kinds (ASCII, whitespace-heavy, Unicode,
// raw bytes), or a mix of them.
std::string RandomString(std::mt19937* rng) {
  static const std::vector<std::string> kUnicode = {
      "\u00e9", "\u00fc", "\u4e2d", "\u6587", "\U0001F600", "\u2581",
      "\u2581\u2581", "\uFFFD", "\u0301", "\u00a0", "\u3000", "\u2047",
      "\u00df", "\u0416", "\u05d0", "\U00010348", "\u200b", "\ufeff"};
  static const std::vector<std::string> kSpace = {" ", "  ", "\t", "\n",
                                                  "\r\n", "   ", " \n "};
  std::uniform_int_distribution<int> len_dist(0, 40);
  std::uniform_int_distribution<int> kind_dist(0, 4);
  const int kind = kind_dist(*rng);
  const int len = len_dist(*rng);
  std::string s;
  for (int k = 0; k < len; ++k) {
    const int part = kind == 4 ? kind_dist(*rng) % 4 : kind;
    switch (part) {
      case 0:  // Printable ASCII, spaces included.
        s.push_back(static_cast<char>(32 + (*rng)() % 95));
        break;
      case 1:  // Whitespace runs between short words.
        s += kSpace[(*rng)() % kSpace.size()];
        s.push_back(static_cast<char>('a' + (*rng)() % 26));
        break;
      case 2:
        s += kUnicode[(*rng)() % kUnicode.size()];
        break;
      default:  // Any byte, valid UTF-8 or not (NUL included).
        s.push_back(static_cast<char>((*rng)() % 256));
        break;
    }
  }
  return s;
}

class SpmBuiltinParityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto lib = SentencePieceTokenizer::Load(kModel);
    ASSERT_TRUE(lib.ok()) << lib.status();
    lib_ = *std::move(lib);
    auto builtin = BuiltinSpmTokenizer::Load(kModel);
    ASSERT_TRUE(builtin.ok()) << builtin.status();
    builtin_ = *std::move(builtin);
  }

  // Encode (with and without BOS) and Decode of the ids agree.
  void ExpectSameText(const std::string& text) {
    for (bool bos : {false, true}) {
      auto want = lib_->Encode(text, bos);
      auto got = builtin_->Encode(text, bos);
      ASSERT_TRUE(want.ok() && got.ok());
      ASSERT_EQ(*got, *want) << "text: '" << text << "' bos " << bos;
      auto want_text = lib_->Decode(*want);
      auto got_text = builtin_->Decode(*got);
      ASSERT_TRUE(want_text.ok() && got_text.ok());
      ASSERT_EQ(*got_text, *want_text) << "text: '" << text << "'";
    }
  }

  std::unique_ptr<SentencePieceTokenizer> lib_;
  std::unique_ptr<BuiltinSpmTokenizer> builtin_;
};

TEST_F(SpmBuiltinParityTest, SameVocabulary) {
  ASSERT_EQ(builtin_->vocab_size(), lib_->vocab_size());
  for (int id = 0; id < lib_->vocab_size(); ++id) {
    EXPECT_EQ(*builtin_->IdToPiece(id), *lib_->IdToPiece(id)) << id;
  }
  EXPECT_EQ(builtin_->bos_id(), lib_->bos_id());
  EXPECT_EQ(builtin_->eos_id(), lib_->eos_id());
  EXPECT_EQ(builtin_->unk_id(), lib_->unk_id());
  EXPECT_EQ(builtin_->pad_id(), lib_->pad_id());
  EXPECT_EQ(builtin_->Fingerprint(), lib_->Fingerprint());
}

TEST_F(SpmBuiltinParityTest, PromptFiles) {
  const std::vector<std::string> texts = PromptFiles();
  ASSERT_GE(texts.size(), 50u);
  for (const std::string& t : texts) {
    ExpectSameText(t);
    if (HasFatalFailure()) return;
  }
  std::printf("prompt files compared: %zu\n", texts.size());
}

TEST_F(SpmBuiltinParityTest, EdgeCases) {
  for (const std::string& t :
       {std::string(""), std::string(" "), std::string("   a  b   "),
        std::string("\n"), std::string("a\n\nb"), std::string("\u2581"),
        std::string("a \u2581"), std::string("\u2581 a"), std::string("\xFF"),
        std::string("\xE2\x96"), std::string("a\0b", 3), std::string("<s>"),
        std::string("<0x41>"), std::string("<unk>"), std::string(" \u2047 ")}) {
    ExpectSameText(t);
    if (HasFatalFailure()) return;
  }
}

TEST_F(SpmBuiltinParityTest, RandomStrings) {
  std::mt19937 rng(17);
  constexpr int kStrings = 3000;
  for (int k = 0; k < kStrings; ++k) {
    ExpectSameText(RandomString(&rng));
    if (HasFatalFailure()) return;
  }
  std::printf("random strings compared: %d\n", kStrings);
}

TEST_F(SpmBuiltinParityTest, RandomIdSequences) {
  std::mt19937 rng(1717);
  constexpr int kSequences = 3000;
  for (int k = 0; k < kSequences; ++k) {
    std::vector<int> ids(rng() % 12);
    for (int& id : ids) id = static_cast<int>(rng() % lib_->vocab_size());
    auto want = lib_->Decode(ids);
    auto got = builtin_->Decode(ids);
    ASSERT_TRUE(want.ok() && got.ok());
    ASSERT_EQ(*got, *want) << "sequence " << k;
  }
  std::printf("random id sequences compared: %d\n", kSequences);
}

#endif  // SPECSERVE_SPM_BUILTIN

}  // namespace
}  // namespace specserve
