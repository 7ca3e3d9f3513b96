#ifndef SPECSERVE_COMMON_TOKENIZER_HF_BPE_TOKENIZER_H_
#define SPECSERVE_COMMON_TOKENIZER_HF_BPE_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/tokenizer/pretokenizer.h"
#include "common/tokenizer/tokenizer.h"
#include "nlohmann/json_fwd.hpp"

namespace specserve {

/// HF tokenizers `tokenizer.json` with a BPE model, implemented natively, in
/// its two families: sentencepiece-style (Llama 1/2, Mistral, TinyStories:
/// "▁" word marks, byte fallback) and byte-level (GPT-2, Llama 3, Qwen 2/3:
/// every byte mapped to a printable character, byte_level.h).
///
/// - normalizer: Prepend, Replace (literal pattern), NFC/NFD/NFKC/NFKD
///   (utf8proc), alone or in a Sequence.
/// - pre_tokenizer: Metaspace (replacement, prepend_scheme always/first/
///   never or add_prefix_space, split), alone or as a one-element Sequence;
///   or Split (Oniguruma regex or literal, every behavior, invert) and
///   ByteLevel (add_prefix_space, use_regex) steps, alone or in a Sequence
///   (pretokenizer.h).
/// - model: BPE with `vocab`, `merges` ("a b" strings or ["a", "b"] pairs),
///   `byte_fallback` (characters missing from the vocabulary become <0xXX>
///   byte pieces), `unk_token`, `fuse_unk`, `ignore_merges` (a word that is
///   itself in the vocab is one token). Merging is the standard rank-ordered
///   BPE (lowest merge rank first, leftmost on ties), done with a heap over a
///   linked list of symbols: O(n log n) per word, with a bounded per-word
///   cache. `dropout` is ignored (encoding is deterministic).
/// - added_tokens: matched literally (leftmost-longest) and split out before
///   pre-tokenization, as HF does (special tokens written in the text become
///   their ids, HF's default): `normalized: false` tokens in the raw text,
///   the others (their content normalized too, so with Prepend("▁") "<x>"
///   matches "▁<x>") in the normalized text. `lstrip` / `rstrip` make a
///   match take the whitespace (Unicode White_Space) before / after it, as
///   HF does; `single_word` is not implemented.
/// - decoder: Sequence of Replace, ByteFallback, Fuse, Strip, Metaspace, or
///   ByteLevel. Special added tokens are skipped. Invalid UTF-8 from bytes:
///   ByteLevel yields one U+FFFD per maximal invalid subpart, as HF's
///   from_utf8_lossy and the WHATWG TextDecoder do. ByteFallback deliberately
///   deviates: U+FFFD per invalid byte (sentencepiece's rule) rather than
///   HF's U+FFFD for every byte of the run, so decoding is prefix-stable for
///   IncrementalDecoder. `clean_up_tokenization_spaces` is NOT applied
///   (decoding is faithful: Decode(Encode(s)) == s).
/// - post_processor: TemplateProcessing's leading special tokens (alone or
///   in a Sequence, e.g. Llama 3.1's [ByteLevel, TemplateProcessing]) are
///   what `Encode(text, true)` prepends for byte-level tokenizers; trailing
///   ones are never added. ByteLevel post-processing only moves offsets and
///   is ignored. Without a template, byte-level BPE prepends [bos_id()] unless
///   tokenizer_config.json says `add_bos_token: false` or there is no BOS
///   (Qwen).
///
/// Sentencepiece-style `Encode(text, true)` tokenizes BOS-content + text as
/// one string when BOS is an added token, i.e. as a BOS written in training
/// text is tokenized. For a Llama-2 style `normalized: false` "<s>" that is
/// [bos] + Encode(text, false). For a `normalized: true` BOS after a
/// Prepend("▁") normalizer (tinystories-656K) the normalized match
/// "▁<|start_story|>" absorbs the prepended "▁", so the first word has none
/// -- which is how that model was trained (from BOS it generates "On", "ce▁",
/// not "▁") and what the golden prompt ids hold. HF's TemplateProcessing path
/// ([bos] + "▁On"...) would differ there.
///
/// Other model types (WordPiece, Unigram, ...) are UNIMPLEMENTED.
///
/// Special ids: unk from `model.unk_token`; bos/eos/pad from the sibling
/// tokenizer_config.json (or special_tokens_map.json) `bos_token`/
/// `eos_token`/`pad_token`, falling back to the post_processor's leading
/// special token for BOS and to "<s>" / "</s>" / "<pad>" by name.
class HfBpeTokenizer : public Tokenizer {
 public:
  /// Reads `json_path` and, when present next to it, tokenizer_config.json
  /// and special_tokens_map.json. NOT_FOUND if `json_path` is missing;
  /// otherwise as Parse. Warns on stderr when `model.byte_fallback` is set
  /// but byte pieces are missing (see byte_piece_count()).
  static absl::StatusOr<std::unique_ptr<HfBpeTokenizer>> Load(
      const std::string& json_path);

  /// Parses tokenizer.json text. `config_json` is tokenizer_config.json or
  /// special_tokens_map.json text, or empty. `source` names the file in
  /// errors. INVALID_ARGUMENT for malformed JSON / inconsistent vocab or
  /// merges; UNIMPLEMENTED for unsupported kinds (byte-level BPE, other
  /// models, normalizers, pre-tokenizers or decoders), naming the component.
  static absl::StatusOr<std::unique_ptr<HfBpeTokenizer>> Parse(
      std::string_view tokenizer_json, std::string_view config_json,
      const std::string& source);

  absl::StatusOr<std::vector<int>> Encode(std::string_view text,
                                          bool add_bos) const override;
  absl::StatusOr<std::string> Decode(absl::Span<const int> ids) const override;
  absl::StatusOr<std::string> IdToPiece(int id) const override;
  int vocab_size() const override { return static_cast<int>(pieces_.size()); }
  int bos_id() const override { return bos_id_; }
  int eos_id() const override { return eos_id_; }
  int unk_id() const override { return unk_id_; }
  int pad_id() const override { return pad_id_; }
  std::string Fingerprint() const override { return fingerprint_; }
  std::string kind() const override { return "hf-bpe"; }

  /// Whether the model sets `byte_fallback`.
  bool byte_fallback() const { return byte_fallback_; }
  /// How many of the 256 "<0x00>".."<0xFF>" byte pieces the vocabulary
  /// has. With byte_fallback() and fewer than 256 the fallback is partial
  /// or absent: a character outside the vocabulary whose bytes lack pieces
  /// becomes unk_id() (or is dropped without an unk token). The bundled
  /// tinystories-656K tokenizer is such a case (0 byte pieces).
  int byte_piece_count() const;

 private:
  struct AddedToken {
    std::string content;
    std::string match;  // Text matched: content, normalized if `normalized`.
    int id;
    bool special;
    bool normalized;
    bool lstrip;  // The match absorbs whitespace before it.
    bool rstrip;  // The match absorbs whitespace after it.
  };
  struct NormalizerStep {
    enum Type { kPrepend, kReplace, kUnicode } type;
    std::string from;  // Replace pattern.
    std::string to;    // Prepend / Replace content.
    int utf8proc_options = 0;  // kUnicode: NFC/NFD/NFKC/NFKD as flags.
  };
  enum class PrependScheme { kAlways, kFirst, kNever };
  struct DecoderStep {
    enum Type {
      kReplace,
      kByteFallback,
      kFuse,
      kStrip,
      kMetaspace,
      kByteLevel
    } type;
    std::string from;  // Replace pattern / Strip char / Metaspace replacement.
    std::string to;    // Replace content.
    int start = 0;     // Strip: leading chars.
    int stop = 0;      // Strip: trailing chars.
    bool metaspace_strip_first = true;
  };
  // One piece of input after added-token splitting: text, or an added id.
  struct Segment {
    std::string text;
    int added_id;   // -1 for text.
    bool at_start;  // Begins at offset 0 of the original input.
  };

  using Json = nlohmann::json;
  // Added tokens by the first byte of their match string (256 lists).
  using AddedIndex = std::vector<std::vector<const AddedToken*>>;

  HfBpeTokenizer() = default;

  // Parse steps, in order; errors name source_.
  absl::Status ParseVocab(const Json& model, const Json& root);
  absl::Status ParseBpe(const Json& model);
  absl::Status ParseNormalizer(const Json& normalizer);
  absl::Status ParsePreTokenizer(const Json& pre_tokenizer);
  absl::Status ParseDecoder(const Json& decoder);
  absl::Status ParsePostProcessor(const Json& post_processor,
                                  const Json& config);
  absl::Status IndexAddedTokens();
  void ResolveSpecialIds(const Json& root, const Json& config);
  absl::Status Invalid(std::string_view what) const;
  absl::Status Unimplemented(std::string_view what) const;

  void SplitOnAddedTokens(const AddedIndex& tokens,
                          const Segment& in, std::vector<Segment>* out) const;
  std::string Normalize(std::string_view text) const;
  void PreTokenize(const Segment& seg, std::vector<std::string>* words) const;
  // BPE of one word through the cache.
  void EncodeWord(std::string_view word, std::vector<int>* ids) const;
  void EncodeWordUncached(std::string_view word, std::vector<int>* ids) const;
  // Added-token splitting, normalization, pre-tokenization and BPE.
  void EncodeText(std::string_view text, std::vector<int>* ids) const;
  std::string ApplyDecoder(std::vector<std::string> tokens) const;

  static uint64_t PairKey(int a, int b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) |
           static_cast<uint32_t>(b);
  }

  std::string source_;
  std::vector<std::string> pieces_;              // By id.
  std::vector<bool> skip_on_decode_;             // Special added tokens.
  absl::flat_hash_map<std::string, int> vocab_;  // model.vocab.
  // (left id, right id) -> (rank, merged id).
  absl::flat_hash_map<uint64_t, std::pair<int, int>> merges_;
  int byte_ids_[256];  // <0xXX> ids or -1.
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  int model_unk_id_ = -1;  // For unknown characters.

  std::vector<AddedToken> added_;
  AddedIndex raw_added_;         // normalized == false.
  AddedIndex normalized_added_;  // normalized == true.

  std::vector<NormalizerStep> normalizer_;
  bool metaspace_ = false;  // Metaspace pre-tokenizer present.
  std::string metaspace_replacement_;
  PrependScheme metaspace_prepend_ = PrependScheme::kAlways;
  bool metaspace_split_ = true;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;  // Split / ByteLevel steps.
  bool byte_level_ = false;  // ByteLevel pre-tokenizer: byte-level BPE.

  bool has_decoder_ = false;
  std::vector<DecoderStep> decoder_;

  int bos_id_ = -1;
  std::string bos_content_;  // BOS's added-token content, if it is one.
  // Byte-level: ids Encode(text, true) prepends (template or [bos]).
  std::vector<int> bos_prefix_;
  int eos_id_ = -1;
  int unk_id_ = -1;
  int pad_id_ = -1;
  std::string fingerprint_;

  // Word -> ids for words up to kMaxCachedWordBytes; cleared when full.
  mutable absl::Mutex cache_mu_;
  mutable absl::flat_hash_map<std::string, std::vector<int>> cache_
      ABSL_GUARDED_BY(cache_mu_);
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_TOKENIZER_HF_BPE_TOKENIZER_H_
