#ifndef SPECSERVE_COMMON_TOKENIZER_SPM_BUILTIN_H_
#define SPECSERVE_COMMON_TOKENIZER_SPM_BUILTIN_H_

#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/tokenizer/tokenizer.h"

namespace specserve {

/// Tokenizer over a sentencepiece `tokenizer.model` (a serialized
/// sentencepiece ModelProto, read with our own subset schema
/// spm_model.proto) that needs no libsentencepiece: used by sanitizer builds
/// (--define=spm=builtin), where the library's dlopen() with RTLD_DEEPBIND
/// is impossible (see spm_shim.cc).
///
/// Follows sentencepiece's documented BPE encoding and must give the same
/// ids and text as the library (spm_builtin_parity_test checks it):
///  * normalization: only the "identity" rule (an empty precompiled
///    charsmap); each byte that is not valid UTF-8 becomes U+FFFD; with
///    remove_extra_whitespaces, leading and trailing ' ' are dropped and
///    runs of ' ' collapse to one; with add_dummy_prefix a space is prepended
///    to non-empty text; with escape_whitespaces ' ' is written as U+2581.
///  * BPE: start from UTF-8 characters (USER_DEFINED pieces match first,
///    longest wins, and are never merged); repeatedly merge the adjacent pair
///    whose concatenation is a piece with the highest score (ties: the
///    leftmost pair); UNUSED pieces are split back into what formed them.
///  * a character that is not a piece is the unknown id, or with
///    byte_fallback one <0xXX> piece per UTF-8 byte; without byte fallback
///    adjacent unknowns merge into one unknown id.
///  * decoding: CONTROL pieces give nothing, UNKNOWN gives unk_surface
///    (" ⁇ "), U+2581 gives ' ' (with add_dummy_prefix, each piece loses a
///    leading one while the output is still empty), runs of byte pieces are
///    decoded as UTF-8
///    with one U+FFFD per invalid byte.
/// Immutable after loading; safe for concurrent use.
class BuiltinSpmTokenizer : public Tokenizer {
 public:
  /// Loads `model_path`. NOT_FOUND if it cannot be opened, INVALID_ARGUMENT
  /// if it is not a valid sentencepiece model, UNIMPLEMENTED for models this
  /// implementation does not cover (model_type other than BPE, a
  /// normalization rule other than identity, treat_whitespace_as_suffix);
  /// messages name the file.
  static absl::StatusOr<std::unique_ptr<BuiltinSpmTokenizer>> Load(
      const std::string& model_path);

  /// As Load, from the serialized ModelProto `bytes`; `name` is used in
  /// error messages.
  static absl::StatusOr<std::unique_ptr<BuiltinSpmTokenizer>> Parse(
      std::string_view bytes, const std::string& name);

  /// Text -> ids as libsentencepiece's EncodeAsIds (any bytes accepted),
  /// [bos_id()] first with `add_bos` (and a BOS). Never fails.
  absl::StatusOr<std::vector<int>> Encode(std::string_view text,
                                          bool add_bos) const override;
  /// Ids -> text as libsentencepiece's DecodeIds. INVALID_ARGUMENT for an
  /// id outside [0, vocab_size()).
  absl::StatusOr<std::string> Decode(absl::Span<const int> ids) const override;
  absl::StatusOr<std::string> IdToPiece(int id) const override;
  int vocab_size() const override { return static_cast<int>(pieces_.size()); }
  int bos_id() const override { return bos_id_; }
  int eos_id() const override { return eos_id_; }
  int unk_id() const override { return unk_id_; }
  int pad_id() const override { return pad_id_; }
  std::string Fingerprint() const override { return fingerprint_; }
  /// "sentencepiece", like the library-backed tokenizer: both give the same
  /// Fingerprint() for the same file.
  std::string kind() const override { return "sentencepiece"; }

  /// The normalized text BPE runs on (see the class comment); for tests.
  std::string Normalize(std::string_view text) const;

 private:
  enum class Type { kNormal, kUnknown, kControl, kUserDefined, kUnused, kByte };
  struct Piece {
    std::string text;
    float score = 0;
    Type type = Type::kNormal;
  };
  // One (piece, id) of the BPE result.
  struct Token {
    std::string_view piece;
    int id;
  };

  explicit BuiltinSpmTokenizer(std::string name) : name_(std::move(name)) {}
  absl::Status Init(std::string_view bytes);

  // sentencepiece's PieceToId: control/unknown/byte pieces first, then the
  // others, else the unknown id.
  int PieceToId(std::string_view piece) const;
  // Length of the longest USER_DEFINED piece that prefixes `s`, or 0.
  size_t UserDefinedPrefix(std::string_view s) const;
  // BPE over normalized text; pieces point into `normalized`.
  std::vector<Token> Bpe(std::string_view normalized) const;
  absl::Status CheckId(int id) const;

  std::string name_;  // For error messages.
  std::vector<Piece> pieces_;
  // NORMAL, USER_DEFINED and UNUSED pieces (what BPE merges may produce).
  absl::flat_hash_map<std::string, int> mergeable_;
  // CONTROL, UNKNOWN and BYTE pieces.
  absl::flat_hash_map<std::string, int> reserved_;
  std::vector<std::string> user_defined_;
  size_t max_user_defined_len_ = 0;
  std::array<int, 256> byte_ids_{};  // Id of "<0xXX>", or the unknown id.
  int unk_piece_id_ = -1;  // The UNKNOWN piece (PieceToId's fallback).
  bool byte_fallback_ = false;
  bool add_dummy_prefix_ = true;
  bool remove_extra_whitespaces_ = true;
  bool escape_whitespaces_ = true;
  std::string unk_surface_;
  int bos_id_ = -1;
  int eos_id_ = -1;
  int unk_id_ = -1;
  int pad_id_ = -1;
  std::string fingerprint_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_TOKENIZER_SPM_BUILTIN_H_
