#ifndef SPECSERVE_ROUTER_OUTPUT_PROCESSOR_H_
#define SPECSERVE_ROUTER_OUTPUT_PROCESSOR_H_

// What a request's client sees, built from the target's rounds (vLLM v1's
// output processor): token ids, text through the incremental detokenizer
// and the stop strings (common/decoding/stop.h), the finish reason, and
// the per-request statistics and metrics (TTFT, drafts, acceptance per
// position). The generation loop (request_runner.cc) feeds it one target
// round at a time; it never touches a backend.

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/decoding/stop.h"
#include "common/tokenizer/tokenizer.h"
#include "protos/router.pb.h"
#include "protos/target.pb.h"

namespace specserve {

class RouterMetrics;

/// One request's output. Not thread-safe (the request's thread only).
class OutputProcessor {
 public:
  /// `tokenizer` null = token ids only, no text (and no stop strings).
  /// `start`: when the request arrived (TTFT and total time count from
  /// it). `metrics` may be null. Both must outlive this object. No stop
  /// string may end in the text of the first `min_tokens` tokens (vLLM's
  /// min_tokens); one that starts there and ends later counts.
  /// `include_stop`: a matched stop string ends the text (vLLM's
  /// include_stop_str_in_output) instead of being cut.
  OutputProcessor(const Tokenizer* tokenizer, std::vector<std::string> stops,
                  absl::Time start, RouterMetrics* metrics,
                  int min_tokens = 0, bool include_stop = false);

  /// Takes one target message answered at `now`: one round (one target
  /// forward: the prefill or a verify round), or the several rounds a
  /// continuous stream's message lists in `rounds`. Counts each forward,
  /// its drafts and accepted tokens, and writes the emitted tokens, their
  /// logprobs (when the round has one per token) and their text into
  /// `chunk` (cleared first). A stop string ends the request (its text and
  /// everything after it, tokens included, are dropped); so does the
  /// target's finish reason. Errors from the detokenizer.
  absl::Status AddRound(const v1::GenerateResponse& round, absl::Time now,
                        v1::GenerateTextChunk* chunk);

  /// The request is over ("stop" after a stop string, or the target's
  /// finish reason).
  bool finished() const { return !finish_reason_.empty(); }
  /// "stop" when a stop string matched (the target stream is then
  /// cancelled, not finished).
  bool stopped_by_string() const { return stops_.matched(); }
  int completion_tokens() const { return completion_; }

  /// The drafting method of the request ("draft", "ngram", "draft_tree";
  /// "" = none): stats.spec_decode_method and the metrics' method label.
  /// Set before the first round.
  void SetSpecDecodeMethod(const std::string& method) {
    stats_.set_spec_decode_method(method);
  }

  /// Statistics the generation loop records itself (speculate_s,
  /// target_prefill_s, rounds with fewer drafts under load).
  v1::GenerationStats* mutable_stats() { return &stats_; }

  /// The last chunk, after the target stream is done: the text held back
  /// for stop strings, the finish reason, usage (`prompt_tokens` of the
  /// whole prompt, `kept_tokens` prefilled) and stats (`fallback` = the
  /// fallback reason, "" = none; num_target_forwards = rounds taken,
  /// tokens_per_target_forward = completion tokens / forwards); counts the
  /// request into the metrics.
  void Finish(int prompt_tokens, int kept_tokens, const std::string& fallback,
              absl::Time now, v1::GenerateTextChunk* chunk);

 private:
  // Counts one target forward and its drafts.
  void CountRound(int num_drafts, int num_accepted, int num_tokens);

  std::optional<IncrementalDecoder> decoder_;
  StopStringFilter stops_;
  int min_tokens_ = 0;
  const absl::Time start_;
  RouterMetrics* const metrics_;
  v1::GenerationStats stats_;
  int completion_ = 0;
  int forwards_ = 0;
  int64_t accepted_total_ = 0;
  std::vector<int> accepted_per_pos_;
  std::string finish_reason_;
};

/// Folds a chunk into a unary response: text, token ids, logprobs and
/// the prompt's ids and logprobs (first chunk) appended, the
/// final chunk's finish reason, usage and stats copied.
void AppendChunk(const v1::GenerateTextChunk& chunk,
                 v1::GenerateTextResponse* response);

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_OUTPUT_PROCESSOR_H_
