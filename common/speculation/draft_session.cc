#include "common/speculation/draft_session.h"

#include <algorithm>
#include <chrono>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace specserve {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::Status CheckIds(absl::Span<const int> ids, int vocab,
                      std::string_view field) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat(absl::string_view(field.data(), field.size()), "[", i, "] = ", ids[i],
                       " outside the vocabulary [0, ", vocab, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateScoreOptions(const ScoreOptions& options,
                                  int num_layers) {
  if (options.look_ahead < 0 || options.look_ahead > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "look_ahead must be in [0, 64], got ", options.look_ahead));
  }
  if (auto s = ValidateScoringOptions(options.scoring, num_layers); !s.ok()) {
    return s;
  }
  return ValidateSelectionOptions(options.selection);
}

DraftSession::DraftSession(ModelRunner* model,
                           std::unique_ptr<KvSequence> cache,
                           const SamplingParams& sampling)
    : model_(model),
      cache_(std::move(cache)),
      sampling_(sampling),
      rng_(sampling.seed) {}

absl::StatusOr<std::unique_ptr<DraftSession>> DraftSession::Create(
    ModelRunner* model, int capacity, const SamplingParams& sampling) {
  if (auto s = ValidateSamplingParams(sampling); !s.ok()) return s;
  auto cache = model->NewSequence(capacity);
  if (!cache.ok()) return cache.status();
  return std::unique_ptr<DraftSession>(
      new DraftSession(model, *std::move(cache), sampling));
}

absl::Status DraftSession::Extend(absl::Span<const int> tokens,
                                  ForwardOutput* out) {
  std::vector<int> pos(tokens.size());
  std::iota(pos.begin(), pos.end(), static_cast<int>(cached_.size()));
  ForwardInput in;
  in.token_ids = tokens;
  in.position_ids = pos;
  if (auto s = model_->Forward(in, cache_.get(), out); !s.ok()) return s;
  cached_.insert(cached_.end(), tokens.begin(), tokens.end());
  return absl::OkStatus();
}

DraftToken DraftSession::Propose(const float* logits) {
  const int vocab = model_->config().vocab_size;
  DraftToken d;
  if (sampling_.greedy()) {
    d.id = Argmax(absl::MakeConstSpan(logits, vocab));
  } else {
    d.q = ComputeDistribution(absl::MakeConstSpan(logits, vocab), sampling_);
    d.id = SampleFrom(d.q, &rng_);
  }
  return d;
}

absl::Status DraftSession::Prefill(absl::Span<const int> prompt) {
  if (started_) {
    return absl::FailedPreconditionError("session already has a prompt");
  }
  if (prompt.empty()) return absl::InvalidArgumentError("token_ids is empty");
  if (auto s = CheckIds(prompt, model_->config().vocab_size, "token_ids");
      !s.ok()) {
    return s;
  }
  committed_.assign(prompt.begin(), prompt.end());
  started_ = true;
  // The prompt is forwarded lazily by the first Draft(), all but its last
  // token so that call has logits to propose from.
  return absl::OkStatus();
}

absl::StatusOr<ScoreResult> DraftSession::Score(absl::Span<const int> prompt,
                                                const ScoreOptions& options) {
  const ModelConfig& c = model_->config();
  if (started_) {
    return absl::FailedPreconditionError("session already has a prompt");
  }
  if (prompt.empty()) return absl::InvalidArgumentError("token_ids is empty");
  if (auto s = CheckIds(prompt, c.vocab_size, "token_ids"); !s.ok()) return s;
  if (auto s = ValidateScoreOptions(options, c.num_hidden_layers); !s.ok()) {
    return s;
  }
  const int n = static_cast<int>(prompt.size());
  if (n + options.look_ahead > cache_->max_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt of ", n, " tokens + look_ahead ", options.look_ahead,
        " exceeds the speculator's context of ", cache_->max_tokens(),
        " tokens"));
  }
  ScoreResult result;
  // The scoring rows' queries stay where the model runs (host or device).
  auto capture = model_->NewQueryCapture(1 + options.look_ahead);
  if (!capture.ok()) return capture.status();

  // 1. Full-prompt prefill, capturing the last prompt row's queries.
  int64_t t0 = NowNs();
  std::vector<int> pos(n);
  std::iota(pos.begin(), pos.end(), 0);
  SequenceForward prefill;
  prefill.kv = cache_.get();
  prefill.input.token_ids = prompt;
  prefill.input.position_ids = pos;
  prefill.input.capture_query_rows = {n - 1};
  prefill.capture = capture->get();
  std::vector<ForwardOutput> outs;
  if (auto s = model_->Forward(absl::MakeConstSpan(&prefill, 1), &outs);
      !s.ok()) {
    return s;
  }
  cached_.assign(prompt.begin(), prompt.end());
  int64_t t1 = NowNs();
  result.prefill_ns = t1 - t0;

  // 2. Greedy look-ahead, capturing each fed token's queries; stop at EOS.
  const std::vector<int>& eos = c.eos_token_ids;
  for (int j = 0; j < options.look_ahead; ++j) {
    const int tok =
        Argmax(absl::MakeConstSpan(outs[0].logits.data(), c.vocab_size));
    if (std::find(eos.begin(), eos.end(), tok) != eos.end()) break;
    result.look_ahead_tokens.push_back(tok);
    const int p = static_cast<int>(cached_.size());
    SequenceForward step;
    step.kv = cache_.get();
    step.input.token_ids = absl::MakeConstSpan(&tok, 1);
    step.input.position_ids = absl::MakeConstSpan(&p, 1);
    step.input.capture_query_rows = {0};
    step.capture = capture->get();
    if (auto s = model_->Forward(absl::MakeConstSpan(&step, 1), &outs);
        !s.ok()) {
      return s;
    }
    cached_.push_back(tok);
  }
  int64_t t2 = NowNs();
  result.look_ahead_ns = t2 - t1;

  // 3. Score against the prompt keys only, one layer at a time.
  auto importance = model_->ScoreImportance(*cache_, n, **capture,
                                            options.scoring,
                                            options.num_threads);
  if (!importance.ok()) return importance.status();
  result.importance = std::move(importance->importance);
  result.per_row_importance = std::move(importance->per_row_importance);
  auto sel = SelectTokens(result.importance, options.selection);
  if (!sel.ok()) return sel.status();
  result.selection = *std::move(sel);
  result.score_ns = NowNs() - t2;

  committed_.assign(prompt.begin(), prompt.end());
  started_ = true;
  return result;
}

absl::StatusOr<std::vector<DraftToken>> DraftSession::Draft(
    absl::Span<const int> emitted, int k) {
  const ModelConfig& c = model_->config();
  if (!started_) {
    return absl::FailedPreconditionError("session has no prompt yet");
  }
  if (k < 1 || k > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_draft_tokens must be in [1, 64], got ", k));
  }
  if (auto s = CheckIds(emitted, c.vocab_size, "emitted_token_ids"); !s.ok()) {
    return s;
  }
  committed_.insert(committed_.end(), emitted.begin(), emitted.end());

  // Keep the longest cached prefix that agrees with what the target
  // emitted (rejected drafts roll back), but re-feed at least the last
  // committed token so its logits are at hand.
  size_t keep = 0;
  while (keep < cached_.size() && keep < committed_.size() &&
         cached_[keep] == committed_[keep]) {
    ++keep;
  }
  keep = std::min(keep, committed_.size() - 1);
  if (auto s = cache_->Truncate(static_cast<int>(keep)); !s.ok()) return s;
  cached_.resize(keep);

  std::vector<DraftToken> drafts;
  const int pending = static_cast<int>(committed_.size() - keep);
  const int room = cache_->max_tokens() - static_cast<int>(keep);
  if (pending > room) return drafts;  // context full: the target goes alone
  const int num = std::min(k, room - pending + 1);
  ForwardOutput out;
  if (auto s = Extend(absl::MakeConstSpan(committed_).subspan(keep), &out);
      !s.ok()) {
    return s;
  }
  drafts.push_back(Propose(out.logits.data()));
  for (int j = 1; j < num; ++j) {
    const int prev = drafts.back().id;
    if (auto s = Extend(absl::MakeConstSpan(&prev, 1), &out); !s.ok()) {
      return s;
    }
    drafts.push_back(Propose(out.logits.data()));
  }
  return drafts;
}

}  // namespace specserve
