#ifndef SPECSERVE_ROUTER_REQUEST_RUNNER_H_
#define SPECSERVE_ROUTER_REQUEST_RUNNER_H_

// One router request from prompt to text (issue 5, section 2):
//
//   tokenize -> Speculator.Score (keep_session when drafting) ->
//   Target.Generate: Prefill{kept ids, their original positions,
//                            next_position = prompt length,
//                            drafts = look-ahead tokens}
//   loop { target round -> emit tokens (incremental detokenizer, stop
//          strings) -> Speculator.Draft(emitted tokens, k) -> Drafts }
//   -> release both sessions.
//
// Degradations (section 3): a speculator that is unavailable, failing or
// past --speculator_deadline_ms at Score -> full prefill and plain decoding
// on the target (stats.fallback_reason, specserve_router_fallbacks_total);
// one that fails mid-generation -> the remaining rounds carry no drafts.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "protos/router.pb.h"
#include "protos/speculator.pb.h"
#include "router/replica_pool.h"

namespace specserve {

class RouterMetrics;
class Tokenizer;

/// What an unset request field means: one --default_* flag each. Defaults
/// of Speculative Prefill follow the official code (keep 0.3, chunk 32,
/// pool 13, look-ahead 8; REFERENCE.md section 1) plus forced BOS / last
/// token keeps.
struct RequestDefaults {
  int max_new_tokens = 256;
  float temperature = 0.f;  ///< 0 = greedy.
  int top_k = 0;            ///< 0 = off.
  float top_p = 1.f;        ///< (0, 1].
  bool spec_prefill = true;
  float keep_ratio = 0.3f;
  float keep_mass = 0.f;  ///< 0 = off.
  int chunk_size = 32;
  int pool_kernel_size = 13;
  int look_ahead = 8;
  int keep_first = 1;
  int keep_last = 1;
  int min_prompt_tokens = 0;
  bool spec_decode = true;
  int num_draft_tokens = 4;
};

/// A request's options with every default applied and every value valid.
/// The prompt is not part of it (it needs the tokenizer and the target).
struct ResolvedOptions {
  int max_new_tokens = 0;
  v1::SamplingParams sampling;  ///< top_p in (0, 1]; seed as sent (or 0).
  bool has_seed = false;
  std::vector<std::string> stop;    ///< non-empty stop strings.
  std::vector<int> stop_token_ids;  ///< >= 0 (vocabulary checked later).
  bool ignore_eos = false;
  bool spec_prefill = false;
  v1::SpecPrefillOptions prefill;  ///< every field set (keep_ratio etc.).
  bool spec_decode = false;
  int num_draft_tokens = 0;  ///< k in [1, 64].
};

/// Applies `defaults` to the unset fields of `request` and validates the
/// result once, at the edge. INVALID_ARGUMENT naming the field
/// ("sampling.top_p must be in (0, 1], got 0"): max_new_tokens < 1,
/// temperature negative or not finite, top_k < 0, top_p outside (0, 1],
/// an empty stop string, a negative stop token id, keep_ratio outside
/// (0, 1], keep_mass outside [0, 1], chunk_size < 1, pool_kernel_size even or < 1, look_ahead outside
/// [0, 64], keep_first / keep_last / min_prompt_tokens < 0, num_draft_tokens
/// outside [1, 64].
absl::StatusOr<ResolvedOptions> ResolveOptions(
    const v1::GenerateTextRequest& request, const RequestDefaults& defaults);

/// INVALID_ARGUMENT if `defaults` themselves are invalid (the message
/// names the --default_ flag's field).
absl::Status ValidateDefaults(const RequestDefaults& defaults);

/// Streams decoded text through stop strings (OpenAI `stop`): text that
/// could be the start of a stop string is held back until it cannot be;
/// at the first complete match the text is cut before it (the stop string
/// is not included) and everything after is dropped. Not thread-safe.
class StopStringFilter {
 public:
  /// Empty strings in `stops` are ignored.
  explicit StopStringFilter(std::vector<std::string> stops);
  /// Adds `text`; returns the text that is now safe to emit. After a match
  /// (matched() turns true) returns the text before it and ignores input.
  std::string Append(absl::string_view text);
  /// End of stream: the held-back text (nothing after a match).
  std::string Flush();
  bool matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool matched_ = false;
};

/// Everything a request needs from the router; owned by RouterServer (or a
/// test) and outliving every runner.
struct RouterBackends {
  /// The router's tokenizer (--tokenizer); null = token-id prompts only and
  /// no text in responses.
  const Tokenizer* tokenizer = nullptr;
  /// MaxBytesPerToken(*tokenizer), computed once; 0 = no byte bound on
  /// text prompts before tokenizing (MaxPromptBytes).
  int max_bytes_per_token = 0;
  ReplicaPool* target = nullptr;      ///< required.
  ReplicaPool* speculator = nullptr;  ///< null or empty: no speculation.
  RouterMetrics* metrics = nullptr;   ///< optional.
  RequestDefaults defaults;
  /// Per speculator call: Score and each Draft round (ReleaseSession runs
  /// in the background with a 30 s deadline).
  absl::Duration speculator_deadline = absl::Seconds(2);
  /// Speculative decoding under load (vLLM's speculative_disable_by_batch_
  /// size): with this many requests running, rounds go without drafts;
  /// from half of it on, the draft length shrinks (DraftTokensUnderLoad).
  /// 0 = never.
  int spec_decode_disable_by_batch_size = 0;
  /// Requests running now (the router's in-flight count); null = 0.
  std::function<int()> running_requests;
};

/// Draft tokens per round for a request asking `k` while `running`
/// requests run, under the rule above with threshold `disable_at`: k up to
/// half the threshold, then linearly fewer (at least 1), none at the
/// threshold. k unchanged when disable_at <= 0.
int DraftTokensUnderLoad(int k, int running, int disable_at);

/// Runs one request (see the file comment). One runner per request; Run is
/// called once, Cancel from any thread at any time while the runner lives.
class RequestRunner {
 public:
  /// Receives the output in order: one chunk per target round with the
  /// token ids emitted and the text they completed (text may lag behind
  /// the ids: multi-byte characters, possible stop strings). The last
  /// chunk carries finish_reason, usage and stats. Called on Run's thread.
  using Sink = std::function<void(const v1::GenerateTextChunk& chunk)>;

  explicit RequestRunner(const RouterBackends* backends);
  ~RequestRunner();

  /// Serves `request`, received at `start`, finishing by `deadline` (both
  /// downstream calls get it). Returns OK after the final chunk, else the
  /// error (chunks may have been sent before it): INVALID_ARGUMENT naming
  /// the field (ResolveOptions; no prompt; prompt ids outside the target's
  /// vocabulary; a prompt that leaves no room in the target's max context;
  /// text without a tokenizer); FAILED_PRECONDITION for a tokenizer
  /// mismatch between the router and a replica; UNAVAILABLE when no target
  /// replica answers; DEADLINE_EXCEEDED; CANCELLED after Cancel(); the
  /// target's own status otherwise.
  absl::Status Run(const v1::GenerateTextRequest& request, absl::Time start,
                   absl::Time deadline, const Sink& sink);

  /// Cancels the downstream calls (both sessions are freed); Run returns
  /// CANCELLED soon after. Idempotent.
  void Cancel();

 private:
  class Calls;  // the downstream contexts to cancel
  struct Plan;  // what Speculator.Score contributed
  // Calls Score; a failure becomes plan->fallback. Errors only when the
  // request itself is over (cancelled, deadline) or FAILED_PRECONDITION.
  absl::Status Speculate(const ResolvedOptions& opts,
                         const std::vector<int>& prompt, absl::Time deadline,
                         Plan* plan);

  const RouterBackends* backends_;
  std::unique_ptr<Calls> calls_;
};

/// ReplicaPool::InfoFn for speculator / target replicas (their Info RPC).
ReplicaPool::InfoFn SpeculatorInfoFn();
ReplicaPool::InfoFn TargetInfoFn();

/// Folds a chunk into a unary response: text and token ids appended, the
/// final chunk's finish reason, usage and stats copied.
void AppendChunk(const v1::GenerateTextChunk& chunk,
                 v1::GenerateTextResponse* response);

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_REQUEST_RUNNER_H_
