#include "common/specprefill/selection.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace specserve {

absl::Status ValidateSelectionOptions(const SelectionOptions& opts) {
  // Written so that NaN fails too.
  if (!(opts.keep_ratio > 0.0f && opts.keep_ratio <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("SelectionOptions.keep_ratio must be in (0, 1], got ",
                     opts.keep_ratio));
  }
  if (!(opts.keep_mass >= 0.0f && opts.keep_mass <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("SelectionOptions.keep_mass must be in [0, 1], got ",
                     opts.keep_mass));
  }
  if (opts.chunk_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SelectionOptions.chunk_size must be >= 1, got ", opts.chunk_size));
  }
  if (opts.keep_first < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SelectionOptions.keep_first must be >= 0, got ", opts.keep_first));
  }
  if (opts.keep_last < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SelectionOptions.keep_last must be >= 0, got ", opts.keep_last));
  }
  if (opts.min_prompt_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("SelectionOptions.min_prompt_tokens must be >= 0, got ",
                     opts.min_prompt_tokens));
  }
  return absl::OkStatus();
}

int NumChunksToKeep(int num_chunks, float keep_ratio) {
  const double exact = static_cast<double>(num_chunks) * keep_ratio;
  const int k = static_cast<int>(std::ceil(exact * (1.0 - 1e-6)));
  return std::clamp(k, 1, std::max(1, num_chunks));
}

absl::StatusOr<Selection> SelectTokens(absl::Span<const float> importance,
                                       const SelectionOptions& opts) {
  if (absl::Status s = ValidateSelectionOptions(opts); !s.ok()) return s;
  const int n = static_cast<int>(importance.size());
  if (n == 0) {
    return absl::InvalidArgumentError("SelectTokens: importance is empty");
  }
  for (int i = 0; i < n; ++i) {
    if (!std::isfinite(importance[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SelectTokens: importance[", i, "] is not finite: ", importance[i]));
    }
  }

  Selection sel;
  sel.next_position = n;
  const int cs = opts.chunk_size;
  // ceil(n / cs) without n + cs - 1, which overflows for a chunk_size near
  // INT_MAX (a valid request: one chunk).
  const int num_chunks = n / cs + (n % cs != 0 ? 1 : 0);
  sel.chunk_scores.resize(num_chunks);
  for (int c = 0; c < num_chunks; ++c) {
    const int begin = c * cs;
    const int end = begin + std::min(cs, n - begin);
    double sum = 0.0;
    for (int i = begin; i < end; ++i) sum += importance[i];
    sel.chunk_scores[c] = static_cast<float>(sum / (end - begin));
  }

  if (n < opts.min_prompt_tokens ||
      (opts.keep_ratio >= 1.0f && opts.keep_mass == 0.0f)) {
    sel.kept_chunks.resize(num_chunks);
    std::iota(sel.kept_chunks.begin(), sel.kept_chunks.end(), 0);
    sel.kept_indices.resize(n);
    std::iota(sel.kept_indices.begin(), sel.kept_indices.end(), 0);
    sel.position_ids = sel.kept_indices;
    return sel;
  }

  // Rank by the stored (float) chunk scores so the reported scores and the
  // ranking agree; ties: lower chunk index first.
  std::vector<int> order(num_chunks);
  std::iota(order.begin(), order.end(), 0);
  int k = NumChunksToKeep(num_chunks, opts.keep_ratio);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int a, int b) {
                      if (sel.chunk_scores[a] != sel.chunk_scores[b]) {
                        return sel.chunk_scores[a] > sel.chunk_scores[b];
                      }
                      return a < b;
                    });
  if (opts.keep_mass > 0.0f) {
    // Mass of a chunk = the sum (not mean) of its tokens' importance, so a
    // short last chunk weighs what it holds.
    auto chunk_mass = [&](int c) {
      const int end = std::min(n, (c + 1) * cs);
      double m = 0.0;
      for (int i = c * cs; i < end; ++i) m += std::max(0.0f, importance[i]);
      return m;
    };
    double total = 0.0;
    for (int c = 0; c < num_chunks; ++c) total += chunk_mass(c);
    const double goal = total * opts.keep_mass * (1.0 - 1e-6);
    double acc = 0.0;
    int need = 1;
    for (; need <= k; ++need) {
      acc += chunk_mass(order[need - 1]);
      if (acc >= goal) break;
    }
    k = std::min(need, k);
  }
  sel.kept_chunks.assign(order.begin(), order.begin() + k);
  std::sort(sel.kept_chunks.begin(), sel.kept_chunks.end());

  std::vector<bool> keep(n, false);
  for (int c : sel.kept_chunks) {
    const int end = std::min(n, (c + 1) * cs);
    for (int i = c * cs; i < end; ++i) keep[i] = true;
  }
  for (int i = 0; i < std::min(n, opts.keep_first); ++i) keep[i] = true;
  for (int i = std::max(0, n - opts.keep_last); i < n; ++i) keep[i] = true;
  for (int i = 0; i < n; ++i) {
    if (keep[i]) sel.kept_indices.push_back(i);
  }
  sel.position_ids = sel.kept_indices;
  return sel;
}

}  // namespace specserve
