#ifndef SPECSERVE_COMMON_DECODING_ROW_SAMPLING_H_
#define SPECSERVE_COMMON_DECODING_ROW_SAMPLING_H_

// Speculative sampling with every logit row decided independently, so a
// backend can run it where the logits are (the GPU) and return one id per
// row instead of [rows, vocab] logits.
//
// Leviathan et al. 2023 (Alg. 1) verify drafts x_1..x_k one after the
// other: accept x_j with probability min(1, p_j(x_j) / q_j(x_j)); on the
// first rejection sample norm(max(0, p_j - q_j)) and stop; all accepted ->
// sample p_{k+1}. Row j's accept test and its residual draw depend only on
// row j's logits, q_j and two uniforms, so all k + 1 rows can be decided at
// once with independent uniforms and the first rejection picked afterwards
// (VerifyDraftsFromRows). Rows after the first rejection are wasted work,
// never a change in distribution: the output is still exactly the target's.

#include <cstdint>

#include "absl/types/span.h"
#include "common/decoding/sampling.h"
#include "common/decoding/verification.h"

namespace specserve {

/// One logit row's outcome (see SampleRow).
struct RowSample {
  bool accepted = false;  ///< the row's draft was accepted
  int token = -1;         ///< the sampled token; -1 when accepted
};

/// The per-row job every backend runs for ForwardInput::sampling (the CPU
/// runs this function; the CUDA kernel is tested against it).
///
/// logits: [vocab] fp32; params: valid (ValidateSamplingParams) and not
/// greedy; p = ComputeDistribution(logits, params); q's ids must be in
/// [0, vocab).
/// - draft_id >= 0 (q: the draft's distribution, ValidateDrafts-valid with
///   q(draft_id) > 0): accepted iff u_accept * q(draft_id) < p(draft_id).
///   If accepted, token = -1; else token is drawn with u_sample from the
///   residual norm(max(0, p - q)), or from p where the residual is all 0.
/// - draft_id < 0 (q ignored): not accepted; token drawn from p.
/// The draw is an inverse CDF in ASCENDING TOKEN ID order (not p's listed
/// order, so a GPU needs no sort): the lowest id whose cumulative mass
/// exceeds u_sample * total; never a zero-mass id. u_accept and u_sample
/// are in [0, 1).
RowSample SampleRow(absl::Span<const float> logits,
                    const SamplingParams& params, int draft_id,
                    const SparseDist& q, double u_accept, double u_sample);

/// Inverse-CDF draw from `dist` in ascending id order: the lowest id whose
/// cumulative probability (ids ascending) exceeds u * total, total being
/// the sum of the listed probabilities. Zero-probability entries are never
/// returned; -1 for an empty or all-zero dist. u in [0, 1).
int SampleFromInIdOrder(const SparseDist& dist, double u);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_DECODING_ROW_SAMPLING_H_
