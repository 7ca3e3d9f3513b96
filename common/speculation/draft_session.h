#ifndef SPECSERVE_COMMON_SPECULATION_DRAFT_SESSION_H_
#define SPECSERVE_COMMON_SPECULATION_DRAFT_SESSION_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/decoding/sampling.h"
#include "common/decoding/verification.h"
#include "common/engine/model_runner.h"
#include "common/specprefill/importance.h"
#include "common/specprefill/score_options.h"
#include "common/specprefill/selection.h"
#include "common/scheduling/session.h"

namespace specserve {

/// What scoring found for one prompt.
struct ScoreResult {
  Selection selection;               ///< kept indices, positions, next pos.
  std::vector<int> look_ahead_tokens;  ///< greedy, stops before EOS.
  std::vector<float> importance;     ///< [prompt_len], mean over rows.
  std::vector<std::vector<float>> per_row_importance;  ///< [rows][prompt_len]
  int64_t prefill_ns = 0;     ///< full-prompt forward.
  int64_t look_ahead_ns = 0;  ///< look-ahead decode steps.
  int64_t score_ns = 0;       ///< importance + selection (after forwards).
};

/// The speculator's per-request state (one small model does both jobs):
/// Score() prefills the FULL prompt, decodes the look-ahead tokens and
/// scores the prompt; the KV cache it built (prompt + look-ahead) then
/// serves Draft(), so drafting never prefills the prompt twice. The
/// look-ahead tokens are the first draft proposal.
///
/// Positions are the speculator's own, contiguous: token i at position i.
/// Not thread-safe; a session is used by one request at a time.
class DraftSession : public Session {
 public:
  /// `capacity`: KV cache tokens (<= the model's max context).
  /// INVALID_ARGUMENT for bad sampling params or capacity.
  static absl::StatusOr<std::unique_ptr<DraftSession>> Create(
      ModelRunner* model, int capacity, const SamplingParams& sampling);

  /// Speculative Prefill scoring of `prompt` (token ids, BOS included; the
  /// session must be fresh). Rows = the last prompt token + the look-ahead
  /// tokens; keys = prompt keys only; reduced layer by layer.
  /// INVALID_ARGUMENT (bad ids/options, second call), RESOURCE_EXHAUSTED
  /// (prompt + look-ahead beyond capacity).
  absl::StatusOr<ScoreResult> Score(absl::Span<const int> prompt,
                                    const ScoreOptions& options);

  /// Appends the tokens the target emitted since the last call (accepted
  /// drafts, then the correction or bonus), rolls back the rejected drafts
  /// and proposes up to `k` new draft tokens (fewer near the context
  /// limit; none at it). Greedy drafts carry no q; sampled drafts carry
  /// q = the draft distribution after the request's transform. The
  /// look-ahead tokens of Score() count as already proposed.
  /// INVALID_ARGUMENT for k outside [1, 64] or ids outside the vocabulary.
  absl::StatusOr<std::vector<DraftToken>> Draft(absl::Span<const int> emitted,
                                                int k);

  // ---- Score and Draft in steps, for a scheduler that batches the
  // forwards of many sessions (common/scheduling/batch_scheduler.h) and
  // splits long prompts into chunks. Score() and Draft() are Begin*, then
  // (PlanForward, Forward, CompleteForward) while pending_rows() > 0, then
  // Take*. ----

  /// Starts a Score: the checks and errors of Score().
  absl::Status BeginScore(absl::Span<const int> prompt,
                          const ScoreOptions& options);
  /// Starts a Draft: the checks and errors of Draft(); rolls the cache
  /// back to the agreed prefix now. With the context full it needs no
  /// forward (pending_rows() == 0, no drafts).
  absl::Status BeginDraft(absl::Span<const int> emitted, int k);
  // Session: rows are single tokens, so any forward may take just one
  // (min_forward_rows() == 1). The last forward of a Score runs the
  // importance reduction and the selection (their errors end it).
  int pending_rows() const override;
  int min_forward_rows() const override { return 1; }
  bool prefilling() const override;
  absl::Status PlanForward(int max_rows, SequenceForward* entry) override;
  absl::Status CompleteForward(const ForwardOutput& out) override;
  void Abort() override;
  /// The finished Score's result (FAILED_PRECONDITION if none).
  absl::StatusOr<ScoreResult> TakeScoreResult();
  /// The finished Draft's proposals.
  std::vector<DraftToken> TakeDrafts();

  /// Preemption by recomputation (run by the scheduler's SessionRegistry,
  /// between forwards): frees every KV block. An operation
  /// in progress starts over on the empty cache (a Score forgets its
  /// look-ahead and captured queries; a Draft re-feeds every committed
  /// token and proposes again); an idle session re-feeds at its next
  /// Draft. Prompt blocks may come back from the prefix cache.
  void Preempt() override;
  int num_preemptions() const override { return num_preemptions_; }
  ~DraftSession() override;

  /// Prompt tokens of the last Score the prefix cache supplied.
  int cached_prompt_tokens() const { return cached_prompt_tokens_; }
  /// Prompt + target-emitted tokens so far.
  const std::vector<int>& committed() const { return committed_; }
  /// Bytes of KV cache currently used.
  size_t kv_bytes() const { return cache_->bytes_used(); }
  /// Tokens in the KV cache.
  int kv_tokens() const { return cache_->size(); }
  /// The session's sequence in the model's paged KV cache.
  const KvSequence* kv_sequence() const override { return cache_.get(); }
  size_t kv_capacity_bytes() const { return cache_->bytes_capacity(); }

 private:
  DraftSession(ModelRunner* model, std::unique_ptr<KvSequence> cache,
               const SamplingParams& sampling);
  DraftToken Propose(const float* logits);
  // On an empty cache: attaches the cached full blocks of `tokens` (at
  // positions 0..) but the last token, sets cached_; returns the tokens.
  int AttachCachedPrefix(absl::Span<const int> tokens);
  // Runs the begun operation's forwards one at a time, unbatched.
  absl::Status RunOp();

  ModelRunner* model_;
  std::unique_ptr<KvSequence> cache_;  // this request's blocks in the model's paged cache
  SamplingParams sampling_;
  Rng rng_;
  std::vector<int> cached_;     // token ids in the KV cache, in order
  std::vector<int> committed_;  // prompt + target-emitted tokens
  std::vector<int> look_ahead_;  // proposed by Score, unconfirmed
  bool started_ = false;
  int num_preemptions_ = 0;

  // The operation in progress (BeginScore / BeginDraft).
  enum class Op { kNone, kScore, kDraft };
  // Appends the planned tokens to cached_ after their forward.
  void CommitPlanned();
  absl::Status FinishScore();
  Op op_ = Op::kNone;
  int op_start_ = 0;             // cache size when the forwards began
  std::vector<int> feed_;        // tokens to forward before proposing
  int fed_ = 0;                  // of feed_, forwarded
  int cached_prompt_tokens_ = 0;  // of the prompt, from the prefix cache
  int wanted_ = 0;               // Score: look-ahead; Draft: drafts
  int next_token_ = -1;          // the next single row to forward
  bool finished_op_ = false;
  ScoreOptions score_options_;
  std::unique_ptr<QueryCapture> capture_;
  ScoreResult score_;
  std::vector<DraftToken> drafts_;
  int64_t t_begin_ = 0, t_prefilled_ = 0;
  std::vector<int> plan_tokens_, plan_positions_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SPECULATION_DRAFT_SESSION_H_
