#include "common/tokenizer/spm_builtin.h"

#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/tokenizer/spm_model.pb.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

namespace pb = ::specserve::spm_model;
using Sp = pb::ModelProto::SentencePiece;

// A BPE model: <unk>, <s>, </s>, optionally the 256 byte pieces, then
// `normal` (piece, score) pairs; "▁" as U+2581.
pb::ModelProto MakeModel(
    const std::vector<std::pair<std::string, float>>& normal,
    bool byte_fallback = true) {
  pb::ModelProto m;
  m.mutable_trainer_spec()->set_model_type(pb::TrainerSpec::BPE);
  m.mutable_trainer_spec()->set_byte_fallback(byte_fallback);
  m.mutable_normalizer_spec()->set_name("identity");
  const auto add = [&](const std::string& piece, float score, Sp::Type type) {
    Sp* p = m.add_pieces();
    p->set_piece(piece);
    p->set_score(score);
    p->set_type(type);
  };
  add("<unk>", 0, Sp::UNKNOWN);
  add("<s>", 0, Sp::CONTROL);
  add("</s>", 0, Sp::CONTROL);
  if (byte_fallback) {
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      add(name, 0, Sp::BYTE);
    }
  }
  for (const auto& [piece, score] : normal) add(piece, score, Sp::NORMAL);
  return m;
}

std::unique_ptr<BuiltinSpmTokenizer> Make(const pb::ModelProto& m) {
  absl::StatusOr<std::unique_ptr<BuiltinSpmTokenizer>> t =
      BuiltinSpmTokenizer::Parse(m.SerializeAsString(), "test.model");
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

// Pieces of Encode(text).
std::vector<std::string> Pieces(const BuiltinSpmTokenizer& t,
                                const std::string& text) {
  std::vector<std::string> out;
  const std::vector<int> ids = *t.Encode(text, false);
  for (int id : ids) out.push_back(*t.IdToPiece(id));
  return out;
}

using V = std::vector<std::string>;

TEST(BuiltinSpmTest, MergesTheHighestScoringPairFirst) {
  auto bc_wins = Make(MakeModel(
      {{"\u2581", -1}, {"a", -2}, {"b", -3}, {"c", -4}, {"ab", -6}, {"bc", -5}}));
  EXPECT_EQ(Pieces(*bc_wins, "abc"), (V{"\u2581", "a", "bc"}));
  auto ab_wins = Make(MakeModel(
      {{"\u2581", -1}, {"a", -2}, {"b", -3}, {"c", -4}, {"ab", -5}, {"bc", -6}}));
  EXPECT_EQ(Pieces(*ab_wins, "abc"), (V{"\u2581", "ab", "c"}));
}

TEST(BuiltinSpmTest, EqualScoresMergeLeftmostFirst) {
  auto t = Make(MakeModel({{"\u2581", -1}, {"a", -2}, {"aa", -3}}));
  EXPECT_EQ(Pieces(*t, "aaa"), (V{"\u2581", "aa", "a"}));
  EXPECT_EQ(Pieces(*t, "aaaa"), (V{"\u2581", "aa", "aa"}));
}

TEST(BuiltinSpmTest, MergesChainThroughNewPairs) {
  auto t = Make(MakeModel({{"\u2581", -1},
                           {"a", -2},
                           {"b", -3},
                           {"\u2581a", -4},
                           {"\u2581ab", -5}}));
  EXPECT_EQ(Pieces(*t, "ab"), (V{"\u2581ab"}));
  EXPECT_EQ(Pieces(*t, "ab ab"), (V{"\u2581ab", "\u2581ab"}));
}

TEST(BuiltinSpmTest, UnusedPiecesAreSplitBack) {
  pb::ModelProto m = MakeModel(
      {{"\u2581", -1}, {"a", -2}, {"b", -3}, {"c", -4}, {"ab", -5}, {"abc", -6}});
  m.mutable_pieces(m.pieces_size() - 2)->set_type(Sp::UNUSED);  // "ab"
  auto t = Make(m);
  EXPECT_EQ(Pieces(*t, "abc"), (V{"\u2581", "abc"}));
  EXPECT_EQ(Pieces(*t, "ab"), (V{"\u2581", "a", "b"}));
}

TEST(BuiltinSpmTest, NormalizesWhitespace) {
  auto t = Make(MakeModel({{"\u2581", -1}, {"a", -2}}));
  EXPECT_EQ(t->Normalize("  a   b  "), "\u2581a\u2581b");
  EXPECT_EQ(t->Normalize("a\tb"), "\u2581a\tb");
  EXPECT_EQ(t->Normalize("   "), "");
  EXPECT_EQ(t->Normalize(""), "");
  // A literal U+2581 at the end is trailing whitespace too.
  EXPECT_EQ(t->Normalize("a \u2581"), "\u2581a");
  EXPECT_EQ(t->Normalize("a\xFF"), "\u2581a\uFFFD");

  pb::ModelProto m = MakeModel({{"\u2581", -1}, {"a", -2}});
  m.mutable_normalizer_spec()->set_remove_extra_whitespaces(false);
  m.mutable_normalizer_spec()->set_add_dummy_prefix(false);
  auto keep = Make(m);
  EXPECT_EQ(keep->Normalize(" a  "), "\u2581a\u2581\u2581");
}

TEST(BuiltinSpmTest, ByteFallbackForUnknownCharacters) {
  auto t = Make(MakeModel({{"\u2581", -1}, {"a", -2}}));
  EXPECT_EQ(Pieces(*t, "a\u00e9"), (V{"\u2581", "a", "<0xC3>", "<0xA9>"}));
  EXPECT_EQ(*t->Decode(*t->Encode("a\u00e9", false)), "a\u00e9");
  // An invalid byte is normalized to U+FFFD first.
  EXPECT_EQ(Pieces(*t, "\xFF"), (V{"\u2581", "<0xEF>", "<0xBF>", "<0xBD>"}));
}

TEST(BuiltinSpmTest, AdjacentUnknownsMergeWithoutByteFallback) {
  auto t = Make(MakeModel({{"\u2581", -1}, {"a", -2}}, false));
  EXPECT_EQ(*t->Encode("a\u00e9\u00e9a\u00e9", false),
            (std::vector<int>{3, 4, 0, 4, 0}));
  EXPECT_EQ(*t->Decode({3, 4, 0}), "a \u2047 ");
}

TEST(BuiltinSpmTest, DecodeRules) {
  auto t = Make(MakeModel({{"\u2581", -1}, {"\u2581a", -2}, {"b", -3}}));
  const int sa = 3 + 256 + 1;
  const int b = sa + 1;
  EXPECT_EQ(*t->Decode({1, sa, b, sa, 2}), "ab a");
  // Byte pieces: valid UTF-8 joins across pieces; a bad byte is one U+FFFD.
  const int c3 = 3 + 0xC3, a9 = 3 + 0xA9, ff = 3 + 0xFF;
  EXPECT_EQ(*t->Decode({c3, a9, ff, c3}), "\u00e9\uFFFD\uFFFD");
  EXPECT_EQ(*t->Encode("ab", true), (std::vector<int>{1, sa, b}));
  EXPECT_EQ(t->Decode({-1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t->Decode({t->vocab_size()}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t->bos_id(), 1);
  EXPECT_EQ(t->eos_id(), 2);
  EXPECT_EQ(t->unk_id(), 0);
  EXPECT_EQ(t->pad_id(), -1);
}

TEST(BuiltinSpmTest, RejectsWhatItDoesNotImplement) {
  pb::ModelProto unigram = MakeModel({{"a", -1}});
  unigram.mutable_trainer_spec()->set_model_type(pb::TrainerSpec::UNIGRAM);
  auto u = BuiltinSpmTokenizer::Parse(unigram.SerializeAsString(), "u.model");
  EXPECT_EQ(u.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(u.status().message().find("UNIGRAM"), std::string::npos);
  EXPECT_NE(u.status().message().find("u.model"), std::string::npos);

  pb::ModelProto nfkc = MakeModel({{"a", -1}});
  nfkc.mutable_normalizer_spec()->set_name("nmt_nfkc");
  nfkc.mutable_normalizer_spec()->set_precompiled_charsmap("\x01\x02");
  auto n = BuiltinSpmTokenizer::Parse(nfkc.SerializeAsString(), "n.model");
  EXPECT_EQ(n.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(n.status().message().find("nmt_nfkc"), std::string::npos);
}

TEST(BuiltinSpmTest, RejectsMalformedModels) {
  EXPECT_EQ(BuiltinSpmTokenizer::Parse("\xFF\xFF\xFF", "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuiltinSpmTokenizer::Parse("", "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  pb::ModelProto no_unk = MakeModel({{"a", -1}});
  no_unk.mutable_pieces(0)->set_type(Sp::NORMAL);
  EXPECT_EQ(BuiltinSpmTokenizer::Parse(no_unk.SerializeAsString(), "x")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  pb::ModelProto dup = MakeModel({{"a", -1}, {"a", -2}});
  EXPECT_EQ(
      BuiltinSpmTokenizer::Parse(dup.SerializeAsString(), "x").status().code(),
      absl::StatusCode::kInvalidArgument);
  pb::ModelProto bytes_without_fallback = MakeModel({{"a", -1}});
  bytes_without_fallback.mutable_trainer_spec()->set_byte_fallback(false);
  EXPECT_EQ(BuiltinSpmTokenizer::Parse(
                bytes_without_fallback.SerializeAsString(), "x")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuiltinSpmTokenizer::Load("/nonexistent/tokenizer.model")
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

TEST(BuiltinSpmTest, LoadsStories260K) {
  auto t = BuiltinSpmTokenizer::Load("models/stories260K/tokenizer.model");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->vocab_size(), 512);
  EXPECT_EQ((*t)->bos_id(), 1);
  EXPECT_EQ((*t)->eos_id(), 2);
  const std::string text = "Once upon a time, there was a little girl.";
  EXPECT_EQ(*(*t)->Decode(*(*t)->Encode(text, true)), text);
}

}  // namespace
}  // namespace specserve
