#include "common/decoding/verification.h"

#include <cmath>
#include <cstddef>

#include "absl/strings/str_cat.h"

namespace specserve {

absl::Status ValidateDrafts(absl::Span<const DraftToken> drafts,
                            int vocab_size, bool greedy) {
  if (vocab_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size must be > 0, got ", vocab_size));
  }
  // stamp[id] == j marks ids already seen in drafts[j].q (duplicate check
  // and the draft id's own probability) in O(|q|) per draft.
  std::vector<int> stamp;
  if (!greedy && !drafts.empty()) stamp.assign(vocab_size, -1);
  for (size_t j = 0; j < drafts.size(); ++j) {
    const DraftToken& d = drafts[j];
    if (d.id < 0 || d.id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "drafts[", j, "].id = ", d.id, " is outside the vocabulary [0, ",
          vocab_size, ")"));
    }
    if (greedy) continue;
    if (d.q.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "drafts[", j,
          "].q is empty; sampled verification needs the draft distribution"));
    }
    double sum = 0.0;
    double own = 0.0;
    for (size_t i = 0; i < d.q.size(); ++i) {
      const int id = d.q[i].first;
      const float p = d.q[i].second;
      if (id < 0 || id >= vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "drafts[", j, "].q[", i, "].id = ", id,
            " is outside the vocabulary [0, ", vocab_size, ")"));
      }
      if (!std::isfinite(p) || p < 0.f) {
        return absl::InvalidArgumentError(
            absl::StrCat("drafts[", j, "].q[", i, "].prob = ", p,
                         " must be finite and >= 0"));
      }
      if (stamp[id] == static_cast<int>(j)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "drafts[", j, "].q lists id ", id, " more than once"));
      }
      stamp[id] = static_cast<int>(j);
      sum += p;
      if (id == d.id) own = p;
    }
    if (std::fabs(sum - 1.0) > 1e-3) {
      return absl::InvalidArgumentError(absl::StrCat(
          "drafts[", j, "].q sums to ", sum, ", not 1 (tolerance 1e-3)"));
    }
    if (own <= 0.0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "drafts[", j, "].id = ", d.id, " has probability 0 in drafts[", j,
          "].q"));
    }
  }
  return absl::OkStatus();
}

namespace {

// Greedy acceptance: drafts while each equals the target's argmax at its
// row, then that row's argmax (the correction, or the bonus after all k).
// best_of(j): row j's argmax, asked only up to the first mismatch.
template <typename BestOf>
VerifyResult AcceptGreedy(absl::Span<const DraftToken> drafts,
                          const BestOf& best_of) {
  const size_t k = drafts.size();
  VerifyResult result;
  result.tokens.reserve(k + 1);
  for (size_t j = 0; j < k; ++j) {
    const int best = best_of(j);
    result.tokens.push_back(best);  // == draft id when accepted
    if (drafts[j].id != best) return result;
    ++result.num_accepted;
  }
  result.tokens.push_back(best_of(k));
  return result;
}

}  // namespace

SparseDist Residual(const SparseDist& p, const SparseDist& q,
                    std::vector<float>* q_dense) {
  for (const auto& e : q) (*q_dense)[e.first] = e.second;
  SparseDist residual;
  for (const auto& e : p) {
    const float r = e.second - (*q_dense)[e.first];
    if (r > 0.f) residual.emplace_back(e.first, r);
  }
  for (const auto& e : q) (*q_dense)[e.first] = 0.f;
  return residual;
}

absl::StatusOr<VerifyResult> VerifyDrafts(absl::Span<const DraftToken> drafts,
                                          absl::Span<const float> target_logits,
                                          int vocab_size,
                                          const SamplingParams& params,
                                          Rng* rng) {
  if (absl::Status s = ValidateSamplingParams(params); !s.ok()) return s;
  if (vocab_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size must be > 0, got ", vocab_size));
  }
  const size_t k = drafts.size();
  if (target_logits.size() != (k + 1) * static_cast<size_t>(vocab_size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target_logits has ", target_logits.size(), " values; expected (k+1) * "
        "vocab_size = ", k + 1, " * ", vocab_size, " for k = ", k, " drafts"));
  }
  const bool greedy = params.greedy();
  if (absl::Status s = ValidateDrafts(drafts, vocab_size, greedy); !s.ok()) {
    return s;
  }
  if (!greedy && rng == nullptr) {
    return absl::InvalidArgumentError("rng must not be null when sampling");
  }
  auto row = [&](size_t j) {
    return target_logits.subspan(j * vocab_size, vocab_size);
  };

  if (greedy) {
    return AcceptGreedy(drafts, [&](size_t j) { return Argmax(row(j)); });
  }

  VerifyResult result;
  result.tokens.reserve(k + 1);

  // Residual's scratch, kept across positions.
  std::vector<float> q_dense(vocab_size, 0.f);
  for (size_t j = 0; j < k; ++j) {
    const DraftToken& d = drafts[j];
    const SparseDist p = ComputeDistribution(row(j), params);
    // q(x) > 0, checked by ValidateDrafts.
    const double p_x = ProbabilityOf(p, d.id), q_x = ProbabilityOf(d.q, d.id);
    // Accept with probability min(1, p/q): u < p/q, written without division.
    if (rng->Uniform() * q_x < p_x) {
      result.tokens.push_back(d.id);
      ++result.num_accepted;
      continue;
    }
    // SampleFrom normalises by the listed total; p == q leaves nothing, and
    // then p itself is the right distribution.
    const SparseDist residual = Residual(p, d.q, &q_dense);
    result.tokens.push_back(SampleFrom(residual.empty() ? p : residual, rng));
    return result;
  }
  result.tokens.push_back(
      SampleFrom(ComputeDistribution(row(k), params), rng));
  return result;
}

absl::Status ValidateTargetArgmax(absl::Span<const int> target_argmax,
                                  size_t rows, int vocab_size) {
  if (target_argmax.size() != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_argmax has ", target_argmax.size(),
                     " ids; expected one per logit row, ", rows));
  }
  for (size_t r = 0; r < rows; ++r) {
    if (target_argmax[r] < 0 || target_argmax[r] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "target_argmax[", r, "] = ", target_argmax[r],
          " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<VerifyResult> VerifyDraftsGreedy(
    absl::Span<const DraftToken> drafts, absl::Span<const int> target_argmax,
    int vocab_size) {
  if (absl::Status s = ValidateDrafts(drafts, vocab_size, /*greedy=*/true);
      !s.ok()) {
    return s;
  }
  const size_t k = drafts.size();
  if (absl::Status s = ValidateTargetArgmax(target_argmax, k + 1, vocab_size);
      !s.ok()) {
    return s;
  }
  return AcceptGreedy(drafts, [&](size_t j) { return target_argmax[j]; });
}

absl::StatusOr<VerifyResult> VerifyDraftsFromRows(
    absl::Span<const DraftToken> drafts, absl::Span<const int> sampled,
    absl::Span<const uint8_t> accepted, int vocab_size) {
  if (vocab_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size must be > 0, got ", vocab_size));
  }
  const size_t k = drafts.size();
  if (sampled.size() != k + 1 || accepted.size() != k + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "got ", sampled.size(), " sampled ids and ", accepted.size(),
        " accept flags; expected k + 1 = ", k + 1));
  }
  VerifyResult result;
  result.tokens.reserve(k + 1);
  size_t j = 0;
  while (j < k && accepted[j] != 0) {
    result.tokens.push_back(drafts[j].id);
    ++j;
  }
  result.num_accepted = static_cast<int>(j);
  if (sampled[j] < 0 || sampled[j] >= vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampled[", j, "] = ", sampled[j],
                     " outside the vocabulary [0, ", vocab_size, ")"));
  }
  result.tokens.push_back(sampled[j]);
  return result;
}

}  // namespace specserve
