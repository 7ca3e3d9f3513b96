#ifndef SPECSERVE_COMMON_TOKENIZER_TOKENIZER_H_
#define SPECSERVE_COMMON_TOKENIZER_TOKENIZER_H_

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace specserve {

/// Text <-> token ids for one model vocabulary
/// (`tokenizer.model` sentencepiece or `tokenizer.json` HF tokenizers).
/// Implementations are immutable after loading and safe for concurrent use.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  /// UTF-8 text -> ids. With `add_bos` (and a BOS in the vocabulary) the
  /// result starts with bos_id() and the text is tokenized as it follows a
  /// BOS in training data (hf-bpe: see HfBpeTokenizer on how a BOS absorbs
  /// the prepended "▁", and on byte-level BPE, where the tokenizer.json
  /// template decides: Qwen adds none); for sentencepiece that is [bos] +
  /// Encode(text). Special tokens written in the text (e.g. "<|eot_id|>")
  /// become their ids, as HF tokenizers does by default.
  /// Never adds EOS. Lenient: any byte string is accepted; bytes
  /// that are not valid UTF-8 are tokenized like the reference libraries do
  /// (sentencepiece normalizes them; hf-bpe encodes each such byte through
  /// byte fallback), so they do not round-trip. Errors only on internal
  /// failures of the underlying library (INTERNAL).
  virtual absl::StatusOr<std::vector<int>> Encode(std::string_view text,
                                                  bool add_bos) const = 0;

  /// Ids -> text. Special/control tokens (BOS, EOS, ...) produce no text;
  /// byte pieces that do not form valid UTF-8 produce U+FFFD (one per bad
  /// byte for sentencepiece and byte fallback, one per maximal invalid
  /// subpart for byte-level BPE, as HF). INVALID_ARGUMENT for an id outside
  /// [0, vocab_size()).
  virtual absl::StatusOr<std::string> Decode(
      absl::Span<const int> ids) const = 0;

  /// The raw piece string of `id` (e.g. "▁Once", "<0x0A>", "<s>").
  /// INVALID_ARGUMENT for an id outside [0, vocab_size()).
  virtual absl::StatusOr<std::string> IdToPiece(int id) const = 0;

  /// Number of ids (the embedding rows a matching model must have).
  virtual int vocab_size() const = 0;
  virtual int bos_id() const = 0;  ///< -1 if none.
  virtual int eos_id() const = 0;  ///< -1 if none.
  virtual int unk_id() const = 0;  ///< -1 if none.
  virtual int pad_id() const = 0;  ///< -1 if none.

  /// Stable 16-hex-digit fingerprint of the vocabulary: FNV-1a 64 over a
  /// canonical serialization of kind(), every piece in id order and the
  /// special ids. Equal vocabularies give equal fingerprints in every process
  /// and run; used to check speculator/target/router compatibility.
  virtual std::string Fingerprint() const = 0;

  /// "sentencepiece" or "hf-bpe".
  virtual std::string kind() const = 0;
};

/// Loads `model_dir`/tokenizer.model (sentencepiece) if present, else
/// `model_dir`/tokenizer.json (HF BPE: sentencepiece-style with byte
/// fallback, or byte-level as Llama 3 and Qwen 2/3; see HfBpeTokenizer).
/// NOT_FOUND if neither exists; INVALID_ARGUMENT for a malformed file and
/// UNIMPLEMENTED for an unsupported tokenizer.json kind (e.g. WordPiece),
/// both naming the file; UNAVAILABLE if libsentencepiece cannot be loaded.
/// tokenizer.model is read by libsentencepiece (SentencePieceTokenizer), or
/// under --define=spm=builtin (the sanitizer configs) by
/// BuiltinSpmTokenizer, which does not load the library and answers
/// UNIMPLEMENTED for non-BPE models.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(
    const std::string& model_dir);

/// Computes the Fingerprint() format: FNV-1a 64 of `kind`, the special ids
/// and the length-prefixed pieces, as 16 lowercase hex digits.
std::string ComputeVocabFingerprint(std::string_view kind,
                                    const std::vector<std::string>& pieces,
                                    int bos_id, int eos_id, int unk_id,
                                    int pad_id);

/// Incremental (streaming) detokenizer: feed one id at a time, get back the
/// newly completed UTF-8 text.
///
/// Follows HF text-generation-inference's `decode_token`: only a small window
/// of recent ids is re-decoded per step (prefix_offset .. end), and the text
/// beyond the window's already-emitted part (prefix_offset .. read_offset) is
/// the delta. This makes tokenizer-specific rules come out exactly as the
/// full Decode does: the sentencepiece leading-space rule (the first piece's
/// "▁" becomes no space only at the very start of the output) and byte
/// fallback (a multi-byte character split over several <0xXX> pieces is held
/// back while the text ends in an incomplete sequence / U+FFFD). The window
/// is widened when its emitted part decodes to nothing (e.g. control tokens
/// or a lone "▁"), so a following piece never loses its leading space.
/// Cost per Append is O(window), typically a few tokens.
///
/// Invariant: the concatenation of all Append results and Flush() equals
/// tokenizer->Decode(all ids). Not thread-safe; one per stream.
class IncrementalDecoder {
 public:
  /// `tokenizer` must outlive this object.
  explicit IncrementalDecoder(const Tokenizer* tokenizer);

  /// Feeds `id`; returns the newly completed text (possibly empty).
  /// INVALID_ARGUMENT for an id outside [0, vocab_size()) (state unchanged).
  absl::StatusOr<std::string> Append(int id);

  /// Returns any held-back text (e.g. a trailing incomplete byte sequence,
  /// decoded as U+FFFD) and marks everything fed so far as emitted. Call at
  /// end of stream.
  std::string Flush();

  /// All ids fed so far.
  const std::vector<int>& ids() const { return ids_; }

 private:
  // Decodes ids_[begin, end).
  absl::StatusOr<std::string> DecodeRange(size_t begin, size_t end) const;
  // Re-decodes the window and returns the new text; holds it back (returns
  // "") unless `flush` when it is empty or ends mid-character.
  absl::StatusOr<std::string> Step(bool flush);

  const Tokenizer* tokenizer_;
  std::vector<int> ids_;
  size_t prefix_offset_ = 0;  // Start of the re-decoded window.
  size_t read_offset_ = 0;    // ids_[prefix_offset_, read_offset_) emitted.
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_TOKENIZER_TOKENIZER_H_
