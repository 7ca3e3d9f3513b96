#include "common/speculation/target_session.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"

namespace specserve {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

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
      rng_(request_.sampling.seed) {}

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
  if (r.stop.max_new_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens must be >= 1, got ", r.stop.max_new_tokens));
  }
  if (r.max_drafts < 0 || r.max_drafts > 64) {
    return absl::InvalidArgumentError("max_drafts must be in [0, 64]");
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
    absl::Span<const DraftToken> drafts) {
  const ModelConfig& c = model_->config();
  if (finished()) {
    return absl::FailedPreconditionError("generation already finished");
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
  const int64_t t0 = NowNs();
  const int generated = static_cast<int>(output_.size());
  // Position of the first token this round feeds after the cached ones.
  const int np = request_.next_position;
  // Clip drafts: each round emits accepted + 1 tokens, so drafts beyond
  // the remaining budget - 1 can never be emitted; fed positions must stay
  // inside the context.
  int k = static_cast<int>(drafts.size());
  k = std::min(k, request_.stop.max_new_tokens - generated - 1);
  const int first_draft_pos = prefilled_ ? np + generated : np;
  k = std::min(k, c.max_position_embeddings - first_draft_pos);
  k = std::max(k, 0);
  drafts = drafts.subspan(0, k);

  std::vector<int> tokens, positions;
  int base_row;
  if (!prefilled_) {
    tokens = request_.token_ids;
    positions = request_.position_ids;
    base_row = static_cast<int>(tokens.size()) - 1;
  } else {
    tokens = {output_.back()};
    positions = {np + generated - 1};
    base_row = 0;
  }
  for (int j = 0; j < k; ++j) {
    tokens.push_back(drafts[j].id);
    positions.push_back(first_draft_pos + j);
  }
  ForwardInput in;
  in.token_ids = tokens;
  in.position_ids = positions;
  for (int j = 0; j <= k; ++j) in.logit_rows.push_back(base_row + j);
  const int before = cache_->size();
  ForwardOutput out;
  if (auto s = model_->Forward(in, cache_.get(), &out); !s.ok()) return s;
  auto verdict =
      VerifyDrafts(drafts, out.logits, c.vocab_size, request_.sampling, &rng_);
  if (!verdict.ok()) {
    cache_->Truncate(before).IgnoreError();
    return verdict.status();
  }
  // Keep the prompt (or last emitted token) and the accepted drafts.
  if (auto s = cache_->Truncate(before + base_row + 1 + verdict->num_accepted);
      !s.ok()) {
    return s;
  }
  prefilled_ = true;

  RoundResult round;
  round.num_drafts = k;
  round.num_accepted = verdict->num_accepted;
  const StopChecker::Result stop = stop_.Append(verdict->tokens);
  round.tokens.assign(verdict->tokens.begin(),
                      verdict->tokens.begin() + stop.num_emit);
  round.finish = stop.reason;
  output_.insert(output_.end(), round.tokens.begin(), round.tokens.end());
  round.forward_ns = NowNs() - t0;
  return round;
}

}  // namespace specserve
