#include "common/speculation/target_session.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/decoding/row_sampling.h"
#include "common/util/clock.h"

namespace specserve {

int TargetSession::CapacityFor(const ModelConfig& config,
                               const TargetRequest& r) {
  const int64_t want = static_cast<int64_t>(r.token_ids.size()) +
                       r.stop.max_new_tokens + r.max_drafts + 1;
  return static_cast<int>(
      std::min<int64_t>(want, config.max_position_embeddings));
}

TargetSession::TargetSession(ModelRunner* model, TargetRequest request,
                             std::unique_ptr<KvSequence> cache)
    : model_(model),
      request_(std::move(request)),
      cache_(std::move(cache)),
      stop_(request_.stop, request_.next_position),
      rng_(request_.sampling.seed) {
  if (request_.sampling.has_penalties()) {
    penalties_.emplace(request_.penalty_prompt_ids.empty()
                           ? request_.token_ids
                           : request_.penalty_prompt_ids);
  }
  if (request_.sampling.json_object) {
    json_.emplace(request_.sampling.json_schema.get());
  }
}

TargetSession::~TargetSession() {
  // Before any member goes: waits for a preemption in progress.
  StopPreemption();
}

absl::StatusOr<std::unique_ptr<TargetSession>> TargetSession::Create(
    ModelRunner* model, TargetRequest r) {
  const ModelConfig& c = model->config();
  const int n = static_cast<int>(r.token_ids.size());
  const int max_ctx = c.max_position_embeddings;
  if (n == 0) return absl::InvalidArgumentError("token_ids is empty");
  if (r.position_ids.size() != r.token_ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "position_ids has ", r.position_ids.size(), " entries, token_ids ", n));
  }
  for (int i = 0; i < n; ++i) {
    if (r.token_ids[i] < 0 || r.token_ids[i] >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_ids[", i, "] = ", r.token_ids[i],
                       " outside the vocabulary [0, ", c.vocab_size, ")"));
    }
    if (r.position_ids[i] < 0 || r.position_ids[i] >= max_ctx) {
      return absl::InvalidArgumentError(
          absl::StrCat("position_ids[", i, "] = ", r.position_ids[i],
                       " outside [0, ", max_ctx, ")"));
    }
    if (i > 0 && r.position_ids[i] <= r.position_ids[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "position_ids must be strictly increasing: position_ids[", i,
          "] = ", r.position_ids[i], " after ", r.position_ids[i - 1]));
    }
  }
  if (r.next_position < 0) r.next_position = r.position_ids.back() + 1;
  if (r.next_position <= r.position_ids.back()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "next_position ", r.next_position,
        " must be greater than the last position ", r.position_ids.back()));
  }
  if (r.next_position >= max_ctx) {
    return absl::InvalidArgumentError(
        absl::StrCat("next_position ", r.next_position,
                     " is at or past the max context ", max_ctx));
  }
  if (auto s = ValidateSamplingParams(r.sampling); !s.ok()) return s;
  for (const auto& [id, bias] : r.sampling.logit_bias) {
    if (id >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_bias id ", id, " outside the vocabulary [0, ",
                       c.vocab_size, ")"));
    }
  }
  for (size_t i = 0; i < r.penalty_prompt_ids.size(); ++i) {
    const int id = r.penalty_prompt_ids[i];
    if (id < 0 || id >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("penalty_prompt_ids[", i, "] = ", id,
                       " outside the vocabulary [0, ", c.vocab_size, ")"));
    }
  }
  if (r.stop.max_new_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens must be >= 1, got ", r.stop.max_new_tokens));
  }
  if (r.top_logprobs < 0 || r.top_logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs must be in [0, ", kMaxTopLogprobs,
                     "], got ", r.top_logprobs));
  }
  if (r.top_logprobs > 0 && !r.logprobs) {
    return absl::InvalidArgumentError("top_logprobs needs logprobs");
  }
  if (r.prompt_logprobs < -1 || r.prompt_logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_logprobs must be in [-1, ", kMaxTopLogprobs,
                     "], got ", r.prompt_logprobs));
  }
  if (r.prompt_logprobs >= 0 &&
      (r.position_ids.back() != n - 1 || r.next_position != n)) {
    // Strictly increasing from >= 0, so the last one being n - 1 means
    // 0..n-1.
    return absl::InvalidArgumentError(
        "prompt_logprobs needs the whole prompt (position_ids 0..n-1, "
        "next_position n): a pruned prompt has no logprobs for the tokens "
        "Speculative Prefill dropped");
  }
  if (r.max_drafts < 0 || r.max_drafts > 64) {
    return absl::InvalidArgumentError("max_drafts must be in [0, 64]");
  }
  // Refused as the request's (INVALID_ARGUMENT, 400 over HTTP): this model
  // cannot serve JSON mode.
  if (r.sampling.json_object && r.json_mask == nullptr) {
    return absl::InvalidArgumentError(
        "sampling.json_object: JSON mode needs the target's tokenizer; this "
        "checkpoint has none");
  }
  const bool choice =
      r.sampling.json_schema != nullptr && r.sampling.json_schema->raw_choice();
  if (r.sampling.json_object && !choice && !r.json_mask->can_open()) {
    return absl::InvalidArgumentError(
        "sampling.json_object: JSON mode is not available: no token of this "
        "vocabulary can write '{'");
  }
  if (!r.ignore_eos) r.stop.eos_token_ids = c.eos_token_ids;
  r.stop.max_context = max_ctx;
  if (auto s = ValidateStopConditions(r.stop, c.vocab_size); !s.ok()) return s;
  auto cache = model->NewSequence(CapacityFor(c, r));
  if (!cache.ok()) return cache.status();
  return std::unique_ptr<TargetSession>(
      new TargetSession(model, std::move(r), *std::move(cache)));
}

absl::StatusOr<RoundResult> TargetSession::Step(
    absl::Span<const DraftToken> drafts, absl::Span<const int> parents) {
  if (absl::Status s = BeginRound(drafts, parents); !s.ok()) return s;
  while (true) {
    SequenceForward entry;
    if (absl::Status s = PlanForward(pending_rows(), &entry); !s.ok()) {
      Abort();
      return s;
    }
    ForwardOutput out;
    if (absl::Status s = model_->Forward(entry.input, entry.kv, &out);
        !s.ok()) {
      Abort();
      return s;
    }
    if (absl::Status s = CompleteForward(out); !s.ok()) return s;
    if (round_complete()) return TakeRoundResult();
  }
}

absl::Status TargetSession::BeginRound(absl::Span<const DraftToken> drafts,
                                       absl::Span<const int> parents) {
  const ModelConfig& c = model_->config();
  if (finished()) {
    return absl::FailedPreconditionError("generation already finished");
  }
  if (in_round_) {
    return absl::FailedPreconditionError("a round is already in progress");
  }
  if (static_cast<int>(drafts.size()) > request_.max_drafts) {
    return absl::InvalidArgumentError(
        absl::StrCat("too many drafts: ", drafts.size(), " > max ",
                     request_.max_drafts));
  }
  if (auto s = ValidateDrafts(drafts, c.vocab_size, request_.sampling.greedy());
      !s.ok()) {
    return s;
  }
  const bool tree = !parents.empty() && !IsChain(parents);
  if (!parents.empty()) {
    if (auto s = ValidateTreeParents(parents, static_cast<int>(drafts.size()));
        !s.ok()) {
      return s;
    }
  }
  const int generated = static_cast<int>(output_.size());
  // Clip drafts: each round emits accepted + 1 tokens, so drafts beyond
  // the remaining budget - 1 can never be emitted; fed positions must stay
  // inside the context. A tree loses the nodes that deep.
  int depth_limit = request_.stop.max_new_tokens - generated - 1;
  depth_limit = std::min(depth_limit,
                         c.max_position_embeddings - NextPosition());
  depth_limit = std::max(depth_limit, 0);
  drafts_.clear();
  parents_.clear();
  depths_.clear();
  if (!tree) {
    const int k = std::min(static_cast<int>(drafts.size()), depth_limit);
    drafts_.assign(drafts.begin(), drafts.begin() + k);
  } else {
    // Keep the nodes above the limit; a kept node's parent is kept too
    // (parents come first and are shallower), so re-index them.
    const std::vector<int> depth = TreeDepths(parents);
    std::vector<int> new_index(drafts.size(), -1);
    for (size_t i = 0; i < drafts.size(); ++i) {
      if (depth[i] >= depth_limit) continue;
      new_index[i] = static_cast<int>(drafts_.size());
      drafts_.push_back(drafts[i]);
      parents_.push_back(parents[i] < 0 ? -1 : new_index[parents[i]]);
      depths_.push_back(depth[i]);
    }
  }
  in_round_ = true;
  result_.reset();
  final_planned_ = false;
  round_start_ = cache_->size();
  round_ns_ = 0;
  AttachCachedPrompt();
  return absl::OkStatus();
}

int TargetSession::context_size() const {
  return static_cast<int>(request_.token_ids.size() + output_.size());
}

int TargetSession::ContextToken(int i) const {
  const int n = static_cast<int>(request_.token_ids.size());
  return i < n ? request_.token_ids[i] : output_[i - n];
}

int TargetSession::ContextPosition(int i) const {
  const int n = static_cast<int>(request_.token_ids.size());
  return i < n ? request_.position_ids[i] : request_.next_position + (i - n);
}

int TargetSession::NextPosition() const {
  return request_.next_position + static_cast<int>(output_.size());
}

bool TargetSession::CollectsPromptLogprobs() const {
  return request_.prompt_logprobs >= 0 && !prefilled_ &&
         prompt_lp_.size() + 1 < request_.token_ids.size();
}

void TargetSession::AttachCachedPrompt() {
  if (!attach_pending_ || cache_->size() != 0) return;
  if (CollectsPromptLogprobs()) return;  // every prompt row's logits
  attach_pending_ = false;
  // Prefix caching: whole blocks of the prompt (kept tokens at their
  // original positions) that another request, or this one before a
  // preemption, computed need no forward; the context's last token always
  // runs, for its logits.
  const int attached = cache_->AttachCachedPrefix(
      request_.token_ids, request_.position_ids, context_size() - 1);
  if (!prefilled_) cached_prompt_tokens_ = attached;
}

int TargetSession::pending_rows() const {
  if (!in_round_) return 0;
  return context_size() - cache_->size() + static_cast<int>(drafts_.size());
}

int TargetSession::min_forward_rows() const {
  if (!in_round_) return 0;
  const int left = context_size() - cache_->size();
  if (left > final_tail()) return 1;
  return left + static_cast<int>(drafts_.size());
}

bool TargetSession::prefilling() const {
  return in_round_ && context_size() - cache_->size() > final_tail();
}

void TargetSession::Preempt() {
  cache_->Clear();
  rewrite_ = 0;
  round_start_ = 0;
  attach_pending_ = true;
  ++num_preemptions_;
}

absl::Status TargetSession::PlanForward(int max_rows, SequenceForward* entry) {
  if (!in_round_) {
    return absl::FailedPreconditionError("no round in progress");
  }
  if (max_rows < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_rows must be >= 1, got ", max_rows));
  }
  AttachCachedPrompt();  // after a preemption in the middle of the round
  const int k = static_cast<int>(drafts_.size());
  const int ctx = context_size();
  const int done = cache_->size();
  const int left = ctx - done;
  plan_tokens_.clear();
  plan_positions_.clear();
  entry->input.logit_rows.clear();
  entry->input.capture_query_rows.clear();
  // The final forward (the context's uncomputed tail + drafts) is never
  // split: if it does not fit, forward all but the last context token now.
  // The tail is the prompt on the first round, a recomputation after a
  // preemption, else just the last emitted token.
  const int tail = std::min(left, final_tail());
  int take = left + k <= max_rows ? left : std::min(left - tail, max_rows);
  // Prompt rows that owe prompt logprobs go in chunks of their own: the
  // final forward's rows are decided, these are teacher-forced.
  const bool collect = CollectsPromptLogprobs() && left > tail;
  if (collect) take = std::min({left - tail, max_rows, kPromptLogprobChunk});
  if (take < 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the round's final forward needs ", tail + k, " rows, the budget is ",
        max_rows));
  }
  for (int i = done; i < done + take; ++i) {
    plan_tokens_.push_back(ContextToken(i));
    plan_positions_.push_back(ContextPosition(i));
  }
  final_planned_ = take == left;
  if (final_planned_) {
    const int base_row = take - 1;
    const int first_draft_pos = NextPosition();
    for (int j = 0; j < k; ++j) {
      plan_tokens_.push_back(drafts_[j].id);
      plan_positions_.push_back(first_draft_pos +
                                (parents_.empty() ? j : depths_[j]));
    }
    for (int j = 0; j <= k; ++j) entry->input.logit_rows.push_back(base_row + j);
  }
  // A tree's nodes are the span: the root's children (-1) see the context
  // before them, every node its ancestors.
  entry->input.tree_parents.clear();
  if (final_planned_ && !parents_.empty()) {
    entry->input.tree_parents = parents_;
  }
  // A chunk without the final rows still asks for its last row (the engine
  // returns at least one); CompleteForward ignores it.
  entry->kv = cache_.get();
  entry->capture = nullptr;
  entry->input.token_ids = plan_tokens_;
  entry->input.position_ids = plan_positions_;
  // Greedy rounds need each row's argmax only; sampled chain rounds each
  // row's SampleRow outcome (on CUDA both stay on the device), and with
  // logprobs the backend adds each row's logprobs. A sampled tree's
  // recursive rejection over siblings reads the logits (its logprobs are
  // computed from them in CompleteForward). Adjusted rows (a logit bias,
  // penalties, min_tokens) carry their edits to the backend, unless they
  // are decided here (DecidesOnHost).
  const bool greedy = request_.sampling.greedy();
  const bool host = final_planned_ && DecidesOnHost();
  entry->input.argmax_only = greedy && !host;
  entry->input.sampling = nullptr;
  entry->input.logit_edits = nullptr;
  if (final_planned_ && !host && AdjustsLogits()) {
    logit_edits_ = RoundEdits();
    entry->input.logit_edits = &logit_edits_;
  }
  entry->input.logprobs_top_n = final_planned_ && request_.logprobs &&
                                        (greedy || parents_.empty()) && !host
                                    ? request_.top_logprobs
                                    : -1;
  entry->input.logprob_ids.clear();
  plan_prompt_lp_ = 0;
  if (collect) {
    // Row g's logprob is of prompt token g + 1; rows collected before a
    // preemption are not asked again.
    const int first = std::max(done, static_cast<int>(prompt_lp_.size()));
    for (int g = first; g < done + take; ++g) {
      entry->input.logit_rows.push_back(g - done);
      entry->input.logprob_ids.push_back(request_.token_ids[g + 1]);
    }
    plan_prompt_lp_ = static_cast<int>(entry->input.logprob_ids.size());
    if (plan_prompt_lp_ > 0) {
      entry->input.argmax_only = true;
      entry->input.logprobs_top_n = request_.prompt_logprobs;
    }
  }
  if (final_planned_ && !greedy && parents_.empty()) {
    // Two uniforms per row, drawn for every row so a seeded request's
    // draws do not depend on where the first rejection falls.
    row_sampling_.params = request_.sampling;
    row_sampling_.draft_ids.clear();
    row_sampling_.draft_q.clear();
    row_sampling_.uniforms.clear();
    for (int j = 0; j <= k; ++j) {
      row_sampling_.draft_ids.push_back(j < k ? drafts_[j].id : -1);
      row_sampling_.draft_q.push_back(j < k ? &drafts_[j].q : nullptr);
      row_sampling_.uniforms.push_back(rng_.Uniform());
      row_sampling_.uniforms.push_back(rng_.Uniform());
    }
    if (!host) entry->input.sampling = &row_sampling_;
  }
  planned_at_ = MonotonicNowNs();
  return absl::OkStatus();
}

absl::Status TargetSession::CompleteForward(const ForwardOutput& out) {
  if (!in_round_) {
    return absl::FailedPreconditionError("no round in progress");
  }
  const ModelConfig& c = model_->config();
  if (!final_planned_) {
    if (plan_prompt_lp_ > 0) {
      if (out.token_logprobs.size() != static_cast<size_t>(plan_prompt_lp_)) {
        Abort();
        return absl::InternalError(absl::StrCat(
            "forward returned ", out.token_logprobs.size(),
            " prompt logprobs, expected ", plan_prompt_lp_));
      }
      prompt_lp_.insert(prompt_lp_.end(), out.token_logprobs.begin(),
                        out.token_logprobs.end());
    }
    round_ns_ += MonotonicNowNs() - planned_at_;
    return absl::OkStatus();
  }
  const int k = static_cast<int>(drafts_.size());
  const bool greedy = request_.sampling.greedy();
  // What PlanForward asked for: argmax ids, row samples (each with its
  // row's logprobs when asked) or, for a sampled tree or with penalties,
  // logits.
  const bool row_sampled = !greedy && parents_.empty();
  // CompleteForward runs for the final rows only, with output_ as
  // PlanForward saw it: the same answer as there.
  const bool host = DecidesOnHost();
  const bool reduced = (greedy || row_sampled) && !host;
  const size_t want = static_cast<size_t>(k + 1) * (reduced ? 1 : c.vocab_size);
  const size_t got = !reduced  ? out.logits.size()
                     : greedy  ? out.argmax.size()
                               : std::min(out.sampled.size(),
                                          out.accepted.size());
  if (got != want) {
    Abort();
    return absl::InternalError(absl::StrCat(
        "forward returned ", got,
        !reduced ? " logits" : greedy ? " argmax ids" : " row samples",
        ", expected ", want));
  }
  auto row = [&](int r) {
    return absl::MakeConstSpan(out.logits_row(r, c.vocab_size), c.vocab_size);
  };
  // On the host the adjusted rows are decided as the backend would have
  // decided raw ones.
  HostRows decided;
  if (host) decided = DecideOnHost(out.logits);
  const std::vector<int>& argmax = host ? decided.argmax : out.argmax;
  const std::vector<int>& sampled = host ? decided.sampled : out.sampled;
  const std::vector<uint8_t>& accepted_rows =
      host ? decided.accepted : out.accepted;
  const std::vector<float>& tree_logits = host ? decided.logits : out.logits;
  // The logit row each emitted token came from: a chain's token i from
  // row i; a tree's first from row 0 (the last context token), then each
  // from the row of the accepted node before it.
  std::vector<int> token_rows;
  std::vector<int> tokens;
  int accepted = 0;
  // Accepted drafts the cache keeps: a chain's all; a tree's those in
  // consecutive slots after the context (path[d] == node d).
  int kept = 0;
  if (parents_.empty()) {
    auto verdict =
        greedy ? VerifyDraftsGreedy(drafts_, argmax, c.vocab_size)
               : VerifyDraftsFromRows(drafts_, sampled, accepted_rows,
                                      c.vocab_size);
    if (!verdict.ok()) {
      Abort();
      return verdict.status();
    }
    tokens = std::move(verdict->tokens);
    accepted = kept = verdict->num_accepted;
    for (size_t i = 0; i < tokens.size(); ++i) {
      token_rows.push_back(static_cast<int>(i));
    }
  } else {
    auto verdict =
        greedy ? VerifyDraftTreeGreedy(drafts_, parents_, argmax,
                                       c.vocab_size)
               : VerifyDraftTree(drafts_, parents_, tree_logits,
                                 c.vocab_size, request_.sampling, &rng_);
    if (!verdict.ok()) {
      Abort();
      return verdict.status();
    }
    tokens = std::move(verdict->tokens);
    accepted = static_cast<int>(verdict->path.size());
    while (kept < accepted && verdict->path[kept] == kept) ++kept;
    token_rows.push_back(0);
    for (int node : verdict->path) token_rows.push_back(1 + node);
  }
  if (request_.logprobs && reduced) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (static_cast<size_t>(token_rows[i]) >= out.token_logprobs.size()) {
        Abort();
        return absl::InternalError(absl::StrCat(
            "forward returned logprobs for ", out.token_logprobs.size(),
            " rows; token ", i, " came from row ", token_rows[i]));
      }
    }
  }
  // Keep the context (prompt, or up to the last emitted token) and the
  // accepted drafts in place.
  if (auto s = cache_->Truncate(context_size() + kept); !s.ok()) {
    Abort();
    return s;
  }
  rewrite_ = accepted - kept;
  std::vector<TokenLogprobs> prompt_logprobs;
  if (!prefilled_ && request_.prompt_logprobs >= 0) {
    prompt_logprobs = std::move(prompt_lp_);
    prompt_lp_.clear();
  }
  if (!prefilled_) {
    // The prompt's full blocks are final (rollbacks never go below the
    // prompt): list them for later requests.
    cache_->CachePrefix(request_.token_ids, request_.position_ids);
  }
  prefilled_ = true;
  in_round_ = false;

  RoundResult round;
  round.prompt_logprobs = std::move(prompt_logprobs);
  round.num_drafts = k;
  round.num_accepted = accepted;
  const StopChecker::Result stop = stop_.Append(tokens);
  round.tokens.assign(tokens.begin(), tokens.begin() + stop.num_emit);
  round.finish = stop.reason;
  output_.insert(output_.end(), round.tokens.begin(), round.tokens.end());
  if (penalties_) penalties_->AddOutput(round.tokens);
  // Stops at EOS, which is not part of the object.
  if (json_) request_.json_mask->Advance(&*json_, round.tokens);
  if (request_.logprobs) {  // the backend's, or a sampled tree's logits
    for (int i = 0; i < stop.num_emit; ++i) {
      round.logprobs.push_back(
          reduced ? out.token_logprobs[token_rows[i]]
                  : ComputeTokenLogprobs(row(token_rows[i]), round.tokens[i],
                                         request_.top_logprobs));
    }
  }
  round.forward_ns = round_ns_ + (MonotonicNowNs() - planned_at_);
  result_ = std::move(round);
  return absl::OkStatus();
}

bool TargetSession::AdjustsLogits() const {
  const bool min_tokens_pending =
      static_cast<int>(output_.size()) < request_.stop.min_new_tokens &&
      (!request_.stop.eos_token_ids.empty() ||
       !request_.stop.stop_token_ids.empty());
  return request_.sampling.adjusts_logits() || min_tokens_pending ||
         json_.has_value();
}

bool TargetSession::DecidesOnHost() const {
  const bool sampled_tree =
      !request_.sampling.greedy() && !parents_.empty();
  return AdjustsLogits() && (sampled_tree || request_.logprobs);
}

LogitEdits TargetSession::RoundEdits() const {
  const int vocab = model_->config().vocab_size;
  const int k = static_cast<int>(drafts_.size());
  const StopConditions& stop = request_.stop;
  std::vector<int> masked;
  for (const std::vector<int>* ids :
       {&stop.eos_token_ids, &stop.stop_token_ids}) {
    masked.insert(masked.end(), ids->begin(), ids->end());
  }
  LogitEdits edits;
  std::vector<int> before, json_masked;
  for (int r = 0; r <= k; ++r) {
    before.clear();
    if (parents_.empty()) {
      for (int j = 0; j < r; ++j) before.push_back(drafts_[j].id);
    } else if (r > 0) {
      for (int node = r - 1; node >= 0; node = parents_[node]) {
        before.push_back(drafts_[node].id);
      }
      std::reverse(before.begin(), before.end());  // root first
    }
    json_masked.clear();
    bool json_complete = false;
    if (json_) {  // the object continued past the drafts on the path
      json_complete = request_.json_mask->DisallowedAfter(*json_, before,
                                                          vocab, &json_masked);
    }
    // The token this row decides is output token output_.size() + (drafts
    // before it): before min_new_tokens it may not end the request. A
    // closed JSON object overrides that (EOS is all it allows).
    const bool before_min =
        static_cast<int>(output_.size() + before.size()) <
            stop.min_new_tokens &&
        !json_complete;
    AppendRowEdits(request_.sampling,
                   penalties_ ? &*penalties_ : nullptr, before,
                   before_min ? absl::MakeConstSpan(masked)
                              : absl::Span<const int>(),
                   vocab, &edits);
    // JSON mode's mask, most of the vocabulary outside strings: a bitmask.
    if (json_) MaskLastRow(json_masked, vocab, &edits);
  }
  return edits;
}

TargetSession::HostRows TargetSession::DecideOnHost(
    absl::Span<const float> logits) const {
  const int vocab = model_->config().vocab_size;
  const int k = static_cast<int>(drafts_.size());
  const SamplingParams& params = request_.sampling;
  HostRows out;
  out.logits.assign(logits.begin(), logits.end());
  const LogitEdits edits = RoundEdits();
  for (int r = 0; r <= k; ++r) {
    ApplyLogitEdits(edits, r,
                    absl::MakeSpan(out.logits.data() +
                                       static_cast<size_t>(r) * vocab,
                                   vocab));
  }
  const auto row = [&](int r) {
    return absl::MakeConstSpan(
        out.logits.data() + static_cast<size_t>(r) * vocab, vocab);
  };
  if (params.greedy()) {
    for (int r = 0; r <= k; ++r) out.argmax.push_back(Argmax(row(r)));
  } else if (parents_.empty()) {
    // SampleOnHost's rule, with the uniforms PlanForward drew: rows in
    // order up to the first one not accepted.
    static const SparseDist kNoDraft;
    out.sampled.assign(k + 1, -1);
    out.accepted.assign(k + 1, 0);
    for (int r = 0; r <= k; ++r) {
      const RowSample s = SampleRow(
          row(r), params, row_sampling_.draft_ids[r],
          row_sampling_.draft_q[r] != nullptr ? *row_sampling_.draft_q[r]
                                              : kNoDraft,
          row_sampling_.uniforms[2 * r], row_sampling_.uniforms[2 * r + 1]);
      out.sampled[r] = s.token;
      out.accepted[r] = s.accepted ? 1 : 0;
      if (!s.accepted) break;
    }
  }
  return out;
}

absl::StatusOr<RoundResult> TargetSession::TakeRoundResult() {
  if (!result_.has_value()) {
    return absl::FailedPreconditionError("no completed round");
  }
  RoundResult r = *std::move(result_);
  result_.reset();
  return r;
}

void TargetSession::Abort() {
  if (!in_round_) return;
  cache_->Truncate(std::min(round_start_, cache_->size())).IgnoreError();
  if (cache_->size() == 0) attach_pending_ = true;
  in_round_ = false;
}

}  // namespace specserve
