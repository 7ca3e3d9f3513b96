#ifndef SPECSERVE_COMMON_DECODING_LOGITS_PROCESSORS_H_
#define SPECSERVE_COMMON_DECODING_LOGITS_PROCESSORS_H_

// A request's logit adjustments before temperature / top-k / top-p, in
// the order vLLM's sampler applies them:
//   logit_bias (OpenAI): a fixed amount added to the listed ids' logits;
// then penalties on tokens the request has already seen (vLLM's
// apply_penalties):
//   repetition_penalty r, on every id in the prompt or the output
//     (Keskar et al. 2019, CTRL; HF's RepetitionPenaltyLogitsProcessor):
//     logit / r if the logit is > 0, logit * r otherwise;
//   frequency_penalty f and presence_penalty p, on output ids only
//     (OpenAI's definition): logit -= f * count + p * (count > 0).
// In that order. The output is what the target has emitted for the
// request; a speculative round's row j also counts the drafts before it,
// since it is the distribution the target would sample from had those
// drafts been emitted.

#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/types/span.h"
#include "common/decoding/logit_edit.h"
#include "common/decoding/sampling.h"

namespace specserve {

/// The ids a request's penalties read: the distinct prompt ids and how
/// often each id was emitted. One per request; not thread-safe.
class PenaltyTracker {
 public:
  /// prompt_ids: the whole prompt as the user sent it (a Speculative
  /// Prefill target gets the pruned-away ids too, so pruning does not
  /// change what is penalized). Negative ids are ignored.
  explicit PenaltyTracker(absl::Span<const int> prompt_ids);

  /// Counts `ids` as emitted (negative ids are ignored).
  void AddOutput(absl::Span<const int> ids);

  /// Applies `params`' penalties to one logit row ([vocab], in place): the
  /// row that follows the output so far and then `pending` (e.g. the
  /// drafts before this row in a verify forward), which count as output.
  /// Ids outside [0, vocab) are skipped. A no-op when
  /// !params.has_penalties(). Cost: O(distinct prompt + output ids).
  void Apply(const SamplingParams& params, absl::Span<const int> pending,
             absl::Span<float> logits) const;

  /// The same penalties as edits (logit_edit.h), merged into `by_id`
  /// (an id already there, e.g. from a logit bias, keeps its bias): one
  /// per id that Apply would change, ids in [0, vocab).
  void AddEdits(const SamplingParams& params, absl::Span<const int> pending,
                int vocab,
                absl::flat_hash_map<int, LogitEdit>* by_id) const;

  /// Emitted ids so far, counted (for tests).
  int output_count(int id) const;

 private:
  absl::flat_hash_set<int> prompt_;
  absl::flat_hash_map<int, int> output_;
};

/// Adds params.logit_bias to one logit row ([vocab], in place); ids
/// outside [0, vocab) are skipped.
void ApplyLogitBias(const SamplingParams& params, absl::Span<float> logits);

/// Applies one id's penalties to its logit (see the file comment):
/// `count` = times emitted (with pending), `in_prompt` = in the prompt.
float PenalizeLogit(float logit, int count, bool in_prompt,
                    const SamplingParams& params);

/// Edits of several logit rows in compressed-row form: row r's edits are
/// edits[offsets[r] .. offsets[r + 1]), at most one per id (ascending, as
/// AppendRowEdits writes them; backends need only distinct ids). offsets
/// has rows + 1 entries (empty = no rows).
///
/// Rows may also carry a token mask (JSON mode's grammar, json_grammar.h:
/// most of the vocabulary is masked outside strings, so a bitmask of
/// vocab / 8 bytes instead of an edit per id): mask_of_row has an entry
/// for each of the first rows (none: no masks; rows past its end have
/// none), the index of the row's mask in `allowed` or -1; mask m is allowed[m * mask_words ..) with bit (id % 32) of word
/// (id / 32) set for every id left as it is, and the others become -inf
/// after the edits. mask_words = ceil(vocab / 32).
struct LogitEdits {
  std::vector<int> offsets;
  std::vector<LogitEdit> edits;
  int mask_words = 0;
  std::vector<int> mask_of_row;
  std::vector<uint32_t> allowed;

  int rows() const {
    return offsets.empty() ? 0 : static_cast<int>(offsets.size()) - 1;
  }
  /// Whether any row has a token mask.
  bool has_masks() const { return !mask_of_row.empty(); }
  /// Row r's mask index, or -1.
  int mask_of(int r) const {
    return r < static_cast<int>(mask_of_row.size()) ? mask_of_row[r] : -1;
  }
  /// Masks held in `allowed`.
  int num_masks() const {
    return mask_words == 0 ? 0
                           : static_cast<int>(allowed.size()) / mask_words;
  }
  void Clear() {
    offsets.clear();
    edits.clear();
    mask_words = 0;
    mask_of_row.clear();
    allowed.clear();
  }
};

/// Appends one row to `out`: the edits that make a raw logit row ([vocab])
/// what ApplyLogitBias, then `penalties`->Apply(params, pending, ...)
/// (null = no penalties), then setting every id of `masked` to -inf make
/// it, bit for bit. Ids outside [0, vocab) are skipped.
void AppendRowEdits(const SamplingParams& params,
                    const PenaltyTracker* penalties,
                    absl::Span<const int> pending, absl::Span<const int> masked,
                    int vocab, LogitEdits* out);

/// Gives the row AppendRowEdits appended last a token mask that leaves
/// every id but those of `disallowed` (any order; ids outside [0, vocab)
/// skipped) as they are; the rows before it without a mask get -1.
void MaskLastRow(absl::Span<const int> disallowed, int vocab,
                 LogitEdits* out);

/// Applies row `row` of `edits` to a logit row ([vocab], in place): its
/// edits (ids outside [0, vocab) skipped), then its token mask.
void ApplyLogitEdits(const LogitEdits& edits, int row,
                     absl::Span<float> logits);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_DECODING_LOGITS_PROCESSORS_H_
