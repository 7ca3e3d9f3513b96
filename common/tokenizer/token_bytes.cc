#include "common/tokenizer/token_bytes.h"

#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/tokenizer/byte_level.h"

namespace specserve {
namespace {

constexpr absl::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// "<0xAB>" -> 0xAB; -1 for any other piece.
int BytePiece(absl::string_view piece) {
  if (piece.size() != 6 || !absl::StartsWith(piece, "<0x") ||
      piece[5] != '>') {
    return -1;
  }
  char* end = nullptr;
  const std::string hex(piece.substr(3, 2));
  const long v = std::strtol(hex.c_str(), &end, 16);
  return end == hex.c_str() + 2 ? static_cast<int>(v) : -1;
}

}  // namespace

absl::StatusOr<TokenByteTable> BuildTokenByteTable(
    const Tokenizer& tokenizer) {
  absl::StatusOr<std::vector<int>> a = tokenizer.Encode("a", false);
  if (!a.ok() || a->empty()) {
    return absl::InternalError("token bytes: the tokenizer cannot encode \"a\"");
  }
  const int anchor = a->back();
  absl::StatusOr<std::string> base = tokenizer.Decode({anchor});
  if (!base.ok()) return base.status();
  const int vocab = tokenizer.vocab_size();
  TokenByteTable t;
  t.bytes.resize(vocab);
  t.special.assign(vocab, false);
  for (int id = 0; id < vocab; ++id) {
    absl::StatusOr<std::string> text = tokenizer.Decode({anchor, id});
    if (!text.ok()) return text.status();
    if (!absl::StartsWith(*text, *base)) {
      return absl::InternalError(absl::StrCat(
          "token bytes: decoding id ", id, " after the anchor changed it"));
    }
    std::string bytes = text->substr(base->size());
    if (absl::StrContains(bytes, kReplacement)) {
      // Part of a character: the piece's raw byte(s).
      absl::StatusOr<std::string> piece = tokenizer.IdToPiece(id);
      if (!piece.ok()) return piece.status();
      std::string raw;
      if (const int b = BytePiece(*piece); b >= 0) {
        bytes.assign(1, static_cast<char>(b));
      } else if (ByteLevelDecode(*piece, &raw)) {
        bytes = std::move(raw);
      }
    }
    // Control ids add no text; unk would add sentencepiece's " ⁇ ".
    t.special[id] = bytes.empty() || id == tokenizer.unk_id() ||
                    id == tokenizer.bos_id() || id == tokenizer.eos_id() ||
                    id == tokenizer.pad_id();
    if (t.special[id]) bytes.clear();
    t.bytes[id] = std::move(bytes);
  }
  return t;
}

}  // namespace specserve
