#ifndef SPECSERVE_COMMON_SERVICE_WIRE_OPTIONS_H_
#define SPECSERVE_COMMON_SERVICE_WIRE_OPTIONS_H_

// The services' request edge: turns wire options (SpecPrefillOptions,
// SamplingParams of protos/) into the engine's option structs, validating
// them once, at the edge. The speculator, the target, the router (which
// checks a request before any backend sees it) and //tools:score share it,
// so all reject the same inputs with the same messages. Model-free: the
// router links it without the engine.

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/decoding/sampling.h"
#include "common/model/config.h"
#include "common/specprefill/score_options.h"
#include "protos/speculator.pb.h"

namespace specserve {

/// What an unset SpecPrefillOptions field means: ScoreOptions' own
/// defaults (the official code's, plus the forced BOS / last-token keeps)
/// unless a --default_* flag says otherwise.
struct SpecPrefillDefaults {
  int look_ahead = ScoreOptions().look_ahead;
  float keep_ratio = SelectionOptions().keep_ratio;
  int chunk_size = SelectionOptions().chunk_size;
  int pool_kernel_size = ScoringOptions().pool_kernel_size;
  int keep_first = SelectionOptions().keep_first;
  int keep_last = SelectionOptions().keep_last;
  int min_prompt_tokens = SelectionOptions().min_prompt_tokens;
  float keep_mass = SelectionOptions().keep_mass;  ///< 0 = off.
};

/// Resolves `opts` against `defaults` for a model with `num_layers` layers.
/// INVALID_ARGUMENT naming the field as `prefix` + name (e.g. prefix
/// "options." -> "options.keep_ratio"): keep_ratio not in (0, 1] or NaN,
/// keep_mass not in [0, 1] or NaN,
/// chunk_size < 1, pool_kernel_size even or < 1, look_ahead outside [0, 64],
/// keep_first / keep_last / min_prompt_tokens < 0, num_layers_used outside
/// [0, num_layers], an unknown aggregation. Defaults are validated too.
absl::StatusOr<ScoreOptions> ResolveScoreOptions(
    const v1::SpecPrefillOptions& opts, const SpecPrefillDefaults& defaults,
    int num_layers, const std::string& prefix);

/// Checks a prompt before any forward: non-empty, every id in
/// [0, vocab_size), and prompt + look_ahead <= the model's max context
/// (max_position_embeddings). INVALID_ARGUMENT naming `field` (e.g.
/// "token_ids[3]").
absl::Status ValidatePrompt(absl::Span<const int> token_ids, int look_ahead,
                            const ModelConfig& config,
                            const std::string& field);

/// Wire SamplingParams -> engine SamplingParams, unvalidated (proto3's
/// top_p 0 and repetition_penalty 0, i.e. unset, are read as 1).
SamplingParams ToSamplingParams(const v1::SamplingParams& p);

/// Compiles `p.json_schema` (JsonSchema::Compile) or `p.choice`
/// (JsonSchema::Choice), if set, into out->json_schema (json_object is
/// already set by ToSamplingParams). INVALID_ARGUMENT "<prefix>json_schema:
/// <why>" / "<prefix>choice: <why>" for one it refuses, or for more than
/// one of json_object, json_schema and choice set.
absl::Status AttachJsonSchema(const v1::SamplingParams& p,
                              absl::string_view prefix, SamplingParams* out);

/// ToSamplingParams, validated: INVALID_ARGUMENT naming "sampling.<field>"
/// for invalid values.
absl::StatusOr<SamplingParams> ResolveSampling(const v1::SamplingParams& p);

/// INVALID_ARGUMENT naming `field` unless k is in [1, 64] (draft tokens per
/// round, DraftSession::Draft's limit).
absl::Status ValidateNumDraftTokens(int k, const std::string& field);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SERVICE_WIRE_OPTIONS_H_
