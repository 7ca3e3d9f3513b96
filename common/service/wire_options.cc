#include "common/service/wire_options.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/decoding/json_schema.h"

namespace specserve {
namespace {

absl::Status Bad(const std::string& prefix, const char* field,
                 const std::string& rule, double got) {
  return absl::InvalidArgumentError(
      absl::StrCat(prefix, field, " must be ", rule, ", got ", got));
}

}  // namespace

absl::StatusOr<ScoreOptions> ResolveScoreOptions(
    const v1::SpecPrefillOptions& opts, const SpecPrefillDefaults& defaults,
    int num_layers, const std::string& prefix) {
  ScoreOptions out;
  out.look_ahead =
      opts.has_look_ahead() ? opts.look_ahead() : defaults.look_ahead;
  SelectionOptions& sel = out.selection;
  sel.keep_ratio =
      opts.has_keep_ratio() ? opts.keep_ratio() : defaults.keep_ratio;
  sel.keep_mass = opts.has_keep_mass() ? opts.keep_mass() : defaults.keep_mass;
  sel.chunk_size =
      opts.has_chunk_size() ? opts.chunk_size() : defaults.chunk_size;
  sel.keep_first =
      opts.has_keep_first() ? opts.keep_first() : defaults.keep_first;
  sel.keep_last = opts.has_keep_last() ? opts.keep_last() : defaults.keep_last;
  sel.min_prompt_tokens = opts.has_min_prompt_tokens()
                              ? opts.min_prompt_tokens()
                              : defaults.min_prompt_tokens;
  ScoringOptions& sc = out.scoring;
  sc.pool_kernel_size = opts.has_pool_kernel_size() ? opts.pool_kernel_size()
                                                    : defaults.pool_kernel_size;
  sc.num_layers_used = opts.has_num_layers_used() ? opts.num_layers_used() : 0;

  // Written so that NaN fails too.
  if (!(sel.keep_ratio > 0.f && sel.keep_ratio <= 1.f)) {
    return Bad(prefix, "keep_ratio", "in (0, 1]", sel.keep_ratio);
  }
  if (!(sel.keep_mass >= 0.f && sel.keep_mass <= 1.f)) {
    return Bad(prefix, "keep_mass", "in [0, 1]", sel.keep_mass);
  }
  if (sel.chunk_size < 1) {
    return Bad(prefix, "chunk_size", ">= 1", sel.chunk_size);
  }
  if (sc.pool_kernel_size < 1 || sc.pool_kernel_size % 2 == 0) {
    return Bad(prefix, "pool_kernel_size", "odd and >= 1", sc.pool_kernel_size);
  }
  if (out.look_ahead < 0 || out.look_ahead > 64) {
    return Bad(prefix, "look_ahead", "in [0, 64]", out.look_ahead);
  }
  if (sel.keep_first < 0) {
    return Bad(prefix, "keep_first", ">= 0", sel.keep_first);
  }
  if (sel.keep_last < 0) return Bad(prefix, "keep_last", ">= 0", sel.keep_last);
  if (sel.min_prompt_tokens < 0) {
    return Bad(prefix, "min_prompt_tokens", ">= 0", sel.min_prompt_tokens);
  }
  if (sc.num_layers_used < 0 || sc.num_layers_used > num_layers) {
    return Bad(prefix, "num_layers_used",
               absl::StrCat("in [0, ", num_layers, "]"), sc.num_layers_used);
  }
  switch (opts.aggregation()) {
    case v1::SpecPrefillOptions::AGGREGATION_UNSPECIFIED:
    case v1::SpecPrefillOptions::AGGREGATION_MAX:
      sc.head_layer_aggregation = ScoringOptions::Aggregation::kMax;
      break;
    case v1::SpecPrefillOptions::AGGREGATION_MEAN:
      sc.head_layer_aggregation = ScoringOptions::Aggregation::kMean;
      break;
    default:
      return Bad(prefix, "aggregation", "MAX or MEAN", opts.aggregation());
  }
  return out;
}

absl::Status ValidatePrompt(absl::Span<const int> token_ids, int look_ahead,
                            const ModelConfig& config,
                            const std::string& field) {
  if (token_ids.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is empty"));
  }
  for (size_t i = 0; i < token_ids.size(); ++i) {
    if (token_ids[i] < 0 || token_ids[i] >= config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, "[", i, "] = ", token_ids[i],
          " is outside the vocabulary [0, ", config.vocab_size, ")"));
    }
  }
  const int64_t need = static_cast<int64_t>(token_ids.size()) + look_ahead;
  if (need > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", token_ids.size(), " prompt tokens + look_ahead ",
        look_ahead, " exceed the speculator's max context of ",
        config.max_position_embeddings, " tokens"));
  }
  return absl::OkStatus();
}

SamplingParams ToSamplingParams(const v1::SamplingParams& p) {
  SamplingParams out;
  out.temperature = p.temperature();
  out.top_k = p.top_k();
  out.top_p = p.top_p() == 0.f ? 1.f : p.top_p();
  out.seed = p.seed();
  out.presence_penalty = p.presence_penalty();
  out.frequency_penalty = p.frequency_penalty();
  out.repetition_penalty =
      p.repetition_penalty() == 0.f ? 1.f : p.repetition_penalty();
  out.min_p = p.min_p();
  out.json_object =
      p.json_object() || !p.json_schema().empty() || p.choice_size() > 0;
  out.logit_bias.assign(p.logit_bias().begin(), p.logit_bias().end());
  std::sort(out.logit_bias.begin(), out.logit_bias.end());
  return out;
}

absl::StatusOr<SamplingParams> ResolveSampling(const v1::SamplingParams& p) {
  SamplingParams out = ToSamplingParams(p);
  if (absl::Status s = ValidateSamplingParams(out); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.", s.message()));
  }
  if (absl::Status s = AttachJsonSchema(p, "sampling.", &out); !s.ok()) {
    return s;
  }
  return out;
}

absl::Status AttachJsonSchema(const v1::SamplingParams& p,
                              absl::string_view prefix, SamplingParams* out) {
  // One structured output at a time (a schema's output is an object
  // already).
  if ((p.json_object() + !p.json_schema().empty() + (p.choice_size() > 0)) >
      1) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "json_schema, ", prefix, "json_object and ", prefix,
        "choice are exclusive"));
  }
  if (p.choice_size() > 0) {
    absl::StatusOr<std::shared_ptr<const JsonSchema>> choice =
        JsonSchema::Choice({p.choice().begin(), p.choice().end()});
    if (!choice.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, "choice: ", choice.status().message()));
    }
    out->json_schema = *std::move(choice);
    return absl::OkStatus();
  }
  if (p.json_schema().empty()) return absl::OkStatus();
  absl::StatusOr<std::shared_ptr<const JsonSchema>> schema =
      JsonSchema::Compile(p.json_schema());
  if (!schema.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "json_schema: ", schema.status().message()));
  }
  out->json_schema = *std::move(schema);
  return absl::OkStatus();
}

absl::Status ValidateNumDraftTokens(int k, const std::string& field) {
  if (k < 1 || k > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be in [1, 64], got ", k));
  }
  return absl::OkStatus();
}

}  // namespace specserve
