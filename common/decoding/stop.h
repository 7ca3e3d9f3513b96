#ifndef SPECSERVE_COMMON_DECODING_STOP_H_
#define SPECSERVE_COMMON_DECODING_STOP_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace specserve {

/// When a request's generation ends (OpenAI `max_tokens`, `stop`; vLLM
/// `max_model_len`).
struct StopConditions {
  int max_new_tokens = 256;        ///< emitted tokens at most; >= 0.
  std::vector<int> eos_token_ids;  ///< model EOS ids (config.json).
  std::vector<int> stop_token_ids; ///< request-level stop ids.
  /// vLLM's min_tokens: EOS and stop ids cannot be emitted (their logits
  /// are masked) before this many tokens are; in [0, max_new_tokens].
  int min_new_tokens = 0;
  /// Context window in positions (prompt + generated); 0 = unlimited.
  int max_context = 0;
};

/// INVALID_ARGUMENT naming the field if max_new_tokens < 0, max_context < 0,
/// min_new_tokens outside [0, max_new_tokens],
/// or an EOS/stop id is negative or (vocab_size > 0) >= vocab_size.
absl::Status ValidateStopConditions(const StopConditions& conditions,
                                    int vocab_size);

/// Why a request finished. kNone = still running.
enum class FinishReason {
  kNone,
  kLength,
  kEos,
  kStopToken,
  kContextLimit,
  kStopString,
  kCancelled,
  kError,
};

/// "none", "length", "eos", "stop_token", "context_limit", "stop",
/// "cancelled", "error".
std::string_view FinishReasonName(FinishReason reason);

/// Tracks emitted tokens against StopConditions. Tokens arrive in batches
/// (one speculative-decoding round emits up to k+1), and Append says how many
/// of them may be emitted: nothing after a stop is ever emitted, and the
/// stop token itself (an EOS or stop id) is NOT emitted or counted.
/// The token emitted as the i-th new token (0-based) occupies position
/// start_position + i, which must be < max_context when that is set.
/// The finish is reported as soon as it is known: after the max_new_tokens-th
/// token (kLength; wins over a simultaneous context limit) or once the context
/// is full (kContextLimit), without waiting for another token.
class StopChecker {
 public:
  /// start_position: positions already used (the prompt length; with
  /// Speculative Prefill the ORIGINAL prompt length). A checker whose budget
  /// is already spent starts finished.
  StopChecker(StopConditions conditions, int start_position);

  struct Result {
    int num_emit = 0;                          ///< a prefix of candidates.
    FinishReason reason = FinishReason::kNone; ///< kNone = not finished.
  };

  /// Offers candidates in order; once finished, returns {0, reason()}.
  Result Append(absl::Span<const int> candidates);

  /// Ends the request for a reason decided elsewhere (stop string, client
  /// cancel, error); no effect if already finished.
  void Finish(FinishReason reason);

  int num_emitted() const { return num_emitted_; }
  FinishReason reason() const { return reason_; }
  bool finished() const { return reason_ != FinishReason::kNone; }

 private:
  // Sets reason_ if a budget (length, context) is used up.
  void CheckBudgets();
  bool IsEos(int token) const;
  bool IsStopToken(int token) const;

  StopConditions conditions_;
  int start_position_;
  int num_emitted_ = 0;
  FinishReason reason_ = FinishReason::kNone;
};

/// Streams decoded text through stop strings (OpenAI `stop`), the text
/// half of a request's stop conditions (StopChecker is the token half): text that
/// could be the start of a stop string is held back until it cannot be;
/// at the first complete match the text is cut before it (the stop string
/// is not included) and everything after is dropped. Not thread-safe.
class StopStringFilter {
 public:
  /// Empty strings in `stops` are ignored. `include_stop`: the text
  /// returned at a match ends with the stop string (vLLM's
  /// include_stop_str_in_output) instead of before it.
  explicit StopStringFilter(std::vector<std::string> stops,
                            bool include_stop = false);
  /// Adds `text`; returns the text that is now safe to emit. After a match
  /// (matched() turns true) returns the text before it and ignores input.
  /// can_match false (the text of vLLM's first min_tokens tokens): no
  /// match may end inside `text`, but one that starts there and ends in
  /// later text counts (as in vLLM, whose search of new text reaches back
  /// a stop string's length).
  std::string Append(absl::string_view text, bool can_match = true);
  /// End of stream: the held-back text (nothing after a match).
  std::string Flush();
  bool matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  size_t protected_ = 0;  // leading bytes of held_ no match may end in
  bool include_stop_ = false;
  bool matched_ = false;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_DECODING_STOP_H_
