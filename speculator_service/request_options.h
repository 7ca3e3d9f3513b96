#ifndef SPECSERVE_SPECULATOR_SERVICE_REQUEST_OPTIONS_H_
#define SPECSERVE_SPECULATOR_SERVICE_REQUEST_OPTIONS_H_

// The speculator's request edge: turns wire options (SpecPrefillOptions,
// SamplingParams) into the engine's option structs, validating them once
// (STYLE.md: validated at the edge, never re-parsed). The gRPC service and
// the //tools:score CLI share it so both reject the same inputs with the same
// messages.

#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/decoding/sampling.h"
#include "common/model/config.h"
#include "common/speculation/draft_session.h"
#include "protos/speculator.pb.h"

namespace specserve {

/// What an unset SpecPrefillOptions field means (official defaults,
/// REFERENCE.md section 1, plus the forced BOS / last-token keeps).
struct ScoreDefaults {
  int look_ahead = 8;
  float keep_ratio = 0.3f;
  int chunk_size = 32;
  int pool_kernel_size = 13;
  int keep_first = 1;
  int keep_last = 1;
  int min_prompt_tokens = 0;
  float keep_mass = 0.f;  ///< 0 = off (keep by keep_ratio alone).
};

/// Resolves `opts` against `defaults` for a model with `num_layers` layers.
/// INVALID_ARGUMENT naming the field as `prefix` + name (e.g. prefix
/// "options." -> "options.keep_ratio"): keep_ratio not in (0, 1] or NaN,
/// keep_mass not in [0, 1] or NaN,
/// chunk_size < 1, pool_kernel_size even or < 1, look_ahead outside [0, 64],
/// keep_first / keep_last / min_prompt_tokens < 0, num_layers_used outside
/// [0, num_layers], an unknown aggregation. Defaults are validated too.
absl::StatusOr<ScoreOptions> ResolveScoreOptions(
    const v1::SpecPrefillOptions& opts, const ScoreDefaults& defaults,
    int num_layers, const std::string& prefix);

/// Checks a prompt before any forward: non-empty, every id in
/// [0, vocab_size), and prompt + look_ahead <= the model's max context
/// (max_position_embeddings). INVALID_ARGUMENT naming `field` (e.g.
/// "token_ids[3]").
absl::Status ValidatePrompt(absl::Span<const int> token_ids, int look_ahead,
                            const ModelConfig& config,
                            const std::string& field);

/// Wire SamplingParams -> engine SamplingParams (top_p 0 is read as 1).
/// INVALID_ARGUMENT naming "sampling.<field>" for invalid values.
absl::StatusOr<SamplingParams> ResolveSampling(const v1::SamplingParams& p);

/// INVALID_ARGUMENT naming `field` unless k is in [1, 64] (draft tokens per
/// round, DraftSession::Draft's limit).
absl::Status ValidateNumDraftTokens(int k, const std::string& field);

}  // namespace specserve

#endif  // SPECSERVE_SPECULATOR_SERVICE_REQUEST_OPTIONS_H_
