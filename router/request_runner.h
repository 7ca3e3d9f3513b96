#ifndef SPECSERVE_ROUTER_REQUEST_RUNNER_H_
#define SPECSERVE_ROUTER_REQUEST_RUNNER_H_

// The generation loop: one router request from prompt to text.
//
//   tokenize -> Speculator.Score (keep_session when drafting) ->
//   Target.Generate: Prefill{kept ids, their original positions,
//                            next_position = prompt length,
//                            drafts = look-ahead tokens}
//   loop { target round -> emit tokens (incremental detokenizer, stop
//          strings) -> Speculator.Draft(emitted tokens, k) -> Drafts }
//   -> release both sessions.
//
// Options and the prompt are resolved first (request_options.h); the
// backends are reached through speculator_client.h and target_client.h;
// what the client sees is built by OutputProcessor (output_processor.h).
// docs/ARCHITECTURE.md follows a request through these files.
//
// Drafting methods (speculative_decoding.method, draft_proposer.h):
// "draft" as above; "draft_tree" the same with each Draft round asking for
// a token tree whose parents go on to the target; "ngram" proposes by
// prompt lookup in the router (common/decoding/ngram_proposer.h) over the
// full prompt and the emitted tokens, so the speculator is called only to
// prune the prompt (Score without a session) and not at all without
// Speculative Prefill.
//
// Degradations: a speculator that is unavailable, failing or
// past --speculator_deadline_ms at Score -> full prefill and plain decoding
// on the target (stats.fallback_reason, specserve_router_fallbacks_total),
// or for "ngram" full prefill and prompt-lookup drafts still; one that
// fails mid-generation -> the remaining rounds carry no drafts.

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
#include "router/request_options.h"

namespace specserve {

class RouterMetrics;
class Tokenizer;

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

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_REQUEST_RUNNER_H_
