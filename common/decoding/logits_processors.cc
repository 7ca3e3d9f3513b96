#include "common/decoding/logits_processors.h"

namespace specserve {

PenaltyTracker::PenaltyTracker(absl::Span<const int> prompt_ids) {
  for (const int id : prompt_ids) {
    if (id >= 0) prompt_.insert(id);
  }
}

void PenaltyTracker::AddOutput(absl::Span<const int> ids) {
  for (const int id : ids) {
    if (id >= 0) ++output_[id];
  }
}

int PenaltyTracker::output_count(int id) const {
  const auto it = output_.find(id);
  return it == output_.end() ? 0 : it->second;
}

void ApplyLogitBias(const SamplingParams& params, absl::Span<float> logits) {
  const int vocab = static_cast<int>(logits.size());
  for (const auto& [id, bias] : params.logit_bias) {
    if (id >= 0 && id < vocab) logits[id] += bias;
  }
}

float PenalizeLogit(float logit, int count, bool in_prompt,
                    const SamplingParams& params) {
  if (params.repetition_penalty != 1.f && (in_prompt || count > 0)) {
    logit = logit > 0.f ? logit / params.repetition_penalty
                        : logit * params.repetition_penalty;
  }
  if (count > 0) {
    logit -= params.frequency_penalty * static_cast<float>(count) +
             params.presence_penalty;
  }
  return logit;
}

void PenaltyTracker::Apply(const SamplingParams& params,
                           absl::Span<const int> pending,
                           absl::Span<float> logits) const {
  if (!params.has_penalties()) return;
  const int vocab = static_cast<int>(logits.size());
  // The row's output counts: the emitted ids', plus the pending ones.
  absl::flat_hash_map<int, int> extra;
  for (const int id : pending) {
    if (id >= 0) ++extra[id];
  }
  const auto count = [&](int id) {
    const auto it = extra.find(id);
    return output_count(id) + (it == extra.end() ? 0 : it->second);
  };
  // Each id once: the prompt's, then output ids not in the prompt, then
  // pending ids in neither.
  for (const int id : prompt_) {
    if (id < vocab) {
      logits[id] = PenalizeLogit(logits[id], count(id), true, params);
    }
  }
  for (const auto& [id, n] : output_) {
    if (id < vocab && !prompt_.contains(id)) {
      logits[id] = PenalizeLogit(logits[id], count(id), false, params);
    }
  }
  for (const auto& [id, n] : extra) {
    if (id < vocab && !prompt_.contains(id) && !output_.contains(id)) {
      logits[id] = PenalizeLogit(logits[id], n, false, params);
    }
  }
}

}  // namespace specserve
