#ifndef SPECSERVE_COMMON_SPECULATION_DRAFT_SESSION_H_
#define SPECSERVE_COMMON_SPECULATION_DRAFT_SESSION_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/decoding/json_grammar.h"
#include "common/decoding/logits_processors.h"
#include "common/decoding/sampling.h"
#include "common/decoding/verification.h"
#include "common/engine/model_runner.h"
#include "common/specprefill/importance.h"
#include "common/specprefill/score_options.h"
#include "common/specprefill/selection.h"
#include "common/scheduling/session.h"

namespace specserve {

/// The shape of a draft tree (speculator.proto DraftTreeShape). Greedy
/// (EAGLE-2's dynamic tree, Li et al. 2024): at depth d the branching[d]
/// likeliest nodes (product of the draft's softmax probabilities along the
/// path) get their branching[d] top tokens as children; the max_nodes
/// likeliest nodes of all are kept. Sampled: every expanded node at depth
/// d gets branching[d] children drawn i.i.d. from q, likeliest paths
/// expanded first, until max_nodes nodes exist.
struct DraftTreeShape {
  std::vector<int> branching;  ///< size = depth in [1, 16]; each in [1, 8]
  int max_nodes = 16;          ///< [1, 64]
  /// [0, 1). A node grows children only if its path probability (the
  /// product of the speculator's probabilities along its path, the
  /// expected number of times it is accepted if the speculator is
  /// calibrated) is at least this, and greedy trees also leave out
  /// children below it, except the root's likeliest child (an empty tree
  /// would cost the round trip for one token): a confidence-sized tree
  /// (EAGLE-2's dynamic tree, Li et al. 2024) that spends verify rows only
  /// where they are likely to pay. 0 = the full shape.
  double min_path_prob = 0.0;
};

/// INVALID_ARGUMENT naming the field unless `shape` is in the ranges above.
absl::Status ValidateDraftTreeShape(const DraftTreeShape& shape);

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
  /// `json_mask`: with sampling.json_object, the vocabulary's JSON mask
  /// (outlives the session), so drafts keep the output a JSON object as
  /// the target will; null = drafts unconstrained (still lossless, more
  /// often rejected).
  /// INVALID_ARGUMENT for bad sampling params or capacity.
  static absl::StatusOr<std::unique_ptr<DraftSession>> Create(
      ModelRunner* model, int capacity, const SamplingParams& sampling,
      const JsonTokenMask* json_mask = nullptr);

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

  /// As Draft, but proposes a token tree of `shape` (DraftTreeShape; SpecInfer
  /// verification), one speculator forward per depth with a tree attention
  /// mask. Greedy requests take each expanded node's top tokens; sampled
  /// requests draw its children i.i.d. from q (each child carries that q),
  /// which lossless tree verification needs.
  /// Returns the nodes in depth-first preorder (a node's children in the
  /// order drawn: the likeliest first when greedy) and fills `parents`
  /// (tree_verification.h; -1 = child of the last emitted token). The
  /// tree's KV is dropped at the next Draft (the accepted tokens are fed
  /// again with it). INVALID_ARGUMENT for a bad shape or ids.
  absl::StatusOr<std::vector<DraftToken>> DraftTree(
      absl::Span<const int> emitted, const DraftTreeShape& shape,
      std::vector<int>* parents);

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
  /// Starts a DraftTree: its checks and errors.
  absl::Status BeginDraftTree(absl::Span<const int> emitted,
                              const DraftTreeShape& shape);
  // Session: rows are single tokens, so any forward may take just one
  // (min_forward_rows() == 1), except a tree's depth, forwarded whole.
  // The last forward of a Score runs the importance reduction and the
  // selection (their errors end it).
  int pending_rows() const override;
  int min_forward_rows() const override;
  bool prefilling() const override;
  absl::Status PlanForward(int max_rows, SequenceForward* entry) override;
  absl::Status CompleteForward(const ForwardOutput& out) override;
  void Abort() override;
  /// The finished Score's result (FAILED_PRECONDITION if none).
  absl::StatusOr<ScoreResult> TakeScoreResult();
  /// The finished Draft's (or DraftTree's) proposals; `parents`, if not
  /// null, gets the tree's parents (empty after a chain Draft).
  std::vector<DraftToken> TakeDrafts(std::vector<int>* parents = nullptr);

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
  // The next chain draft from the forward's last logit row: greedy, its
  // argmax; sampled, a draw from q (kept in the draft).
  DraftToken Propose(const ForwardOutput& out);
  // `logits` ([vocab]) adjusted as the target adjusts its rows (the logit
  // bias, the penalties for the output so far and then `pending`, the
  // JSON mask after them; a scratch copy, valid until the next call), or
  // `logits` itself without any: q then follows the target's p, which only
  // raises acceptance (any q is lossless). min_p is ComputeDistribution's.
  const float* Adjusted(const float* logits, absl::Span<const int> pending);
  // This call's drafts so far, which the next row follows: what penalties
  // and the JSON mask count as pending (empty when neither is on).
  std::vector<int> DraftIds() const;
  // Whether rows are adjusted (bias, penalties, JSON mode).
  bool Adjusts() const {
    return sampling_.adjusts_logits() || json_.has_value();
  }
  // The ids the JSON mask forbids after the output and `pending` (none
  // without JSON mode, or when a pending id breaks the object).
  std::vector<int> JsonDisallowed(absl::Span<const int> pending) const;
  // On an empty cache: attaches the cached full blocks of `tokens` (at
  // positions 0..) but the last token, sets cached_; returns the tokens.
  int AttachCachedPrefix(absl::Span<const int> tokens);
  // Runs the begun operation's forwards one at a time, unbatched.
  absl::Status RunOp();

  ModelRunner* model_;
  std::unique_ptr<KvSequence> cache_;  // this request's blocks in the model's paged cache
  SamplingParams sampling_;
  Rng rng_;
  std::vector<float> adjusted_;  // Adjusted's scratch row
  LogitEdits draft_edits_;       // a greedy adjusted draft's, on the backend
  // With the request's penalties: the prompt (from Score) and the tokens
  // the target emitted.
  std::optional<PenaltyTracker> penalties_;
  // JSON mode: the mask and the object the emitted tokens wrote so far.
  const JsonTokenMask* json_mask_ = nullptr;
  std::optional<JsonMatcher> json_;
  std::vector<int> cached_;     // token ids in the KV cache, in order
  std::vector<int> committed_;  // prompt + target-emitted tokens
  std::vector<int> look_ahead_;  // proposed by Score, unconfirmed
  bool started_ = false;
  int num_preemptions_ = 0;

  // The operation in progress (BeginScore / BeginDraft / BeginDraftTree).
  enum class Op { kNone, kScore, kDraft, kDraftTree };
  // Rolls back rejected drafts and sets feed_ for a Draft or DraftTree;
  // returns how many more tokens fit after the fed ones (room).
  absl::StatusOr<int> PrepareDraft(absl::Span<const int> emitted);
  // A tree node while drafting.
  struct TreeNode {
    DraftToken token;
    int parent = -1;  // node index, -1 = the root (last committed token)
    int depth = 0;
    double path_prob = 1.0;  // product of draft probabilities to here
    int span_index = -1;     // in the KV span once forwarded, else -1
  };
  // Adds the children of `parent` (-1 = root) from its logits; false when
  // the budget is spent.
  void ExpandTreeNode(int parent, const float* logits);
  // Picks the next depth's nodes to forward (level_) among those the last
  // expansion added, nodes_[first_new..]; none = finished.
  void NextTreeLevel(int first_new);
  // The finished tree in depth-first preorder.
  void EmitTree();
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
  std::vector<int> draft_parents_;  // a finished tree's parents
  DraftTreeShape tree_shape_;
  std::vector<TreeNode> nodes_;
  std::vector<int> level_;          // nodes of the next tree forward
  std::vector<int> span_parents_;   // tree_parents of the cached nodes
  int tree_depth_limit_ = 0;
  int tree_room_ = 0;            // tree nodes the KV cache can still take
  bool planned_level_ = false;   // the planned forward is a tree depth
  int64_t t_begin_ = 0, t_prefilled_ = 0;
  std::vector<int> plan_tokens_, plan_positions_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SPECULATION_DRAFT_SESSION_H_
