#ifndef SPECSERVE_COMMON_DECODING_VERIFICATION_H_
#define SPECSERVE_COMMON_DECODING_VERIFICATION_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/decoding/sampling.h"

namespace specserve {

/// One drafted token and the draft model's distribution it was sampled from.
struct DraftToken {
  int id = 0;
  /// The draft's distribution at this position after the SAME transform
  /// (ComputeDistribution with the request's SamplingParams). Ignored, and
  /// normally empty, when greedy.
  SparseDist q;
};

/// Outcome of verifying one round of k drafts.
struct VerifyResult {
  int num_accepted = 0;  ///< drafts accepted, 0..k.
  /// Emitted tokens: the accepted drafts, then the correction (on a
  /// rejection) or the bonus token (all accepted). Size num_accepted + 1.
  std::vector<int> tokens;
};

/// The residual max(0, p - q) of a rejected draft (Leviathan et al. Alg.
/// 1), unnormalised: its support lies inside p's (q-only tokens have p = 0),
/// so it lists p's entries with p - q > 0, in p's order; empty when p <= q
/// everywhere. q_dense: scratch of at least vocab zeros (q's ids index it),
/// left zeroed, so a caller keeps one across positions.
SparseDist Residual(const SparseDist& p, const SparseDist& q,
                    std::vector<float>* q_dense);

/// Checks drafts before the target runs (services reject bad input early).
/// INVALID_ARGUMENT naming the field if vocab_size <= 0, a draft id is outside
/// [0, vocab_size), or, when !greedy, a q is empty, lists an id outside the
/// vocabulary or twice, has a negative or non-finite probability, does not
/// sum to 1 within 1e-3, or gives its own draft id probability 0 (the draft
/// could not have sampled it). q is not looked at when greedy.
absl::Status ValidateDrafts(absl::Span<const DraftToken> drafts,
                            int vocab_size, bool greedy);

/// Speculative-decoding verification (Leviathan et al. 2211.17192, Alg. 1;
/// Chen et al. 2302.01318; docs/ARCHITECTURE.md), row after row: the
/// reference the tests hold the row-parallel form the target serves with
/// (SampleRow + VerifyDraftsFromRows) against.
///
/// target_logits: [k+1, vocab_size] row-major, k = drafts.size(); row j is the
/// target's logits after [last emitted token, x_1..x_j], i.e. p_{j+1}.
/// Greedy params: accept while x_j == Argmax(p_j); the first mismatch is
/// replaced by Argmax(p_j); all accepted -> bonus Argmax(p_{k+1}). rng unused.
/// Sampled: p_j = ComputeDistribution(row j-1, params); accept x_j iff
/// u < p_j(x_j) / q_j(x_j) (u = rng->Uniform()); on the first rejection sample
/// from norm(max(0, p_j - q_j)) (from p_j if that residual is all zero) and
/// stop; all accepted -> sample the bonus from p_{k+1}. The output is then
/// distributed exactly as sampling from the target alone. k = 0 is a plain
/// sampling step from row 0. Rng draws: one per tested draft plus one for
/// the final token, so a seeded request is reproducible.
///
/// Errors (INVALID_ARGUMENT, naming the field): invalid params, vocab_size <=
/// 0, target_logits.size() != (k+1) * vocab_size, anything ValidateDrafts
/// rejects, or a null rng when sampling.
absl::StatusOr<VerifyResult> VerifyDrafts(absl::Span<const DraftToken> drafts,
                                          absl::Span<const float> target_logits,
                                          int vocab_size,
                                          const SamplingParams& params,
                                          Rng* rng);

/// Checks a backend's argmax ids (ForwardInput::argmax_only) for `rows`
/// logit rows: INVALID_ARGUMENT unless target_argmax.size() == rows and
/// every id is in [0, vocab_size).
absl::Status ValidateTargetArgmax(absl::Span<const int> target_argmax,
                                  size_t rows, int vocab_size);

/// Greedy verification from the target's argmax per row (what a backend
/// returns for ForwardInput::argmax_only): target_argmax [k+1], row j's
/// argmax. The same result as VerifyDrafts with greedy params on the rows'
/// logits. INVALID_ARGUMENT if vocab_size <= 0, target_argmax.size() !=
/// k + 1, or an id (draft or argmax) is outside [0, vocab_size).
absl::StatusOr<VerifyResult> VerifyDraftsGreedy(
    absl::Span<const DraftToken> drafts, absl::Span<const int> target_argmax,
    int vocab_size);

/// Sampled verification from per-row outcomes (ForwardInput::sampling,
/// common/decoding/row_sampling.h): sampled and accepted are [k + 1], row
/// j's SampleRow result with draft x_{j+1} (row k: no draft). Emits x_1..
/// while accepted, then the first rejected row's sampled token (its
/// residual draw) or, all accepted, row k's sample (the bonus). Distributed
/// exactly as VerifyDrafts' output. INVALID_ARGUMENT if vocab_size <= 0,
/// the sizes are not k + 1, or a token the result needs is outside
/// [0, vocab_size) (a rejected row's or the bonus row's sample).
absl::StatusOr<VerifyResult> VerifyDraftsFromRows(
    absl::Span<const DraftToken> drafts, absl::Span<const int> sampled,
    absl::Span<const uint8_t> accepted, int vocab_size);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_DECODING_VERIFICATION_H_
