#include "router/output_processor.h"

#include <utility>

#include "router/metrics.h"

namespace specserve {
namespace {

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace

OutputProcessor::OutputProcessor(const Tokenizer* tokenizer,
                                 std::vector<std::string> stops,
                                 absl::Time start, RouterMetrics* metrics,
                                 int min_tokens, bool include_stop)
    : stops_(std::move(stops), include_stop),
      min_tokens_(min_tokens),
      start_(start),
      metrics_(metrics) {
  if (tokenizer != nullptr) decoder_.emplace(tokenizer);
}

absl::Status OutputProcessor::AddRound(const v1::GenerateResponse& round,
                                       absl::Time now,
                                       v1::GenerateTextChunk* chunk) {
  // A continuous stream's message may report several rounds.
  if (round.rounds_size() == 0) {
    CountRound(round.num_drafts(), round.num_accepted(),
               round.token_ids_size());
  }
  for (const v1::RoundCounts& r : round.rounds()) {
    CountRound(r.num_drafts(), r.num_accepted(), r.num_tokens());
  }
  if (completion_ == 0 && round.token_ids_size() > 0) {
    stats_.set_ttft_s(Seconds(now - start_));
  }
  chunk->Clear();
  // Logprobs go with their tokens (a target that sent none: none).
  const bool logprobs = round.logprobs_size() == round.token_ids_size();
  for (int i = 0; i < round.token_ids_size(); ++i) {
    const int id = round.token_ids(i);
    chunk->add_token_ids(id);
    if (logprobs) *chunk->add_logprobs() = round.logprobs(i);
    ++completion_;
    if (!decoder_) continue;
    auto delta = decoder_->Append(id);
    if (!delta.ok()) return delta.status();
    // The first min_tokens tokens' text ends no stop string, but may start
    // one that ends later.
    chunk->mutable_text()->append(
        stops_.Append(*delta, /*can_match=*/completion_ > min_tokens_));
    if (stops_.matched()) {
      finish_reason_ = "stop";
      break;
    }
  }
  if (finish_reason_.empty()) finish_reason_ = round.finish_reason();
  return absl::OkStatus();
}

void OutputProcessor::CountRound(int num_drafts, int num_accepted,
                                 int num_tokens) {
  ++forwards_;
  if (metrics_ != nullptr) {
    metrics_->ObserveTargetForward(stats_.spec_decode_method(), num_tokens);
  }
  if (num_drafts > 0) {
    stats_.set_num_drafts(stats_.num_drafts() + 1);
    stats_.set_num_draft_tokens(stats_.num_draft_tokens() + num_drafts);
    accepted_total_ += num_accepted;
    if (static_cast<int>(accepted_per_pos_.size()) < num_drafts) {
      accepted_per_pos_.resize(num_drafts);
    }
    for (int i = 0; i < num_accepted; ++i) ++accepted_per_pos_[i];
    if (metrics_ != nullptr) {
      metrics_->ObserveVerifyRound(stats_.spec_decode_method(), num_drafts,
                                   num_accepted);
    }
  }
}

void OutputProcessor::Finish(int prompt_tokens, int kept_tokens,
                             const std::string& fallback, absl::Time now,
                             v1::GenerateTextChunk* chunk) {
  // The detokenizer's and the stop filter's held-back text.
  if (decoder_ && !stops_.matched()) {
    chunk->mutable_text()->append(stops_.Append(decoder_->Flush()));
    if (stops_.matched()) {
      finish_reason_ = "stop";
    } else {
      chunk->mutable_text()->append(stops_.Flush());
    }
  }
  if (completion_ == 0) stats_.set_ttft_s(Seconds(now - start_));
  stats_.set_keep_ratio(static_cast<float>(kept_tokens) / prompt_tokens);
  stats_.set_total_s(Seconds(now - start_));
  stats_.set_num_accepted_tokens(static_cast<int>(accepted_total_));
  stats_.set_mean_acceptance_length(
      stats_.num_drafts() > 0
          ? 1.0 + static_cast<double>(accepted_total_) / stats_.num_drafts()
          : 0.0);
  stats_.mutable_accepted_per_position()->Add(accepted_per_pos_.begin(),
                                              accepted_per_pos_.end());
  stats_.set_num_target_forwards(forwards_);
  stats_.set_tokens_per_target_forward(
      forwards_ > 0 ? static_cast<double>(completion_) / forwards_ : 0.0);
  stats_.set_fallback_reason(fallback);
  if (!fallback.empty() && metrics_ != nullptr) {
    metrics_->CountFallback(fallback);
  }
  chunk->set_finish_reason(finish_reason_);
  chunk->mutable_usage()->set_prompt_tokens(prompt_tokens);
  chunk->mutable_usage()->set_kept_prompt_tokens(kept_tokens);
  chunk->mutable_usage()->set_completion_tokens(completion_);
  *chunk->mutable_stats() = stats_;
  if (metrics_ != nullptr) {
    const double e2e = stats_.total_s();
    metrics_->ObserveCompletion(
        stats_.ttft_s(),
        completion_ > 1 ? (e2e - stats_.ttft_s()) / (completion_ - 1) : -1.0,
        e2e, prompt_tokens, kept_tokens, completion_);
  }
}

void AppendChunk(const v1::GenerateTextChunk& chunk,
                 v1::GenerateTextResponse* response) {
  response->mutable_text()->append(chunk.text());
  response->mutable_token_ids()->Add(chunk.token_ids().begin(),
                                     chunk.token_ids().end());
  response->mutable_logprobs()->Add(chunk.logprobs().begin(),
                                    chunk.logprobs().end());
  response->mutable_prompt_token_ids()->Add(chunk.prompt_token_ids().begin(),
                                            chunk.prompt_token_ids().end());
  response->mutable_prompt_logprobs()->Add(chunk.prompt_logprobs().begin(),
                                           chunk.prompt_logprobs().end());
  if (!chunk.finish_reason().empty()) {
    response->set_finish_reason(chunk.finish_reason());
    *response->mutable_usage() = chunk.usage();
    *response->mutable_stats() = chunk.stats();
  }
}

}  // namespace specserve
