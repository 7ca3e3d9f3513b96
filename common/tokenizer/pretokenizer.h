#ifndef SPECSERVE_COMMON_TOKENIZER_PRETOKENIZER_H_
#define SPECSERVE_COMMON_TOKENIZER_PRETOKENIZER_H_

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"

namespace specserve {

/// [begin, end) byte offsets into a string.
using ByteRange = std::pair<size_t, size_t>;

/// A compiled regular expression with the semantics HF tokenizers gives
/// `{"Regex": ...}` patterns: Oniguruma (the library HF links through the
/// `onig` crate), UTF-8, Oniguruma syntax, no options. Immutable after
/// compilation; concurrent searches are safe (each uses its own region, as
/// the `onig` crate's Sync Regex relies on).
class OnigRegex {
 public:
  /// INVALID_ARGUMENT with Oniguruma's message for a bad pattern.
  static absl::StatusOr<std::unique_ptr<OnigRegex>> Compile(
      std::string_view pattern);
  ~OnigRegex();
  OnigRegex(const OnigRegex&) = delete;
  OnigRegex& operator=(const OnigRegex&) = delete;

  /// Appends the successive non-overlapping matches in `text` (valid UTF-8;
  /// Oniguruma must not see other bytes) to `out`, scanning as the onig
  /// crate's find_iter: an empty match right at the end of the previous
  /// match is skipped by advancing one character.
  void FindAll(std::string_view text, std::vector<ByteRange>* out) const;

 private:
  explicit OnigRegex(void* regex) : regex_(regex) {}
  void* regex_;  // regex_t*; void keeps oniguruma.h out of this header.
};

/// HF tokenizers' SplitDelimiterBehavior: what becomes of each match when a
/// string is split on a pattern.
enum class SplitBehavior {
  kRemoved,             ///< Matches are dropped.
  kIsolated,            ///< Matches are pieces of their own.
  kMergedWithPrevious,  ///< A match joins the piece before it.
  kMergedWithNext,      ///< A match joins the piece after it.
  kContiguous,          ///< Adjacent matches form one piece.
};

/// Splits [0, size) given `matches` (sorted, non-overlapping, inside it) as
/// HF's NormalizedString::split does: the string is first cut into match
/// and non-match runs (with `invert` the roles swap), then `behavior`
/// applies. Empty pieces are dropped. Appends the pieces to `out`.
void SplitByMatches(size_t size, const std::vector<ByteRange>& matches,
                    SplitBehavior behavior, bool invert,
                    std::vector<ByteRange>* out);

/// The `pre_tokenizer` of an HF tokenizer.json made of `Split` (Regex or
/// String pattern, any behavior, invert) and `ByteLevel` (add_prefix_space;
/// use_regex with GPT-2's pattern; trim_offsets only affects offsets and is
/// ignored) steps, alone or in a `Sequence`, applied in order to every
/// piece as HF's PreTokenizedString does. With a ByteLevel step, the words
/// come out in GPT-2's byte-to-unicode alphabet (byte_level.h).
///
/// Input that is not valid UTF-8 (which HF cannot receive) is accepted:
/// each invalid byte is cut out as a piece of its own before any regex runs.
class PreTokenizer {
 public:
  /// Parses `json` (an object). UNIMPLEMENTED naming the component for other
  /// pre-tokenizer types, INVALID_ARGUMENT for malformed ones (a bad regex,
  /// an unknown behavior). Messages do not name the file.
  static absl::StatusOr<std::unique_ptr<PreTokenizer>> FromJson(
      const nlohmann::json& json);
  ~PreTokenizer();

  /// Appends the words of `text` to `words`.
  void Split(std::string_view text, std::vector<std::string>* words) const;

  /// True when a ByteLevel step maps the words to the byte alphabet.
  bool byte_level() const { return byte_level_; }

 private:
  struct Step;
  PreTokenizer() = default;

  std::vector<Step> steps_;
  bool byte_level_ = false;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_TOKENIZER_PRETOKENIZER_H_
