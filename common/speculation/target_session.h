#ifndef SPECSERVE_COMMON_SPECULATION_TARGET_SESSION_H_
#define SPECSERVE_COMMON_SPECULATION_TARGET_SESSION_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/decoding/json_grammar.h"
#include "common/decoding/logprobs.h"
#include "common/decoding/logits_processors.h"
#include "common/decoding/sampling.h"
#include "common/decoding/stop.h"
#include "common/decoding/tree_verification.h"
#include "common/decoding/verification.h"
#include "common/engine/model_runner.h"
#include "common/scheduling/session.h"

namespace specserve {

/// A target request: the (possibly pruned) prompt with its original
/// positions, and how to generate.
struct TargetRequest {
  std::vector<int> token_ids;     ///< [n] kept prompt tokens.
  std::vector<int> position_ids;  ///< [n] strictly increasing, original.
  /// Original prompt length: generated token i sits at next_position + i,
  /// never at n + i (docs/ARCHITECTURE.md, Speculative Prefill step 7). -1 = last
  /// position + 1.
  int next_position = -1;
  SamplingParams sampling;
  /// With sampling's penalties: the whole prompt as the user sent it, the
  /// ids Speculative Prefill pruned included (repetition_penalty reads
  /// it). Empty = token_ids.
  std::vector<int> penalty_prompt_ids;
  /// max_new_tokens and stop ids; EOS ids and the context limit are taken
  /// from the model config by Create (unless ignore_eos).
  StopConditions stop;
  bool ignore_eos = false;
  int max_drafts = 64;  ///< drafts accepted per round at most.
  /// Each emitted token's logprob under the raw logits of the row that
  /// produced it (RoundResult::logprobs), with the top_logprobs (0..20)
  /// likeliest alternatives. The round's final rows then come back as
  /// logits and are reduced (argmax, SampleRow) on the host, with the same
  /// uniforms: the tokens do not change.
  bool logprobs = false;
  int top_logprobs = 0;
  /// vLLM's prompt_logprobs: -1 = none; else every prompt token after the
  /// first gets its logprob under the raw logits of the row before it
  /// (teacher forcing), with this many (0..20) likeliest alternatives, in
  /// the first round's RoundResult::prompt_logprobs. Needs the whole prompt
  /// (position_ids 0..n-1: a pruned prompt has no row before a dropped
  /// token) and bypasses the prefix cache on the first prefill (cached rows
  /// have no logits). Prompt rows then run in chunks of at most
  /// kPromptLogprobChunk rows, apart from the round's final forward.
  int prompt_logprobs = -1;
  /// With sampling.json_object (required then): the vocabulary's JSON
  /// mask, built by the service from its tokenizer; outlives the session.
  const JsonTokenMask* json_mask = nullptr;
};

/// One round: the prefill (with optional drafts) or one verification.
struct RoundResult {
  int num_drafts = 0;    ///< drafts verified (after clipping to budgets).
  int num_accepted = 0;  ///< of those, accepted.
  std::vector<int> tokens;  ///< emitted this round (after stop handling).
  /// With TargetRequest::logprobs: [tokens.size()], token i's logprob and
  /// top alternatives; else empty.
  std::vector<TokenLogprobs> logprobs;
  /// With TargetRequest::prompt_logprobs >= 0, in the first round only:
  /// [n - 1] for prompt tokens 1..n-1, in order.
  std::vector<TokenLogprobs> prompt_logprobs;
  FinishReason finish = FinishReason::kNone;
  /// The round's forwards + verification (with a scheduler: the time of
  /// the batched forwards that carried it, shared with other sessions).
  int64_t forward_ns = 0;
};

/// The target's per-request state: prefill of the kept tokens at their
/// original positions, then rounds that verify drafts in ONE forward over
/// [last emitted token, x_1..x_k] (Leviathan et al. 2023; greedy or lossless
/// rejection sampling, docs/ARCHITECTURE.md) and roll the KV cache
/// back to the accepted length. k = 0 is a plain decode step; the first
/// round verifies its drafts in the prefill forward. With a logit bias,
/// penalties or JSON mode, or while StopConditions::min_new_tokens masks
/// EOS and stop ids, each final row is adjusted for the output before it
/// (the emitted tokens, then the drafts on its path): the backend applies
/// the round's LogitEdits before its argmax / SampleRow, or (a sampled
/// tree, logprobs) the rows come back as logits and are decided here by
/// the same rules.
class TargetSession : public Session {
 public:
  /// Validates the request: INVALID_ARGUMENT naming the field for an empty
  /// prompt, length mismatch, ids outside the vocabulary, positions not
  /// strictly increasing or at/after the max context, next_position <= the
  /// last position or >= max context, bad sampling or stop conditions,
  /// penalty_prompt_ids or logit_bias ids outside the vocabulary,
  /// max_new_tokens < 1, top_logprobs outside [0, kMaxTopLogprobs] or
  /// above 0 without logprobs, prompt_logprobs outside [-1,
  /// kMaxTopLogprobs] or set for a pruned prompt (positions not 0..n-1, or
  /// next_position not n).
  static absl::StatusOr<std::unique_ptr<TargetSession>> Create(
      ModelRunner* model, TargetRequest request);

  /// Runs the next round with `drafts` (validated: ids in the vocabulary,
  /// well-formed q when sampling; at most max_drafts). Drafts past the
  /// token budget or context are dropped. `parents` empty = a chain;
  /// otherwise a token tree (tree_verification.h: parents[i] in [-1, i),
  /// -1 = the last emitted token), verified in one forward with a tree
  /// attention mask (VerifyDraftTree); the nodes past the budget (by
  /// depth) are dropped. FAILED_PRECONDITION once finished.
  /// = BeginRound + (PlanForward, Forward, CompleteForward) until the
  /// round completes, with no limit on the rows per forward.
  absl::StatusOr<RoundResult> Step(absl::Span<const DraftToken> drafts,
                                   absl::Span<const int> parents = {});

  // ---- The same round in steps, for a scheduler that batches the
  // forwards of many sessions (vLLM v1's model runner step) and splits long
  // prefills into chunks (chunked prefill, Agrawal et al. 2023 Sarathi). ----

  /// Starts a round with `drafts` and `parents` (validated and clipped as
  /// in Step). FAILED_PRECONDITION once finished or while a round is in
  /// progress; INVALID_ARGUMENT for bad drafts or parents.
  ///
  /// After a tree round the KV cache keeps the context and the accepted
  /// path's nodes only while they sit in consecutive slots right after the
  /// last context token (a depth-first preorder with the likeliest child
  /// first makes that the common case); the accepted tokens after the
  /// first gap are forwarded again at the start of the next round's final
  /// forward, so they cost rows, not a forward.
  absl::Status BeginRound(absl::Span<const DraftToken> drafts,
                          absl::Span<const int> parents = {});
  /// Whether a round is in progress (begun, not yet completed or aborted).
  bool in_round() const { return in_round_; }
  /// Rows the round still needs to forward: the context tokens (prompt +
  /// emitted tokens) not in the KV cache, then the drafts; the last
  /// context token and the drafts go in the round's final forward.
  int pending_rows() const override;
  /// Fewest rows the round's next forward may have: 1 while more than one
  /// context token is left to compute, else the final rows (1 + drafts).
  int min_forward_rows() const override;
  /// Whether the round's remaining rows include more than the last context
  /// token (a prompt, or a recomputation after a preemption: chunkable,
  /// scheduled after decode-like rows), as opposed to one decode or
  /// verify forward.
  bool prefilling() const override;
  /// Fills `entry` with the round's next forward over at most `max_rows`
  /// rows (>= 1): a prefill chunk without logits, or the round's final
  /// rows (the prompt's tail or the last token, then the drafts) with
  /// their logits. The final rows are never split, so a final forward
  /// needs max_rows >= its rows (else only prompt tokens, leaving the last
  /// one, are planned; with one prompt token left and drafts that do not
  /// fit, FAILED_PRECONDITION). `entry` points into this session: valid
  /// until CompleteForward / Abort.
  absl::Status PlanForward(int max_rows, SequenceForward* entry) override;
  /// Consumes the output of the forward PlanForward planned: for a prefill
  /// chunk advances the prompt; for the final rows verifies the drafts,
  /// rolls the KV cache back to the accepted length and completes the
  /// round (round_complete(); TakeRoundResult() hands the result out).
  absl::Status CompleteForward(const ForwardOutput& out) override;
  /// Whether the last CompleteForward completed a round whose result is
  /// not yet taken.
  bool round_complete() const { return result_.has_value(); }
  /// The completed round's result (FAILED_PRECONDITION if none).
  absl::StatusOr<RoundResult> TakeRoundResult();
  /// Ends a round whose forward failed: rolls the KV cache back to where
  /// the round started (nothing of it is kept).
  void Abort() override;

  /// Preemption by recomputation (vLLM's default under KV pressure; run
  /// by the scheduler's SessionRegistry, between forwards):
  /// frees every KV block. The context (kept prompt tokens at their
  /// original positions, then the emitted tokens) is forwarded again,
  /// chunked like a prompt, before the round's final rows; the prompt's
  /// full blocks may come back from the prefix cache. Tokens and
  /// verification results do not change.
  void Preempt() override;
  int num_preemptions() const override { return num_preemptions_; }
  ~TargetSession() override;

  bool finished() const { return stop_.finished(); }
  FinishReason finish_reason() const { return stop_.reason(); }
  /// Every token emitted so far.
  const std::vector<int>& output() const { return output_; }
  /// Prompt tokens the prefix cache supplied (not forwarded).
  int cached_prompt_tokens() const { return cached_prompt_tokens_; }
  /// Bytes of KV cache in use / reserved for this request.
  size_t kv_bytes() const { return cache_->bytes_used(); }
  /// Tokens in the KV cache.
  int kv_tokens() const { return cache_->size(); }
  /// The session's sequence in the model's paged KV cache.
  const KvSequence* kv_sequence() const override { return cache_.get(); }
  size_t kv_capacity_bytes() const { return cache_->bytes_capacity(); }
  /// Tokens the KV cache may need: kept + max_new_tokens + max_drafts.
  static int CapacityFor(const ModelConfig& config, const TargetRequest& r);
  /// Rows per prefill forward while prompt logprobs are collected: their
  /// logits are computed for every row ([rows, vocab] fp32, 256 MB at a
  /// 128K vocabulary).
  static constexpr int kPromptLogprobChunk = 512;

 private:
  TargetSession(ModelRunner* model, TargetRequest request,
                std::unique_ptr<KvSequence> cache);
  // The context: the kept prompt tokens, then every emitted token. The KV
  // cache holds a prefix of it (all but the last token between rounds,
  // unless preempted).
  int context_size() const;
  int ContextToken(int i) const;
  int ContextPosition(int i) const;
  // Position of the next token after the context (of the first draft).
  int NextPosition() const;
  // Context tokens the round's final forward carries: the last one, plus
  // the accepted tree tokens the cache did not keep (rewrite_).
  int final_tail() const { return 1 + rewrite_; }
  // On an empty KV cache, attaches the prompt's cached full blocks (not
  // while prompt logprobs are collected).
  void AttachCachedPrompt();
  // Whether prompt rows still owe their prompt logprobs.
  bool CollectsPromptLogprobs() const;
  // Whether the round's final rows are adjusted before they are decided:
  // a logit bias or penalties, or EOS / stop ids still masked
  // (min_new_tokens not reached).
  bool AdjustsLogits() const;
  // Each final row's adjustments ([k + 1] rows of edits): row r follows
  // the drafts on its path (a chain's first r drafts; a tree's row 1 + i
  // node i and its ancestors), which count as output for the penalties
  // and min_new_tokens.
  LogitEdits RoundEdits() const;
  // Whether adjusted final rows come back as logits and are decided here
  // (DecideOnHost): a sampled tree (its recursive rejection reads the
  // logits) or a request with logprobs (of the raw logits). Other adjusted
  // rounds hand RoundEdits() to the backend, which decides the edited rows
  // where the logits are.
  bool DecidesOnHost() const;
  // The final rows' logits ([k + 1, vocab]) with RoundEdits() applied, and
  // their argmax (greedy) or SampleRow outcomes (a sampled chain).
  struct HostRows {
    std::vector<float> logits;
    std::vector<int> argmax;
    std::vector<int> sampled;
    std::vector<uint8_t> accepted;
  };
  HostRows DecideOnHost(absl::Span<const float> logits) const;

  ModelRunner* model_;
  TargetRequest request_;
  std::unique_ptr<KvSequence> cache_;  // this request's blocks in the model's paged cache
  StopChecker stop_;
  Rng rng_;
  bool prefilled_ = false;
  std::vector<int> output_;

  int cached_prompt_tokens_ = 0;  // first prefill: from the prefix cache
  // The prompt's cached blocks are looked up on the next empty cache:
  // first, and after a preemption or an aborted first round.
  bool attach_pending_ = true;
  int num_preemptions_ = 0;

  // The round in progress.
  bool in_round_ = false;
  std::vector<DraftToken> drafts_;  // clipped
  std::vector<int> parents_;        // empty = a chain
  std::vector<int> depths_;         // of each tree node
  std::vector<int> span_parents_;   // the forward's tree_parents
  int rewrite_ = 0;  // accepted tokens of the last tree round not in cache
  int round_start_ = 0;   // cache size when the round began
  int64_t round_ns_ = 0;  // time spent in this round's forwards
  int64_t planned_at_ = 0;
  bool final_planned_ = false;
  std::vector<int> plan_tokens_, plan_positions_;  // the planned forward
  RowSampling row_sampling_;  // a sampled chain's final forward
  LogitEdits logit_edits_;    // an adjusted final forward's, on the backend
  std::optional<PenaltyTracker> penalties_;  // with sampling's penalties
  std::optional<JsonMatcher> json_;  // JSON mode: the output so far
  std::optional<RoundResult> result_;  // the completed round, not yet taken
  // Prompt logprobs collected so far (entry i: prompt token i + 1, from
  // prompt row i), and how many the planned chunk adds.
  std::vector<TokenLogprobs> prompt_lp_;
  int plan_prompt_lp_ = 0;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SPECULATION_TARGET_SESSION_H_
