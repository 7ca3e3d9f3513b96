#include "common/tokenizer/spm_builtin.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <queue>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/tokenizer/spm_model.pb.h"
#include "common/tokenizer/utf8.h"

namespace specserve {
namespace {

namespace pb = ::specserve::spm_model;

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581 "▁"

// Debian's Abseil has its own absl::string_view (not std's).
absl::string_view Sv(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

bool StartsWith(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(0, p.size()) == p;
}
bool EndsWith(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

// Byte length of the UTF-8 character starting with `lead` (1 for a stray
// continuation byte), as sentencepiece splits normalized text.
size_t OneCharLen(unsigned char lead) {
  if (lead < 0xC0) return 1;
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  return 4;
}

// A candidate merge of symbols `left` and `right` for the agenda.
struct Pair {
  int left;
  int right;
  float score;
  size_t size;  // Byte length of the merged piece, to detect stale entries.
};

// Max-heap order: higher score first, then the leftmost pair.
struct PairLess {
  bool operator()(const Pair& a, const Pair& b) const {
    if (a.score != b.score) return a.score < b.score;
    return a.left > b.left;
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<BuiltinSpmTokenizer>> BuiltinSpmTokenizer::Load(
    const std::string& model_path) {
  std::ifstream in(model_path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot open sentencepiece model ", model_path));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) {
    return absl::DataLossError(absl::StrCat("cannot read ", model_path));
  }
  return Parse(ss.str(), model_path);
}

absl::StatusOr<std::unique_ptr<BuiltinSpmTokenizer>>
BuiltinSpmTokenizer::Parse(std::string_view bytes, const std::string& name) {
  std::unique_ptr<BuiltinSpmTokenizer> t(new BuiltinSpmTokenizer(name));
  absl::Status s = t->Init(bytes);
  if (!s.ok()) return s;
  return t;
}

absl::Status BuiltinSpmTokenizer::Init(std::string_view bytes) {
  const auto invalid = [&](std::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("sentencepiece model ", name_, ": ", Sv(what)));
  };
  pb::ModelProto model;
  if (!model.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return invalid("not a serialized sentencepiece ModelProto");
  }
  if (model.pieces_size() == 0) return invalid("no pieces");
  const pb::TrainerSpec& trainer = model.trainer_spec();
  const pb::NormalizerSpec& norm = model.normalizer_spec();
  if (trainer.model_type() != pb::TrainerSpec::BPE) {
    return absl::UnimplementedError(absl::StrCat(
        "sentencepiece model ", name_, ": model_type ",
        pb::TrainerSpec::ModelType_Name(trainer.model_type()),
        " is not supported by the built-in tokenizer (only BPE; build "
        "without --define=spm=builtin to use libsentencepiece)"));
  }
  if (!norm.precompiled_charsmap().empty()) {
    return absl::UnimplementedError(absl::StrCat(
        "sentencepiece model ", name_, ": normalization rule '", norm.name(),
        "' is not supported by the built-in tokenizer (only identity)"));
  }
  if (trainer.treat_whitespace_as_suffix()) {
    return absl::UnimplementedError(
        absl::StrCat("sentencepiece model ", name_,
                     ": treat_whitespace_as_suffix is not supported by the "
                     "built-in tokenizer"));
  }

  byte_fallback_ = trainer.byte_fallback();
  add_dummy_prefix_ = norm.add_dummy_prefix();
  remove_extra_whitespaces_ = norm.remove_extra_whitespaces();
  escape_whitespaces_ = norm.escape_whitespaces();
  unk_surface_ = trainer.unk_surface();

  pieces_.reserve(model.pieces_size());
  for (int id = 0; id < model.pieces_size(); ++id) {
    const pb::ModelProto::SentencePiece& p = model.pieces(id);
    Piece piece{p.piece(), p.score(), Type::kNormal};
    switch (p.type()) {
      case pb::ModelProto::SentencePiece::NORMAL:
        piece.type = Type::kNormal;
        break;
      case pb::ModelProto::SentencePiece::UNKNOWN:
        piece.type = Type::kUnknown;
        break;
      case pb::ModelProto::SentencePiece::CONTROL:
        piece.type = Type::kControl;
        break;
      case pb::ModelProto::SentencePiece::USER_DEFINED:
        piece.type = Type::kUserDefined;
        break;
      case pb::ModelProto::SentencePiece::UNUSED:
        piece.type = Type::kUnused;
        break;
      case pb::ModelProto::SentencePiece::BYTE:
        piece.type = Type::kByte;
        break;
    }
    if (piece.text.empty()) {
      return invalid(absl::StrCat("piece ", id, " is empty"));
    }
    const bool mergeable = piece.type == Type::kNormal ||
                           piece.type == Type::kUserDefined ||
                           piece.type == Type::kUnused;
    if (!(mergeable ? mergeable_ : reserved_).emplace(piece.text, id).second) {
      return invalid(absl::StrCat("piece '", piece.text, "' (id ", id,
                                  ") is defined twice"));
    }
    if (piece.type == Type::kUserDefined) {
      user_defined_.push_back(piece.text);
      max_user_defined_len_ = std::max(max_user_defined_len_, piece.text.size());
    }
    if (piece.type == Type::kUnknown) {
      if (unk_piece_id_ >= 0) return invalid("more than one unknown piece");
      unk_piece_id_ = id;
    }
    if (piece.type == Type::kByte) {
      unsigned char b;
      if (!byte_fallback_) {
        return invalid(absl::StrCat("byte piece '", piece.text,
                                    "' in a model without byte_fallback"));
      }
      if (!ParseBytePiece(piece.text, &b)) {
        return invalid(
            absl::StrCat("byte piece '", piece.text, "' is not <0xXX>"));
      }
    }
    pieces_.push_back(std::move(piece));
  }
  if (unk_piece_id_ < 0) return invalid("no unknown (<unk>) piece");
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    byte_ids_[b] = PieceToId(name);
  }

  // As the library: a special id is -1 unless its piece exists with the
  // right type.
  const auto special = [&](const std::string& piece, Type type) {
    const int id = PieceToId(piece);
    return pieces_[id].type == type ? id : -1;
  };
  unk_id_ = special(trainer.unk_piece(), Type::kUnknown);
  bos_id_ = special(trainer.bos_piece(), Type::kControl);
  eos_id_ = special(trainer.eos_piece(), Type::kControl);
  pad_id_ = special(trainer.pad_piece(), Type::kControl);

  std::vector<std::string> texts;
  texts.reserve(pieces_.size());
  for (const Piece& p : pieces_) texts.push_back(p.text);
  fingerprint_ = ComputeVocabFingerprint(kind(), texts, bos_id_, eos_id_,
                                         unk_id_, pad_id_);
  return absl::OkStatus();
}

int BuiltinSpmTokenizer::PieceToId(std::string_view piece) const {
  auto it = reserved_.find(Sv(piece));
  if (it != reserved_.end()) return it->second;
  it = mergeable_.find(Sv(piece));
  if (it != mergeable_.end()) return it->second;
  return unk_piece_id_;
}

size_t BuiltinSpmTokenizer::UserDefinedPrefix(std::string_view s) const {
  size_t best = 0;
  if (user_defined_.empty()) return 0;
  for (const std::string& u : user_defined_) {
    if (u.size() > best && StartsWith(s, u)) best = u.size();
  }
  return best;
}

std::string BuiltinSpmTokenizer::Normalize(std::string_view text) const {
  // The next normalized unit at text[i]: a USER_DEFINED piece as is, a valid
  // UTF-8 character as is, or U+FFFD for one invalid byte.
  const auto next = [&](size_t i, std::string_view* unit) -> size_t {
    const std::string_view rest = text.substr(i);
    if (const size_t n = UserDefinedPrefix(rest); n > 0) {
      *unit = rest.substr(0, n);
      return n;
    }
    const size_t n = ValidUtf8Len(text, i);
    if (n == 0) {
      *unit = kReplacementChar;
      return 1;
    }
    *unit = rest.substr(0, n);
    return n;
  };
  const std::string_view space = escape_whitespaces_ ? kSpaceSymbol : " ";
  std::string out;
  size_t i = 0;
  std::string_view unit;
  if (remove_extra_whitespaces_) {
    while (i < text.size()) {
      const size_t n = next(i, &unit);
      if (unit != " ") break;
      i += n;
    }
  }
  if (i == text.size()) return out;
  out.reserve(text.size() * 3 / 2 + 3);
  if (add_dummy_prefix_) out.append(space);
  bool prev_space = remove_extra_whitespaces_;
  while (i < text.size()) {
    const size_t n = next(i, &unit);
    if (prev_space) {
      while (StartsWith(unit, " ")) unit.remove_prefix(1);
    }
    if (!unit.empty()) {
      for (char c : unit) {
        if (c == ' ' && escape_whitespaces_) {
          out.append(kSpaceSymbol);
        } else {
          out.push_back(c);
        }
      }
      prev_space = EndsWith(unit, " ");
    }
    i += n;
    prev_space = prev_space && remove_extra_whitespaces_;
  }
  if (remove_extra_whitespaces_) {
    while (EndsWith(out, space)) out.resize(out.size() - space.size());
  }
  return out;
}

std::vector<BuiltinSpmTokenizer::Token> BuiltinSpmTokenizer::Bpe(
    std::string_view normalized) const {
  struct Symbol {
    size_t begin;
    size_t len;  // 0 once merged into its left neighbour.
    int prev;
    int next;
    bool frozen;  // USER_DEFINED: never merged.
  };
  std::vector<Symbol> symbols;
  for (size_t i = 0; i < normalized.size();) {
    size_t n = UserDefinedPrefix(normalized.substr(i));
    const bool frozen = n > 0;
    if (!frozen) {
      n = std::min(OneCharLen(static_cast<unsigned char>(normalized[i])),
                   normalized.size() - i);
    }
    const int index = static_cast<int>(symbols.size());
    symbols.push_back(Symbol{i, n, index - 1,
                             i + n < normalized.size() ? index + 1 : -1,
                             frozen});
    i += n;
  }
  const auto piece_of = [&](int k) {
    return normalized.substr(symbols[k].begin, symbols[k].len);
  };

  std::priority_queue<Pair, std::vector<Pair>, PairLess> agenda;
  // Merged UNUSED piece -> the two pieces it was formed from.
  absl::flat_hash_map<absl::string_view,
                      std::pair<std::string_view, std::string_view>>
      rev_merge;
  const auto maybe_add = [&](int left, int right) {
    if (left < 0 || right < 0 || symbols[left].frozen ||
        symbols[right].frozen) {
      return;
    }
    const std::string_view merged = normalized.substr(
        symbols[left].begin, symbols[left].len + symbols[right].len);
    const auto it = mergeable_.find(Sv(merged));
    if (it == mergeable_.end()) return;
    agenda.push(Pair{left, right, pieces_[it->second].score, merged.size()});
    if (pieces_[it->second].type == Type::kUnused) {
      rev_merge[Sv(merged)] = {piece_of(left), piece_of(right)};
    }
  };
  for (size_t k = 1; k < symbols.size(); ++k) {
    maybe_add(static_cast<int>(k) - 1, static_cast<int>(k));
  }
  while (!agenda.empty()) {
    const Pair top = agenda.top();
    agenda.pop();
    Symbol& l = symbols[top.left];
    Symbol& r = symbols[top.right];
    // Stale: one side was merged away or grew since this pair was queued.
    if (l.len == 0 || r.len == 0 || l.len + r.len != top.size) continue;
    l.len += r.len;
    l.next = r.next;
    if (r.next >= 0) symbols[r.next].prev = top.left;
    r.len = 0;
    maybe_add(l.prev, top.left);
    maybe_add(top.left, l.next);
  }

  std::vector<Token> out;
  // Splits UNUSED pieces back into the pieces that formed them.
  const auto resegment = [&](std::string_view piece, auto&& self) -> void {
    const int id = PieceToId(piece);
    if (pieces_[id].type == Type::kUnused) {
      const auto it = rev_merge.find(Sv(piece));
      if (it != rev_merge.end()) {
        self(it->second.first, self);
        self(it->second.second, self);
        return;
      }
    }
    out.push_back(Token{piece, id});
  };
  for (int k = symbols.empty() ? -1 : 0; k >= 0; k = symbols[k].next) {
    resegment(piece_of(k), resegment);
  }
  return out;
}

absl::StatusOr<std::vector<int>> BuiltinSpmTokenizer::Encode(
    std::string_view text, bool add_bos) const {
  const std::string normalized = Normalize(text);
  std::vector<int> ids;
  if (add_bos && bos_id_ >= 0) ids.push_back(bos_id_);
  bool prev_unk = false;
  for (const Token& t : Bpe(normalized)) {
    const bool unk = pieces_[t.id].type == Type::kUnknown;
    if (unk && byte_fallback_) {
      for (char c : t.piece) ids.push_back(byte_ids_[static_cast<uint8_t>(c)]);
    } else if (!(unk && prev_unk)) {
      ids.push_back(t.id);
    }
    prev_unk = unk;
  }
  return ids;
}

absl::Status BuiltinSpmTokenizer::CheckId(int id) const {
  if (id < 0 || id >= vocab_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token id ", id, " outside [0, ", vocab_size(), ") for ", name_));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> BuiltinSpmTokenizer::Decode(
    absl::Span<const int> ids) const {
  for (int id : ids) {
    if (absl::Status s = CheckId(id); !s.ok()) return s;
  }
  std::string text;
  std::string bytes;  // Pending run of byte pieces.
  for (int id : ids) {
    const Piece& p = pieces_[id];
    if (p.type == Type::kByte) {
      unsigned char b = 0;
      ParseBytePiece(p.text, &b);
      bytes.push_back(static_cast<char>(b));
      continue;
    }
    if (!bytes.empty()) {
      AppendBytesLossy(bytes, &text);
      bytes.clear();
    }
    std::string_view piece = p.text;
    if (p.type == Type::kControl) continue;
    if (p.type == Type::kUnknown) {
      text.append(unk_surface_);
      continue;
    }
    // The dummy prefix: as the library, every piece is stripped of one
    // leading U+2581 while the output is still empty.
    if (text.empty() && add_dummy_prefix_ && StartsWith(piece, kSpaceSymbol)) {
      piece.remove_prefix(kSpaceSymbol.size());
    }
    while (!piece.empty()) {
      if (StartsWith(piece, kSpaceSymbol)) {
        text.push_back(' ');
        piece.remove_prefix(kSpaceSymbol.size());
      } else {
        text.push_back(piece[0]);
        piece.remove_prefix(1);
      }
    }
  }
  AppendBytesLossy(bytes, &text);
  return text;
}

absl::StatusOr<std::string> BuiltinSpmTokenizer::IdToPiece(int id) const {
  if (absl::Status s = CheckId(id); !s.ok()) return s;
  return pieces_[id].text;
}

}  // namespace specserve
