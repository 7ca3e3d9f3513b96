#include "common/decoding/logits_processors.h"

#include <algorithm>
#include <functional>
#include <limits>

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

void PenaltyTracker::AddEdits(const SamplingParams& params,
                              absl::Span<const int> pending, int vocab,
                              absl::flat_hash_map<int, LogitEdit>* by_id) const {
  if (!params.has_penalties()) return;
  absl::flat_hash_map<int, int> counts(output_.begin(), output_.end());
  for (const int id : pending) {
    if (id >= 0) ++counts[id];
  }
  // PenalizeLogit's two steps as a scale and an amount subtracted.
  const auto add = [&](int id, int count, bool in_prompt) {
    if (id >= vocab) return;
    const bool rescale = params.repetition_penalty != 1.f &&
                         (in_prompt || count > 0);
    if (!rescale && count == 0) return;
    LogitEdit& e = (*by_id)[id];
    e.id = id;
    if (rescale) e.scale = params.repetition_penalty;
    if (count > 0) {
      e.subtract = params.frequency_penalty * static_cast<float>(count) +
                   params.presence_penalty;
    }
  };
  if (params.repetition_penalty != 1.f) {
    for (const int id : prompt_) {
      const auto it = counts.find(id);
      add(id, it == counts.end() ? 0 : it->second, true);
    }
  }
  for (const auto& [id, n] : counts) {
    if (!prompt_.contains(id) || params.repetition_penalty == 1.f) {
      add(id, n, prompt_.contains(id));
    }
  }
}

void AppendRowEdits(const SamplingParams& params,
                    const PenaltyTracker* penalties,
                    absl::Span<const int> pending, absl::Span<const int> masked,
                    int vocab, LogitEdits* out) {
  absl::flat_hash_map<int, LogitEdit> by_id;
  for (const auto& [id, bias] : params.logit_bias) {
    if (id >= 0 && id < vocab) by_id[id] = LogitEdit{id, bias, 1.f, 0.f};
  }
  if (penalties != nullptr) penalties->AddEdits(params, pending, vocab, &by_id);
  // The mask may be most of the vocabulary (JSON mode): kept out of the
  // map and merged, read in place when already strictly ascending (a JSON
  // mask alone), else sorted and deduplicated in a copy.
  std::vector<int> sorted;
  absl::Span<const int> mask = masked;
  if (std::adjacent_find(masked.begin(), masked.end(),
                         std::greater_equal<int>()) != masked.end()) {
    sorted.assign(masked.begin(), masked.end());
    std::sort(sorted.begin(), sorted.end());
    sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
    mask = sorted;
  }
  constexpr float kMask = std::numeric_limits<float>::infinity();
  std::vector<LogitEdit> adjusted;
  adjusted.reserve(by_id.size());
  for (const auto& [id, e] : by_id) adjusted.push_back(e);
  const auto by_id_less = [](const LogitEdit& a, const LogitEdit& b) {
    return a.id < b.id;
  };
  // Ascending ids: deterministic, and neighbouring ids share cache lines.
  std::sort(adjusted.begin(), adjusted.end(), by_id_less);
  if (out->offsets.empty()) out->offsets.push_back(0);
  size_t a = 0;
  for (const int id : mask) {
    if (id < 0 || id >= vocab) continue;
    while (a < adjusted.size() && adjusted[a].id < id) {
      out->edits.push_back(adjusted[a++]);
    }
    LogitEdit e{id, 0.f, 1.f, kMask};
    if (a < adjusted.size() && adjusted[a].id == id) {
      e = adjusted[a++];
      e.subtract = kMask;
    }
    out->edits.push_back(e);
  }
  out->edits.insert(out->edits.end(), adjusted.begin() + a, adjusted.end());
  out->offsets.push_back(static_cast<int>(out->edits.size()));
}

void MaskLastRow(absl::Span<const int> disallowed, int vocab,
                 LogitEdits* out) {
  const int words = (vocab + 31) / 32;
  out->mask_words = words;
  out->mask_of_row.resize(std::max(out->rows(), 1) - 1, -1);
  out->mask_of_row.push_back(out->num_masks());
  const size_t at = out->allowed.size();
  out->allowed.resize(at + words, ~uint32_t{0});
  uint32_t* bits = out->allowed.data() + at;
  if (vocab % 32 != 0) bits[words - 1] = (uint32_t{1} << (vocab % 32)) - 1;
  for (const int id : disallowed) {
    if (id >= 0 && id < vocab) bits[id / 32] &= ~(uint32_t{1} << (id % 32));
  }
}

void ApplyLogitEdits(const LogitEdits& edits, int row,
                     absl::Span<float> logits) {
  const int vocab = static_cast<int>(logits.size());
  for (int i = edits.offsets[row]; i < edits.offsets[row + 1]; ++i) {
    const LogitEdit& e = edits.edits[i];
    if (e.id >= 0 && e.id < vocab) logits[e.id] = ApplyLogitEdit(logits[e.id], e);
  }
  const int mask = edits.mask_of(row);
  if (mask < 0) return;
  const uint32_t* bits =
      edits.allowed.data() + static_cast<size_t>(mask) * edits.mask_words;
  for (int w = 0; w < edits.mask_words; ++w) {
    // Only the zero bits: a mask leaves most ids alone inside strings.
    for (uint32_t off = ~bits[w]; off != 0; off &= off - 1) {
      const int id = w * 32 + __builtin_ctz(off);
      if (id < vocab) logits[id] = -std::numeric_limits<float>::infinity();
    }
  }
}

}  // namespace specserve
