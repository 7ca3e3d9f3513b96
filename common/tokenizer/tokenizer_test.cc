#include "common/tokenizer/tokenizer.h"

#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/tokenizer/hf_bpe_tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace {

using Json = nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Model directories in models/: two tokenizer families, each shared by a
// target and its draft.
const char* const kSpmModels[] = {"models/stories260K",
                                  "models/stories260K-draft"};
const char* const kHfModels[] = {"models/tinystories-656K",
                                 "models/tinystories-656K-draft"};
const char* const kAllModels[] = {
    "models/stories260K", "models/stories260K-draft", "models/tinystories-656K",
    "models/tinystories-656K-draft"};

constexpr char kBosMarker[] = "<BOS>";
// Multi-byte text: Latin-1 accents, CJK and an emoji, all outside these tiny
// vocabularies, so they go through byte fallback.
constexpr char kUnicodeText[] =
    "caf\xC3\xA9 \xC3\xBC \xE6\x97\xA5\xE6\x9C\xAC "
    "\xF0\x9F\x99\x82";  // "café ü 日本 🙂"

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << "cannot open " << path;
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Json ReadJson(const std::string& path) { return Json::parse(ReadFile(path)); }

std::unique_ptr<Tokenizer> MustLoad(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = LoadTokenizer(dir);
  EXPECT_TRUE(tok.ok()) << dir << ": " << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

std::vector<std::string> PromptFiles() {
  const std::string dir = "tests/data/golden/prompts";
  std::vector<std::string> files;
  DIR* d = opendir(dir.c_str());
  EXPECT_NE(d, nullptr) << dir;
  if (d == nullptr) return files;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (absl::EndsWith(name, ".txt")) files.push_back(dir + "/" + name);
  }
  closedir(d);
  std::sort(files.begin(), files.end());
  return files;
}

// A golden prompt: its documents and the ids of the full, unpruned prompt.
// prompt_text is "<BOS>doc1 <BOS> doc2 ...": each "<BOS>" stands for the BOS
// id, and the spaces around an inner one only separate the documents; the
// ids are the concatenation of [BOS] + Encode(doc) per document.
struct GoldenPrompt {
  std::string name;
  std::vector<std::string> docs;
  std::vector<int> ids;
};

std::vector<std::string> SplitDocs(std::string text, const std::string& name) {
  EXPECT_TRUE(absl::StartsWith(text, kBosMarker)) << name;
  text = text.substr(std::string(kBosMarker).size());
  std::vector<std::string> docs =
      absl::StrSplit(text, absl::StrCat(" ", kBosMarker, " "));
  for (const std::string& d : docs) {
    EXPECT_EQ(d.find(kBosMarker), std::string::npos) << name;
  }
  return docs;
}

// All prompts of tests/data/golden/<model>.json and, for the model the
// specprefill cases were scored with, specprefill_case*.json.
std::vector<GoldenPrompt> GoldenPrompts(const std::string& model) {
  std::vector<GoldenPrompt> out;
  const Json golden = ReadJson("tests/data/golden/" + model + ".json");
  for (const Json& c : golden.at("cases")) {
    GoldenPrompt p;
    p.name = model + "/" + c.at("name").get<std::string>();
    p.docs = SplitDocs(c.at("prompt_text").get<std::string>(), p.name);
    if (c.contains("original_token_ids")) {
      p.ids = c.at("original_token_ids").get<std::vector<int>>();
    } else {
      // Unpruned cases feed the whole prompt.
      p.ids = c.at("token_ids").get<std::vector<int>>();
    }
    EXPECT_EQ(p.ids.size(), c.at("original_len").get<size_t>()) << p.name;
    out.push_back(std::move(p));
  }
  for (const char* file : {"specprefill_case1", "specprefill_case2"}) {
    const Json sp =
        ReadJson(std::string("tests/data/golden/") + file + ".json");
    if (sp.at("speculator_model_dir").get<std::string>() != model) continue;
    GoldenPrompt p;
    p.name = file;
    // This file's prompt_text has no "<BOS>" marker; its ids start with BOS.
    std::string text = sp.at("prompt_text").get<std::string>();
    if (!absl::StartsWith(text, kBosMarker)) text = kBosMarker + text;
    p.docs = SplitDocs(text, p.name);
    p.ids = sp.at("prompt_token_ids").get<std::vector<int>>();
    out.push_back(std::move(p));
  }
  return out;
}

// Every golden id sequence of `model`: prompts, pruned token_ids, greedy
// continuations, look-aheads.
std::vector<std::vector<int>> GoldenIdSequences(const std::string& model) {
  std::vector<std::vector<int>> out;
  const Json golden = ReadJson("tests/data/golden/" + model + ".json");
  for (const Json& c : golden.at("cases")) {
    out.push_back(c.at("token_ids").get<std::vector<int>>());
    if (c.contains("original_token_ids")) {
      out.push_back(c.at("original_token_ids").get<std::vector<int>>());
    }
    out.push_back(c.at("greedy").at("token_ids").get<std::vector<int>>());
  }
  return out;
}

// Streams `ids` through an IncrementalDecoder; returns all deltas + Flush.
std::string StreamDecode(const Tokenizer& tok, const std::vector<int>& ids,
                         std::vector<std::string>* deltas = nullptr) {
  IncrementalDecoder dec(&tok);
  std::string all;
  for (int id : ids) {
    absl::StatusOr<std::string> d = dec.Append(id);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return all;
    if (deltas != nullptr) deltas->push_back(*d);
    all += *d;
  }
  all += dec.Flush();
  return all;
}

TEST(LoadTokenizerTest, PicksSentencePieceForTokenizerModel) {
  for (const char* dir : kSpmModels) {
    std::unique_ptr<Tokenizer> tok = MustLoad(dir);
    ASSERT_NE(tok, nullptr);
    EXPECT_EQ(tok->kind(), "sentencepiece");
    // config.json: vocab_size 512, bos 1, eos 2 (llama2.c vocabulary).
    const Json config = ReadJson(std::string(dir) + "/config.json");
    EXPECT_EQ(tok->vocab_size(), config.at("vocab_size").get<int>());
    EXPECT_EQ(tok->bos_id(), config.at("bos_token_id").get<int>());
    EXPECT_EQ(tok->eos_id(), config.at("eos_token_id").get<int>());
    EXPECT_EQ(tok->unk_id(), 0);  // llama2.c trains with unk id 0.
    EXPECT_EQ(*tok->IdToPiece(tok->bos_id()), "<s>");
    EXPECT_EQ(*tok->IdToPiece(tok->eos_id()), "</s>");
  }
}

TEST(LoadTokenizerTest, PicksHfBpeForTokenizerJson) {
  for (const char* dir : kHfModels) {
    std::unique_ptr<Tokenizer> tok = MustLoad(dir);
    ASSERT_NE(tok, nullptr);
    EXPECT_EQ(tok->kind(), "hf-bpe");
    const Json config = ReadJson(std::string(dir) + "/config.json");
    EXPECT_EQ(tok->vocab_size(), config.at("vocab_size").get<int>());
    // tokenizer_config.json names the special tokens; tokenizer.json has
    // their ids.
    EXPECT_EQ(*tok->IdToPiece(tok->bos_id()), "<|start_story|>");
    EXPECT_EQ(*tok->IdToPiece(tok->eos_id()), "<|end_story|>");
    EXPECT_EQ(*tok->IdToPiece(tok->unk_id()), "<unk>");
    EXPECT_EQ(*tok->IdToPiece(tok->pad_id()), "<unk>");
    EXPECT_EQ(tok->bos_id(), config.at("bos_token_id").get<int>());
    EXPECT_EQ(tok->eos_id(), config.at("eos_token_id").get<int>());
  }
}

TEST(LoadTokenizerTest, MissingDirectoryIsNotFound) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok =
      LoadTokenizer("models/no-such-model");
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(tok.status().message(), HasSubstr("models/no-such-model"));
}

std::string MakeTempDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
  std::string cmd = "mkdir -p '" + dir + "'";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  return dir;
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// The shape of a Llama-3 / GPT-2 style tokenizer.json, tiny.
std::string TinyByteLevelJson(const std::string& pre_tokenizer) {
  return absl::StrCat(R"({
    "version": "1.0",
    "added_tokens": [{"id": 5, "content": "<|begin_of_text|>",
                      "special": true, "normalized": false}],
    "normalizer": null,
    "pre_tokenizer": )",
                      pre_tokenizer, R"(,
    "post_processor": {"type": "ByteLevel", "add_prefix_space": true,
                       "trim_offsets": false, "use_regex": true},
    "decoder": {"type": "ByteLevel", "add_prefix_space": true,
                "trim_offsets": true, "use_regex": true},
    "model": {"type": "BPE", "dropout": null, "unk_token": null,
              "continuing_subword_prefix": null, "end_of_word_suffix": null,
              "fuse_unk": false, "byte_fallback": false,
              "vocab": {"a": 0, "b": 1, "ab": 2, "\u0120": 3, "\u0120ab": 4},
              "merges": ["a b", "\u0120 ab"]}})");
}

TEST(LoadTokenizerTest, LoadsByteLevelBpe) {
  const std::string dir = MakeTempDir("bytelevel");
  WriteFile(dir + "/tokenizer.json", TinyByteLevelJson(R"(
    {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\s+"},
         "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
         "use_regex": false}]})"));
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = LoadTokenizer(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->kind(), "hf-bpe");
  // The Split regex isolates the space, so "Ġab" never forms; spaces map
  // to "Ġ" (U+0120).
  EXPECT_THAT(*(*tok)->Encode("ab ab", false), ElementsAre(2, 3, 2));
  EXPECT_THAT(*(*tok)->Encode("ab<|begin_of_text|>ab", false),
              ElementsAre(2, 5, 2));
  EXPECT_EQ(*(*tok)->Decode({2, 3, 2, 5, 4}), "ab ab ab");

  // GPT-2 style: ByteLevel alone with its own regex and a prefix space.
  WriteFile(dir + "/tokenizer.json",
            TinyByteLevelJson(R"({"type": "ByteLevel",
                "add_prefix_space": true, "use_regex": true})"));
  tok = LoadTokenizer(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT(*(*tok)->Encode("ab ab", false), ElementsAre(4, 4));
  // Each piece between added tokens gets the prefix space, as in HF.
  EXPECT_THAT(*(*tok)->Encode("ab<|begin_of_text|>ab", false),
              ElementsAre(4, 5, 4));
  EXPECT_EQ((*tok)->bos_id(), -1);  // No config, no template: no BOS.
}

TEST(LoadTokenizerTest, ByteLevelTemplateBosAndItsErrors) {
  const std::string gpt2 =
      R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})";
  auto with_template = [&](const std::string& ids) {
    std::string json = TinyByteLevelJson(gpt2);
    const std::string old_pp = R"({"type": "ByteLevel", "add_prefix_space": true,
                       "trim_offsets": false, "use_regex": true})";
    const size_t at = json.find(old_pp);
    EXPECT_NE(at, std::string::npos);
    json.replace(at, old_pp.size(), absl::StrCat(R"({"type": "Sequence",
        "processors": [{"type": "ByteLevel"}, {"type": "TemplateProcessing",
          "single": [{"SpecialToken": {"id": "<|begin_of_text|>"}},
                     {"Sequence": {"id": "A"}}],
          "special_tokens": {"<|begin_of_text|>": {"ids": )",
                                                 ids, "}}}]}"));
    return HfBpeTokenizer::Parse(json, "", "tiny.json");
  };
  auto tok = with_template("[5]");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->bos_id(), 5);
  EXPECT_THAT(*(*tok)->Encode("ab", true), ElementsAre(5, 2));
  for (const char* bad : {"[99]", "[-1]", "\"x\"", "[\"5\"]"}) {
    tok = with_template(bad);
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(tok.status().message(), HasSubstr("tiny.json")) << bad;
  }
  // add_bos_token: false in tokenizer_config.json and no template: no BOS.
  auto plain = HfBpeTokenizer::Parse(
      TinyByteLevelJson(gpt2),
      R"({"bos_token": "<|begin_of_text|>", "add_bos_token": false})", "t");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ((*plain)->bos_id(), 5);
  EXPECT_THAT(*(*plain)->Encode("ab", true), ElementsAre(2));
}

TEST(LoadTokenizerTest, UnsupportedOrBadPreTokenizersAreErrors) {
  const std::string dir = MakeTempDir("bytelevel_bad");
  WriteFile(dir + "/tokenizer.json",
            TinyByteLevelJson(R"({"type": "Digits", "individual_digits": true})"));
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = LoadTokenizer(dir);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(tok.status().message(), HasSubstr("Digits"));
  EXPECT_THAT(tok.status().message(), HasSubstr(dir + "/tokenizer.json"));

  WriteFile(dir + "/tokenizer.json", TinyByteLevelJson(R"(
      {"type": "Split", "pattern": {"Regex": "(unclosed"},
       "behavior": "Isolated"})"));
  tok = LoadTokenizer(dir);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("(unclosed"));

  WriteFile(dir + "/tokenizer.json", TinyByteLevelJson(R"(
      {"type": "Split", "pattern": {"Regex": "a"}, "behavior": "Sideways"})"));
  tok = LoadTokenizer(dir);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("Sideways"));
}

TEST(LoadTokenizerTest, OtherModelTypesAreUnimplemented) {
  const std::string dir = MakeTempDir("wordpiece");
  WriteFile(dir + "/tokenizer.json", R"({"model": {"type": "WordPiece",
      "vocab": {"[UNK]": 0, "a": 1}}, "decoder": null})");
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = LoadTokenizer(dir);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(tok.status().message(), HasSubstr("WordPiece"));
}

TEST(LoadTokenizerTest, MalformedFilesAreErrorsNamingTheFile) {
  const std::string dir = MakeTempDir("malformed");
  WriteFile(dir + "/tokenizer.json", "{\"model\": {\"type\": \"BPE\", ");
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = LoadTokenizer(dir);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("tokenizer.json"));

  // A merge whose result is not in the vocabulary.
  WriteFile(dir + "/tokenizer.json", R"({"model": {"type": "BPE",
      "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}})");
  tok = LoadTokenizer(dir);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("merge 0"));

  // tokenizer.model takes precedence; a corrupt one is an error, not a crash.
  WriteFile(dir + "/tokenizer.model", "this is not a ModelProto");
  tok = LoadTokenizer(dir);
  EXPECT_FALSE(tok.ok());
  EXPECT_THAT(tok.status().message(), HasSubstr(dir + "/tokenizer.model"));
}

TEST(TokenizerTest, EncodesGoldenPromptsExactly) {
  // Reference ids come from the golden generator's tokenizers (sentencepiece
  // and HF tokenizers), independent of this code.
  int checked = 0;
  for (const char* model : {"stories260K", "stories260K-draft",
                            "tinystories-656K", "tinystories-656K-draft"}) {
    std::unique_ptr<Tokenizer> tok = MustLoad(std::string("models/") + model);
    ASSERT_NE(tok, nullptr);
    const std::vector<GoldenPrompt> prompts = GoldenPrompts(model);
    ASSERT_GE(prompts.size(), 6u) << model;
    for (const GoldenPrompt& p : prompts) {
      std::vector<int> ids;
      for (const std::string& doc : p.docs) {
        absl::StatusOr<std::vector<int>> d = tok->Encode(doc, true);
        ASSERT_TRUE(d.ok()) << d.status();
        EXPECT_EQ((*d)[0], tok->bos_id());
        ids.insert(ids.end(), d->begin(), d->end());
        // And back: the documents are plain ASCII stories.
        EXPECT_EQ(*tok->Decode(*d), doc) << p.name;
        if (tok->kind() == "sentencepiece") {
          // sentencepiece: BOS is simply prepended.
          EXPECT_EQ(*tok->Encode(doc, false),
                    std::vector<int>(d->begin() + 1, d->end()));
        }
      }
      EXPECT_EQ(ids, p.ids) << p.name;
      ++checked;
    }
  }
  EXPECT_GE(checked, 26);
}

TEST(TokenizerTest, HfBosAbsorbsThePrependedSpace) {
  // tinystories-656K was trained on "<|start_story|>Once upon...": the
  // normalized BOS "▁<|start_story|>" takes the "▁" the normalizer prepends,
  // so after BOS the first word has no "▁" (greedy decoding from BOS alone
  // yields "On", "ce▁" in the golden file). Without BOS it keeps the "▁".
  std::unique_ptr<Tokenizer> tok = MustLoad("models/tinystories-656K");
  ASSERT_NE(tok, nullptr);
  const std::vector<int> with = *tok->Encode("Once upon", true);
  const std::vector<int> without = *tok->Encode("Once upon", false);
  ASSERT_GE(with.size(), 3u);
  EXPECT_EQ(*tok->IdToPiece(with[1]), "On");
  EXPECT_EQ(*tok->IdToPiece(without[0]), "\xE2\x96\x81");
  EXPECT_EQ(std::vector<int>(with.begin() + 1, with.end()),
            std::vector<int>(without.begin() + 1, without.end()));
  EXPECT_EQ(*tok->Decode(with), "Once upon");
  EXPECT_EQ(*tok->Decode(without), "Once upon");
}

TEST(TokenizerTest, DecodesGoldenGreedyContinuations) {
  // greedy.text is the reference decode (special tokens skipped) of
  // greedy.token_ids.
  for (const char* model : kAllModels) {
    std::unique_ptr<Tokenizer> tok = MustLoad(model);
    ASSERT_NE(tok, nullptr);
    const std::string name = std::string(model).substr(7);
    const Json golden = ReadJson("tests/data/golden/" + name + ".json");
    for (const Json& c : golden.at("cases")) {
      const std::vector<int> ids =
          c.at("greedy").at("token_ids").get<std::vector<int>>();
      EXPECT_EQ(*tok->Decode(ids), c.at("greedy").at("text").get<std::string>())
          << model << " " << c.at("name");
    }
  }
}

TEST(TokenizerTest, SentencePieceMarksWordStartsAndBytes) {
  std::unique_ptr<Tokenizer> tok = MustLoad("models/stories260K");
  ASSERT_NE(tok, nullptr);
  absl::StatusOr<std::vector<int>> ids = tok->Encode("Once upon", true);
  ASSERT_TRUE(ids.ok());
  ASSERT_GE(ids->size(), 3u);
  EXPECT_EQ((*ids)[0], tok->bos_id());
  // sentencepiece's dummy prefix: the first word carries "▁".
  EXPECT_TRUE(absl::StartsWith(*tok->IdToPiece((*ids)[1]), "\xE2\x96\x81O"));
  // A newline is not a piece of its own in this vocabulary: byte fallback.
  ids = tok->Encode("\n", false);
  ASSERT_TRUE(ids.ok());
  std::vector<std::string> pieces;
  for (int id : *ids) pieces.push_back(*tok->IdToPiece(id));
  EXPECT_THAT(pieces, ::testing::Contains("<0x0A>"));
}

bool IsAscii(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return static_cast<unsigned char>(c) < 0x80;
  });
}

TEST(TokenizerTest, RoundTripsTexts) {
  std::vector<std::string> texts = {
      "Once upon a time, there was a little dog.",
      "Line one.\nLine two.\n\nLine four!",
      kUnicodeText,
      "Tom said, \"Hi!\" 123 and 4; x's.",
      "a",
  };
  for (const std::string& f : PromptFiles()) texts.push_back(ReadFile(f));
  ASSERT_GE(texts.size(), 30u);
  for (const char* model : kAllModels) {
    std::unique_ptr<Tokenizer> tok = MustLoad(model);
    ASSERT_NE(tok, nullptr);
    for (const std::string& t : texts) {
      absl::StatusOr<std::vector<int>> ids = tok->Encode(t, true);
      ASSERT_TRUE(ids.ok()) << ids.status();
      if (tok->kind() == "sentencepiece" || IsAscii(t)) {
        EXPECT_EQ(*tok->Decode(*ids), t) << model;
      } else {
        // tinystories-656K's vocabulary is ASCII only and has no <0xXX>
        // pieces despite byte_fallback: non-ASCII characters become <unk>.
        EXPECT_THAT(*ids, ::testing::Contains(tok->unk_id())) << model;
      }
    }
    // Empty text: nothing but BOS.
    EXPECT_THAT(*tok->Encode("", true), ElementsAre(tok->bos_id()));
    EXPECT_TRUE(tok->Encode("", false)->empty());
  }
}

TEST(TokenizerTest, MultiByteTextUsesByteFallback) {
  for (const char* model : kSpmModels) {
    std::unique_ptr<Tokenizer> tok = MustLoad(model);
    ASSERT_NE(tok, nullptr);
    absl::StatusOr<std::vector<int>> ids = tok->Encode(kUnicodeText, false);
    ASSERT_TRUE(ids.ok());
    int byte_pieces = 0;
    for (int id : *ids) {
      const std::string piece = *tok->IdToPiece(id);
      if (piece.size() == 6 && absl::StartsWith(piece, "<0x")) ++byte_pieces;
    }
    // The emoji alone is 4 bytes that no tiny vocabulary has as a piece.
    EXPECT_GE(byte_pieces, 4) << model;
    // Its bytes in order: F0 9F 99 82.
    std::vector<std::string> tail;
    for (size_t k = ids->size() - 4; k < ids->size(); ++k) {
      tail.push_back(*tok->IdToPiece((*ids)[k]));
    }
    EXPECT_THAT(tail, ElementsAre("<0xF0>", "<0x9F>", "<0x99>", "<0x82>"))
        << model;
  }
}

TEST(TokenizerTest, HfUnknownCharactersFuseIntoOneUnk) {
  for (const char* model : kHfModels) {
    std::unique_ptr<Tokenizer> tok = MustLoad(model);
    ASSERT_NE(tok, nullptr);
    // fuse_unk: the run "\xC3\xA9\xF0\x9F\x99\x82" (two characters) is one
    // <unk>; <unk> is a special token, so it decodes to nothing.
    const std::vector<int> ids =
        *tok->Encode("caf\xC3\xA9\xF0\x9F\x99\x82 ok", false);
    EXPECT_EQ(std::count(ids.begin(), ids.end(), tok->unk_id()), 1) << model;
    EXPECT_EQ(*tok->Decode(ids), "caf ok") << model;
  }
}

TEST(TokenizerTest, SpecialIdsProduceNoText) {
  for (const char* model : kAllModels) {
    std::unique_ptr<Tokenizer> tok = MustLoad(model);
    ASSERT_NE(tok, nullptr);
    std::vector<int> ids = *tok->Encode("The end.", true);
    ids.push_back(tok->eos_id());
    EXPECT_EQ(*tok->Decode(ids), "The end.") << model;
    EXPECT_EQ(*tok->Decode({tok->bos_id(), tok->eos_id()}), "") << model;
  }
}

TEST(TokenizerTest, BadIdsAreInvalidArgument) {
  for (const char* model : kAllModels) {
    std::unique_ptr<Tokenizer> tok = MustLoad(model);
    ASSERT_NE(tok, nullptr);
    const int n = tok->vocab_size();
    EXPECT_EQ(tok->Decode({1, n}).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(tok->Decode({-1}).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(tok->IdToPiece(n).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(tok->IdToPiece(-1).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(tok->IdToPiece(n - 1).ok());
    IncrementalDecoder dec(tok.get());
    EXPECT_EQ(dec.Append(n).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(dec.ids().empty());
  }
}

TEST(TokenizerTest, FingerprintsIdentifySharedVocabularies) {
  std::vector<std::string> fp;
  for (const char* model : kAllModels) {
    std::unique_ptr<Tokenizer> tok = MustLoad(model);
    ASSERT_NE(tok, nullptr);
    fp.push_back(tok->Fingerprint());
    EXPECT_EQ(fp.back().size(), 16u);
    EXPECT_EQ(fp.back().find_first_not_of("0123456789abcdef"),
              std::string::npos);
    EXPECT_EQ(MustLoad(model)->Fingerprint(), fp.back());  // Deterministic.
  }
  EXPECT_EQ(fp[0], fp[1]);  // stories260K == its draft.
  EXPECT_EQ(fp[2], fp[3]);  // tinystories-656K == its draft.
  EXPECT_NE(fp[0], fp[2]);
}

TEST(FingerprintTest, DependsOnEveryComponent) {
  const std::vector<std::string> pieces = {"<unk>", "<s>", "</s>", "a"};
  const std::string base =
      ComputeVocabFingerprint("hf-bpe", pieces, 1, 2, 0, -1);
  EXPECT_EQ(ComputeVocabFingerprint("hf-bpe", pieces, 1, 2, 0, -1), base);
  EXPECT_NE(ComputeVocabFingerprint("sentencepiece", pieces, 1, 2, 0, -1),
            base);
  EXPECT_NE(ComputeVocabFingerprint("hf-bpe", pieces, 1, 2, 0, 0), base);
  EXPECT_NE(ComputeVocabFingerprint("hf-bpe", {"<unk>", "<s>", "</s>", "b"}, 1,
                                    2, 0, -1),
            base);
  // Length prefixes keep piece boundaries: ["ab", ""] != ["a", "b"].
  EXPECT_NE(ComputeVocabFingerprint("k", {"ab", ""}, -1, -1, -1, -1),
            ComputeVocabFingerprint("k", {"a", "b"}, -1, -1, -1, -1));
}

std::string TinyJson(const std::string& merges, const std::string& extra_vocab,
                     bool byte_fallback = true);

// A tiny HF tokenizer with a full set of byte pieces (unlike
// tinystories-656K), for the byte-fallback paths of the decoder.
std::unique_ptr<Tokenizer> TinyHf() {
  auto tok = HfBpeTokenizer::Parse(
      TinyJson(R"("▁ a", "b c", "▁a bc", "▁ ▁")",
               R"(, "▁a": 10, "bc": 11, "▁abc": 12, "▁▁": 13, "H": 14,
                  "i": 15, "o": 16, "k": 17)"),
      "", "tiny");
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

// Tokenizers with byte pieces: both sentencepiece models and TinyHf().
std::vector<std::unique_ptr<Tokenizer>> ByteFallbackTokenizers() {
  std::vector<std::unique_ptr<Tokenizer>> out;
  for (const char* model : kSpmModels) out.push_back(MustLoad(model));
  out.push_back(TinyHf());
  return out;
}

TEST(IncrementalDecoderTest, MatchesFullDecodeOnGoldenSequences) {
  for (const char* model : kAllModels) {
    std::unique_ptr<Tokenizer> tok = MustLoad(model);
    ASSERT_NE(tok, nullptr);
    const std::string name = std::string(model).substr(7);
    std::vector<std::vector<int>> seqs = GoldenIdSequences(name);
    for (const GoldenPrompt& p : GoldenPrompts(name)) {
      seqs.push_back(p.ids);
      for (const std::string& doc : p.docs) {
        seqs.push_back(*tok->Encode(doc, false));
      }
    }
    for (const std::string& f : PromptFiles()) {
      seqs.push_back(*tok->Encode(ReadFile(f), true));
    }
    for (const std::string& t :
         {std::string(kUnicodeText), std::string("x ") + kUnicodeText + "\n",
          std::string("  leading and  double  spaces "),
          std::string("\xF0\x9F\x99\x82\xF0\x9F\x99\x82 ok")}) {
      seqs.push_back(*tok->Encode(t, true));
      seqs.push_back(*tok->Encode(t, false));
    }
    for (const std::vector<int>& ids : seqs) {
      EXPECT_EQ(StreamDecode(*tok, ids), *tok->Decode(ids)) << model;
    }
  }
}

TEST(IncrementalDecoderTest, MatchesFullDecodeOnRandomIds) {
  // Arbitrary ids stress the corner cases: control tokens mid-text, lone
  // "▁" pieces, byte pieces that never form valid UTF-8.
  std::mt19937 rng(1234);
  std::vector<std::unique_ptr<Tokenizer>> toks;
  for (const char* model : kAllModels) toks.push_back(MustLoad(model));
  toks.push_back(TinyHf());
  for (const std::unique_ptr<Tokenizer>& tok : toks) {
    ASSERT_NE(tok, nullptr);
    // Bias towards byte pieces, specials and pure-space pieces.
    std::vector<int> hard;
    for (int id = 0; id < tok->vocab_size(); ++id) {
      const std::string piece = *tok->IdToPiece(id);
      if ((piece.size() == 6 && absl::StartsWith(piece, "<0x")) ||
          piece == "\xE2\x96\x81" || piece == "\xE2\x96\x81\xE2\x96\x81" ||
          id == tok->bos_id() || id == tok->eos_id() || id == tok->unk_id()) {
        hard.push_back(id);
      }
    }
    ASSERT_GE(hard.size(), 3u);
    std::uniform_int_distribution<int> any(0, tok->vocab_size() - 1);
    std::uniform_int_distribution<int> pick(0, hard.size() - 1);
    std::uniform_int_distribution<int> len(0, 40);
    for (int trial = 0; trial < 500; ++trial) {
      std::vector<int> ids(len(rng));
      for (int& id : ids) id = (rng() % 2) ? any(rng) : hard[pick(rng)];
      EXPECT_EQ(StreamDecode(*tok, ids), *tok->Decode(ids))
          << tok->kind() << " trial " << trial;
    }
  }
}

TEST(IncrementalDecoderTest, HoldsBackSplitCharactersAndKeepsSpaces) {
  for (const std::unique_ptr<Tokenizer>& tok : ByteFallbackTokenizers()) {
    ASSERT_NE(tok, nullptr);
    const std::vector<int> ids =
        *tok->Encode("Hi \xF0\x9F\x99\x82", /*add_bos=*/true);
    std::vector<std::string> deltas;
    const std::string all = StreamDecode(*tok, ids, &deltas);
    EXPECT_EQ(all, "Hi \xF0\x9F\x99\x82");
    // The emoji's four byte pieces are the last ids: nothing until the
    // fourth completes it, then the whole character at once.
    ASSERT_GE(deltas.size(), 5u);
    const size_t n = deltas.size();
    EXPECT_EQ(deltas[n - 4], "");
    EXPECT_EQ(deltas[n - 3], "");
    EXPECT_EQ(deltas[n - 2], "");
    EXPECT_TRUE(absl::EndsWith(deltas[n - 1], "\xF0\x9F\x99\x82"));
    // No delta is ever a partial UTF-8 sequence or U+FFFD.
    for (const std::string& d : deltas) {
      EXPECT_EQ(d.find("\xEF\xBF\xBD"), std::string::npos);
    }
  }
  for (const char* model : kAllModels) {
    std::unique_ptr<Tokenizer> tok = MustLoad(model);
    ASSERT_NE(tok, nullptr);
    // The first word has no leading space; later words keep theirs.
    const std::vector<int> words = *tok->Encode("Once upon a time", true);
    std::vector<std::string> deltas;
    EXPECT_EQ(StreamDecode(*tok, words, &deltas), "Once upon a time");
    std::string so_far;
    for (const std::string& d : deltas) {
      so_far += d;
      EXPECT_TRUE(absl::StartsWith("Once upon a time", so_far)) << so_far;
    }
  }
}

TEST(IncrementalDecoderTest, FlushEmitsAnIncompleteTail) {
  for (const std::unique_ptr<Tokenizer>& tok : ByteFallbackTokenizers()) {
    ASSERT_NE(tok, nullptr);
    std::vector<int> ids = *tok->Encode("ok \xF0\x9F\x99\x82", false);
    ids.pop_back();  // Drop the emoji's last byte.
    IncrementalDecoder dec(tok.get());
    std::string streamed;
    for (int id : ids) streamed += *dec.Append(id);
    // The partial emoji is held back...
    EXPECT_TRUE(absl::StartsWith(streamed, "ok")) << streamed;
    EXPECT_EQ(streamed.find("\xEF\xBF\xBD"), std::string::npos);
    // ...and Flush emits it as replacement characters.
    const std::string tail = dec.Flush();
    EXPECT_TRUE(absl::EndsWith(tail, "\xEF\xBF\xBD")) << tail;
    EXPECT_EQ(streamed + tail, *tok->Decode(ids));
    EXPECT_EQ(dec.Flush(), "");
  }
}

// --- HfBpeTokenizer on small hand-written tokenizer.json files ---

// A sentencepiece-style tokenizer.json (the structure transformers exports
// for Llama) over a tiny vocabulary with all 256 byte pieces (ids 100..355).
std::string TinyJson(const std::string& merges, const std::string& extra_vocab,
                     bool byte_fallback) {
  std::string bytes;
  for (int b = 0; b < 256; ++b) {
    bytes +=
        absl::StrCat(",\"<0x", absl::Hex(b, absl::kZeroPad2), ">\":", 100 + b);
  }
  // absl::Hex prints lowercase; the byte pieces are uppercase.
  for (char& c : bytes) {
    if (c >= 'a' && c <= 'f') c = c - 'a' + 'A';
  }
  return absl::StrCat(R"({
    "added_tokens": [
      {"id": 0, "content": "<unk>", "special": true, "normalized": false},
      {"id": 1, "content": "<s>", "special": true, "normalized": false},
      {"id": 2, "content": "</s>", "special": true, "normalized": false}],
    "normalizer": {"type": "Sequence", "normalizers": [
      {"type": "Prepend", "prepend": "▁"},
      {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
    "pre_tokenizer": null,
    "post_processor": {"type": "TemplateProcessing", "single": [
      {"SpecialToken": {"id": "<s>", "type_id": 0}},
      {"Sequence": {"id": "A", "type_id": 0}}]},
    "decoder": {"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
      {"type": "ByteFallback"}, {"type": "Fuse"},
      {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
      "fuse_unk": true, "byte_fallback": )",
                      byte_fallback ? "true" : "false", R"(,
      "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "b": 5,
                "c": 6)",
                      bytes, extra_vocab, R"(},
      "merges": [)",
                      merges, "]}}");
}

std::vector<std::string> Pieces(const Tokenizer& tok, const std::string& text) {
  const std::vector<int> ids = *tok.Encode(text, false);
  std::vector<std::string> out;
  for (int id : ids) out.push_back(*tok.IdToPiece(id));
  return out;
}

TEST(HfBpeTokenizerTest, MergesByRankNotByPosition) {
  // "b c" outranks "a b": "abc" -> a + bc, although "a b" comes first in
  // the text; then "▁ a" can still apply.
  auto tok = HfBpeTokenizer::Parse(
      TinyJson(R"("b c", "a b", "▁ a")", R"(, "bc": 10, "ab": 11, "▁a": 12)"),
      "", "tiny");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT(Pieces(**tok, "abc"), ElementsAre("▁a", "bc"));
  // With "a b" ranked first the same text splits the other way.
  tok = HfBpeTokenizer::Parse(TinyJson(R"(["a", "b"], ["b", "c"], ["ab", "c"])",
                                       R"(, "bc": 10, "ab": 11, "abc": 12)"),
                              "", "tiny");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT(Pieces(**tok, "abc"), ElementsAre("▁", "abc"));
  EXPECT_EQ((*tok)->bos_id(), 1);  // From the post_processor template.
  EXPECT_EQ((*tok)->eos_id(), 2);  // "</s>" by name.
  EXPECT_EQ((*tok)->unk_id(), 0);
  EXPECT_EQ((*tok)->pad_id(), -1);
}

TEST(HfBpeTokenizerTest, EqualRanksMergeLeftmostFirst) {
  auto tok =
      HfBpeTokenizer::Parse(TinyJson(R"("a a")", R"(, "aa": 10)"), "", "tiny");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT(Pieces(**tok, "aaa"), ElementsAre("▁", "aa", "a"));
  EXPECT_THAT(Pieces(**tok, "aaaa"), ElementsAre("▁", "aa", "aa"));
}

TEST(HfBpeTokenizerTest, UnknownCharactersUseBytesOrFusedUnk) {
  auto tok = HfBpeTokenizer::Parse(TinyJson("", ""), "", "tiny");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT(Pieces(**tok, "a\xC3\xA9"),
              ElementsAre("▁", "a", "<0xC3>", "<0xA9>"));
  EXPECT_EQ(*(*tok)->Decode(*(*tok)->Encode("a\xC3\xA9 b", true)),
            "a\xC3\xA9 b");
  // Without byte fallback, a run of unknown characters fuses into one <unk>,
  // which (being special) decodes to nothing.
  tok = HfBpeTokenizer::Parse(TinyJson("", "", /*byte_fallback=*/false), "",
                              "tiny");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT(Pieces(**tok, "axyb"), ElementsAre("▁", "a", "<unk>", "b"));
  EXPECT_EQ(*(*tok)->Decode(*(*tok)->Encode("axyb", false)), "ab");
}

TEST(HfBpeTokenizerTest, WarnsAtLoadWhenByteFallbackHasNoBytePieces) {
  // tinystories-656K sets byte_fallback but has no <0xNN> pieces, so
  // non-ASCII text becomes <unk>: Load says so.
  for (const char* model : kHfModels) {
    const std::string path = absl::StrCat(model, "/tokenizer.json");
    ::testing::internal::CaptureStderr();
    auto tok = HfBpeTokenizer::Load(path);
    const std::string err = ::testing::internal::GetCapturedStderr();
    ASSERT_TRUE(tok.ok()) << tok.status();
    EXPECT_TRUE((*tok)->byte_fallback()) << model;
    EXPECT_EQ((*tok)->byte_piece_count(), 0) << model;
    EXPECT_THAT(err, HasSubstr("warning: " + path)) << err;
    EXPECT_THAT(err, HasSubstr("byte_fallback")) << err;
    EXPECT_THAT(err, HasSubstr("become <unk>")) << err;
    EXPECT_THAT(*(*tok)->Encode("caf\xC3\xA9", false),
                ::testing::Contains((*tok)->unk_id()))
        << model;
  }
  // All 256 byte pieces: byte fallback works and Load is silent.
  const std::string dir = MakeTempDir("with_byte_pieces");
  WriteFile(dir + "/tokenizer.json", TinyJson("", "", true));
  ::testing::internal::CaptureStderr();
  auto tok = HfBpeTokenizer::Load(dir + "/tokenizer.json");
  std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_TRUE((*tok)->byte_fallback());
  EXPECT_EQ((*tok)->byte_piece_count(), 256);
  EXPECT_EQ(err, "");
  // Byte pieces without byte_fallback: nothing to warn about either.
  WriteFile(dir + "/tokenizer.json", TinyJson("", "", false));
  ::testing::internal::CaptureStderr();
  tok = HfBpeTokenizer::Load(dir + "/tokenizer.json");
  err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_FALSE((*tok)->byte_fallback());
  EXPECT_EQ(err, "");
}

TEST(HfBpeTokenizerTest, SplitsOnAddedTokens) {
  auto tok = HfBpeTokenizer::Parse(TinyJson("", ""), "", "tiny");
  ASSERT_TRUE(tok.ok()) << tok.status();
  // Non-normalized specials match in the raw text; each remaining piece is
  // normalized on its own (so "b" gets its own "▁").
  EXPECT_THAT(*(*tok)->Encode("a</s>b", false), ElementsAre(3, 4, 2, 3, 5));
  EXPECT_EQ(*(*tok)->Decode({3, 4, 2, 3, 5}), "a b");
}

TEST(HfBpeTokenizerTest, InvalidByteRunsDecodeToReplacementPerByte) {
  auto tok = HfBpeTokenizer::Parse(TinyJson("", ""), "", "tiny");
  ASSERT_TRUE(tok.ok()) << tok.status();
  // <0xE6><0x97> is a truncated 3-byte sequence, then "a".
  EXPECT_EQ(*(*tok)->Decode({4, 100 + 0xE6, 100 + 0x97, 4}),
            "a\xEF\xBF\xBD\xEF\xBF\xBD"
            "a");
  // Valid bytes before an invalid one survive.
  EXPECT_EQ(*(*tok)->Decode({100 + 0xC3, 100 + 0xA9, 100 + 0xFF}),
            "\xC3\xA9\xEF\xBF\xBD");
}

// The Metaspace pre-tokenizer form (Mistral-style exports): spaces become
// "▁", a "▁" is prepended, and with split=true each "▁" starts a new word,
// so no merge crosses a word boundary.
std::string MetaspaceJson(bool split) {
  return absl::StrCat(R"({
    "added_tokens": [{"id": 0, "content": "<unk>", "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "Metaspace", "replacement": "▁",
                      "prepend_scheme": "first", "split": )",
                      split ? "true" : "false", R"(},
    "decoder": {"type": "Metaspace", "replacement": "▁",
                "prepend_scheme": "first", "split": true},
    "model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": false,
      "vocab": {"<unk>": 0, "▁": 1, "a": 2, "b": 3, "a▁": 4, "▁b": 5},
      "merges": ["a ▁", "▁ b"]}})");
}

TEST(HfBpeTokenizerTest, MetaspacePreTokenizer) {
  auto split = HfBpeTokenizer::Parse(MetaspaceJson(true), "", "meta");
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_THAT(Pieces(**split, "a b"), ElementsAre("▁", "a", "▁b"));
  EXPECT_EQ(*(*split)->Decode(*(*split)->Encode("a b", true)), "a b");
  EXPECT_EQ((*split)->bos_id(), -1);  // No BOS anywhere: add_bos is a no-op.
  EXPECT_THAT(*(*split)->Encode("b", true), ElementsAre(5));
  auto whole = HfBpeTokenizer::Parse(MetaspaceJson(false), "", "meta");
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_THAT(Pieces(**whole, "a b"), ElementsAre("▁", "a▁", "b"));
  EXPECT_EQ(*(*whole)->Decode(*(*whole)->Encode("a b", false)), "a b");
}

TEST(HfBpeTokenizerTest, LongPromptsEncodeInNearLinearTime) {
  std::unique_ptr<Tokenizer> tok = MustLoad("models/tinystories-656K");
  ASSERT_NE(tok, nullptr);
  // One "word" of ~200k characters: the whole prompt is a single BPE word
  // with this normalizer, so quadratic merging would take minutes.
  std::string text;
  for (const std::string& f : PromptFiles()) {
    const std::string t = ReadFile(f);
    if (IsAscii(t)) text += t;  // The vocabulary is ASCII only.
  }
  while (text.size() < 200000) text += text;
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<int>> ids = tok->Encode(text, true);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*tok->Decode(*ids), text);
  EXPECT_LT(secs, 10.0);
}

}  // namespace
}  // namespace specserve
