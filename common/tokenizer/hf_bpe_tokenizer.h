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
#include "absl/types/span.h"
#include "common/tokenizer/tokenizer.h"
#include "nlohmann/json_fwd.hpp"

namespace specserve {

/// HF tokenizers `tokenizer.json` of the sentencepiece-style BPE kind (Llama
/// family exported by `transformers`), implemented natively:
///
/// - normalizer: Prepend("▁") and Replace(" " -> "▁"), alone or in a
///   Sequence; or none with a Metaspace pre-tokenizer (replacement,
///   prepend_scheme always/first/never or add_prefix_space, split).
/// - model: BPE with `vocab`, `merges` ("a b" strings or ["a", "b"] pairs),
///   `byte_fallback` (characters missing from the vocabulary become <0xXX>
///   byte pieces), `unk_token`, `fuse_unk`, `ignore_merges`. Merging is the
///   standard rank-ordered BPE (lowest merge rank first, leftmost on ties),
///   done with a heap over a linked list of symbols: O(n log n) per word.
///   `dropout` is ignored (encoding is deterministic).
/// - added_tokens: matched literally (leftmost-longest) and split out before
///   BPE, as HF does: `normalized: false` tokens in the raw text, the others
///   (their content normalized too, so with Prepend("▁") "<x>" matches
///   "▁<x>") in the normalized text; lstrip/rstrip/single_word are not
///   implemented.
/// - decoder: Sequence of Replace, ByteFallback, Fuse, Strip, or Metaspace.
///   Special added tokens are skipped. One deliberate deviation: a run of
///   byte pieces that is not valid UTF-8 yields U+FFFD per invalid byte
///   (sentencepiece's rule) rather than HF's U+FFFD for every byte of the
///   run, so decoding is prefix-stable for IncrementalDecoder.
/// - post_processor is ignored; the `add_bos` argument governs BOS.
///   `Encode(text, true)` tokenizes BOS-content + text as one string when BOS
///   is an added token, i.e. as a BOS written in training text is tokenized.
///   For a Llama-2 style `normalized: false` "<s>" that is [bos] +
///   Encode(text, false). For a `normalized: true` BOS after a Prepend("▁")
///   normalizer (tinystories-656K) the normalized match "▁<|start_story|>"
///   absorbs the prepended "▁", so the first word has none -- which is how
///   that model was trained (from BOS it generates "On", "ce▁", not "▁") and
///   what the golden prompt ids hold. HF's TemplateProcessing path ([bos] +
///   "▁On"...) would differ there.
///
/// Byte-level BPE (ByteLevel pre-tokenizer/decoder, Llama-3 / Qwen) and
/// other model types are UNIMPLEMENTED.
///
/// Special ids: unk from `model.unk_token`; bos/eos/pad from the sibling
/// tokenizer_config.json (or special_tokens_map.json) `bos_token`/
/// `eos_token`/`pad_token`, falling back to the post_processor's leading
/// special token for BOS and to "<s>" / "</s>" / "<pad>" by name.
class HfBpeTokenizer : public Tokenizer {
 public:
  /// Reads `json_path` and, when present next to it, tokenizer_config.json
  /// and special_tokens_map.json. NOT_FOUND if `json_path` is missing;
  /// otherwise as Parse.
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

 private:
  struct AddedToken {
    std::string content;
    std::string match;  // Text matched: content, normalized if `normalized`.
    int id;
    bool special;
    bool normalized;
  };
  struct NormalizerStep {
    bool is_prepend;  // Else Replace(from -> to).
    std::string from;
    std::string to;
  };
  enum class PrependScheme { kAlways, kFirst, kNever };
  struct DecoderStep {
    enum Type { kReplace, kByteFallback, kFuse, kStrip, kMetaspace } type;
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

  HfBpeTokenizer() = default;

  // Parse steps, in order; errors name source_.
  absl::Status ParseVocab(const Json& model, const Json& root);
  absl::Status ParseBpe(const Json& model);
  absl::Status ParseNormalizer(const Json& normalizer);
  absl::Status ParsePreTokenizer(const Json& pre_tokenizer);
  absl::Status ParseDecoder(const Json& decoder);
  absl::Status IndexAddedTokens();
  void ResolveSpecialIds(const Json& root, const Json& config);
  absl::Status Invalid(std::string_view what) const;
  absl::Status Unimplemented(std::string_view what) const;

  void SplitOnAddedTokens(const std::vector<const AddedToken*>& tokens,
                          const Segment& in, std::vector<Segment>* out) const;
  std::string Normalize(std::string_view text) const;
  void PreTokenize(const Segment& seg, std::vector<std::string>* words) const;
  void EncodeWord(std::string_view word, std::vector<int>* ids) const;
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
  std::vector<const AddedToken*> raw_added_;         // normalized == false.
  std::vector<const AddedToken*> normalized_added_;  // normalized == true.

  std::vector<NormalizerStep> normalizer_;
  bool metaspace_ = false;  // Metaspace pre-tokenizer present.
  std::string metaspace_replacement_;
  PrependScheme metaspace_prepend_ = PrependScheme::kAlways;
  bool metaspace_split_ = true;

  bool has_decoder_ = false;
  std::vector<DecoderStep> decoder_;

  int bos_id_ = -1;
  std::string bos_content_;  // BOS's added-token content, if it is one.
  int eos_id_ = -1;
  int unk_id_ = -1;
  int pad_id_ = -1;
  std::string fingerprint_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_TOKENIZER_HF_BPE_TOKENIZER_H_
