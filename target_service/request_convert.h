#ifndef SPECSERVE_TARGET_SERVICE_REQUEST_CONVERT_H_
#define SPECSERVE_TARGET_SERVICE_REQUEST_CONVERT_H_

// Wire (protos/target.proto) to engine types for the Generate stream. No
// validation here: TargetSession::Create and BeginRound validate, naming
// the field (so the fuzz target covers exactly what the server runs).

#include <vector>

#include "absl/status/status.h"
#include "common/speculation/target_session.h"
#include "protos/target.pb.h"

namespace specserve {

/// The session request for a Prefill message. Proto3 zeros mean "unset":
/// empty position_ids -> 0..n-1; next_position 0 (never valid: it must
/// exceed a position >= 0) -> after the last position (-1 here);
/// max_new_tokens 0 -> `default_max_new_tokens`; top_p 0 -> 1.
TargetRequest ToTargetRequest(const v1::Prefill& prefill,
                              int default_max_new_tokens, int max_drafts);

/// Drafts (token id + optional draft distribution q) as sent.
std::vector<DraftToken> ToDrafts(
    const google::protobuf::RepeatedPtrField<v1::DraftToken>& drafts);

/// Checks Prefill.prompt_lookup when set (INVALID_ARGUMENT naming the
/// field): it needs continuous, min_n >= 1, max_n in [min_n,
/// kMaxPromptLookup], num_draft_tokens in [1, max_drafts].
absl::Status ValidatePromptLookup(const v1::Prefill& prefill, int max_drafts);

/// Prompt lookup's proposals as drafts: a point mass q = 1 at each id when
/// sampled (lossless verification of a deterministic proposal), no q when
/// greedy.
std::vector<DraftToken> PointMassDrafts(const std::vector<int>& ids,
                                        bool greedy);

}  // namespace specserve

#endif  // SPECSERVE_TARGET_SERVICE_REQUEST_CONVERT_H_
