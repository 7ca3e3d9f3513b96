#include "router/request_options.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/decoding/logprobs.h"
#include "common/service/wire_options.h"
#include "common/tokenizer/tokenizer.h"
#include "router/prompt_limits.h"

namespace specserve {
namespace {

absl::Status Bad(absl::string_view field, absl::string_view rule, double got) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, " must be ", rule, ", got ", got));
}

constexpr struct {
  SpecDecodeMethod method;
  const char* name;
} kMethods[] = {
    {SpecDecodeMethod::kDraft, "draft"},
    {SpecDecodeMethod::kNgram, "ngram"},
    {SpecDecodeMethod::kDraftTree, "draft_tree"},
};

constexpr int kMaxTreeDepth = 16;
constexpr int kMaxTreeBranching = 8;
constexpr int kMaxTreeNodes = 64;

}  // namespace

absl::string_view SpecDecodeMethodName(SpecDecodeMethod method) {
  for (const auto& m : kMethods) {
    if (m.method == method) return m.name;
  }
  return "draft";
}

absl::StatusOr<SpecDecodeMethod> ParseSpecDecodeMethod(
    absl::string_view name, absl::string_view field) {
  std::vector<std::string> known;
  for (const auto& m : kMethods) {
    if (name == m.name) return m.method;
    known.push_back(absl::StrCat("\"", m.name, "\""));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " must be one of ", absl::StrJoin(known, ", "),
                   ", got \"", name, "\""));
}

absl::StatusOr<std::vector<int>> ResolvePrompt(
    const v1::GenerateTextRequest& request, const Tokenizer* tokenizer,
    int max_bytes_per_token, int vocab, int max_context) {
  std::vector<int> prompt;
  if (request.has_token_ids()) {
    const auto& ids = request.token_ids().ids();
    if (ids.empty()) {
      return absl::InvalidArgumentError("token_ids.ids is empty");
    }
    for (int i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || (vocab > 0 && ids[i] >= vocab)) {
        return absl::InvalidArgumentError(
            absl::StrCat("token_ids.ids[", i, "] = ", ids[i],
                         " is outside the vocabulary [0, ", vocab, ")"));
      }
    }
    prompt.assign(ids.begin(), ids.end());
  } else if (request.has_text()) {
    if (request.text().empty()) {
      return absl::InvalidArgumentError("text is empty");
    }
    if (tokenizer == nullptr) {
      return absl::InvalidArgumentError(
          "text prompts need the router's --tokenizer; send token_ids");
    }
    // Bounded before tokenizing: the work (and memory) of tokenizing grows
    // with the text, and a text this long cannot fit anyway.
    const int64_t max_bytes = MaxPromptBytes(max_context, max_bytes_per_token);
    if (max_bytes > 0 &&
        static_cast<int64_t>(request.text().size()) > max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt: ", request.text().size(),
          " bytes of text cannot fit the target's max context of ", max_context,
          " tokens (at most ", max_bytes,
          " bytes with this tokenizer); refused before tokenizing"));
    }
    auto ids = tokenizer->Encode(request.text(), /*add_bos=*/true);
    if (!ids.ok()) return ids.status();
    prompt = *std::move(ids);
  } else {
    return absl::InvalidArgumentError(
        "prompt is not set: set text or token_ids");
  }
  const int n = static_cast<int>(prompt.size());
  if (max_context > 0 && n >= max_context) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt: ", n,
                     " tokens leave no room to generate in the target's max "
                     "context of ",
                     max_context, " tokens"));
  }
  return prompt;
}

absl::StatusOr<ResolvedOptions> ResolveOptions(
    const v1::GenerateTextRequest& request, const RequestDefaults& d) {
  ResolvedOptions o;
  const v1::GenerationSampling& s = request.sampling();
  o.max_new_tokens =
      s.has_max_new_tokens() ? s.max_new_tokens() : d.max_new_tokens;
  if (o.max_new_tokens < 1) {
    return Bad("sampling.max_new_tokens", ">= 1", o.max_new_tokens);
  }
  o.sampling.set_temperature(s.has_temperature() ? s.temperature()
                                                 : d.temperature);
  o.sampling.set_top_k(s.has_top_k() ? s.top_k() : d.top_k);
  const float top_p = s.has_top_p() ? s.top_p() : d.top_p;
  if (!(top_p > 0.f && top_p <= 1.f)) {  // also rejects NaN
    return Bad("sampling.top_p", "in (0, 1]", top_p);
  }
  o.sampling.set_top_p(top_p);
  o.has_seed = s.has_seed();
  o.sampling.set_seed(s.seed());
  o.sampling.set_presence_penalty(s.presence_penalty());
  o.sampling.set_frequency_penalty(s.frequency_penalty());
  if (s.has_repetition_penalty()) {
    // The wire reads 0 as 1 (off): refuse it here, where it was sent.
    if (!(s.repetition_penalty() > 0.f)) {
      return Bad("sampling.repetition_penalty", "> 0",
                 s.repetition_penalty());
    }
    o.sampling.set_repetition_penalty(s.repetition_penalty());
  }
  if (s.logit_bias_size() > kMaxLogitBias) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.logit_bias has ", s.logit_bias_size(),
                     " ids; at most ", kMaxLogitBias, " are allowed"));
  }
  *o.sampling.mutable_logit_bias() = s.logit_bias();
  o.sampling.set_min_p(s.min_p());
  o.sampling.set_json_object(s.json_object());
  if (s.has_json_schema() && s.json_schema().empty()) {
    return absl::InvalidArgumentError("sampling.json_schema is empty");
  }
  o.sampling.set_json_schema(s.json_schema());
  *o.sampling.mutable_choice() = s.choice();
  // Compiles the schema or the choice, one structured output at most (its
  // errors name sampling.json_schema / sampling.choice).
  if (auto r = ResolveSampling(o.sampling); !r.ok()) return r.status();
  if (s.stop_size() > kMaxStopStrings) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.stop has ", s.stop_size(), " strings; at most ",
                     kMaxStopStrings, " are allowed"));
  }
  for (int i = 0; i < s.stop_size(); ++i) {
    if (s.stop(i).empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("sampling.stop[", i, "] is empty"));
    }
    if (s.stop(i).size() > kMaxStopStringBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sampling.stop[", i, "] has ", s.stop(i).size(), " bytes; at most ",
          kMaxStopStringBytes, " are allowed"));
    }
    o.stop.push_back(s.stop(i));
  }
  o.include_stop_str = s.include_stop_str_in_output();
  if (s.stop_token_ids_size() > kMaxStopTokenIds) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.stop_token_ids has ", s.stop_token_ids_size(),
                     " ids; at most ", kMaxStopTokenIds, " are allowed"));
  }
  for (int i = 0; i < s.stop_token_ids_size(); ++i) {
    if (s.stop_token_ids(i) < 0) {
      return Bad(absl::StrCat("sampling.stop_token_ids[", i, "]"), ">= 0",
                 s.stop_token_ids(i));
    }
    o.stop_token_ids.push_back(s.stop_token_ids(i));
  }
  o.ignore_eos = s.ignore_eos();
  o.min_tokens = s.min_tokens();
  if (o.min_tokens < 0 || o.min_tokens > o.max_new_tokens) {
    return Bad("sampling.min_tokens",
               absl::StrCat("in [0, max_new_tokens = ", o.max_new_tokens, "]"),
               o.min_tokens);
  }
  o.logprobs = s.logprobs();
  o.top_logprobs = s.top_logprobs();
  if (o.top_logprobs < 0 || o.top_logprobs > kMaxTopLogprobs) {
    return Bad("sampling.top_logprobs",
               absl::StrCat("in [0, ", kMaxTopLogprobs, "]"), o.top_logprobs);
  }
  if (o.top_logprobs > 0 && !o.logprobs) {
    return absl::InvalidArgumentError(
        "sampling.top_logprobs needs sampling.logprobs = true");
  }

  const v1::SpeculativePrefillConfig& p = request.speculative_prefill();
  o.spec_prefill = p.has_enabled() ? p.enabled() : d.spec_prefill;
  if (s.has_prompt_logprobs()) {
    o.prompt_logprobs = s.prompt_logprobs();
    if (o.prompt_logprobs < 0 || o.prompt_logprobs > kMaxTopLogprobs) {
      return Bad("sampling.prompt_logprobs",
                 absl::StrCat("in [0, ", kMaxTopLogprobs, "]"),
                 o.prompt_logprobs);
    }
    // Pruned tokens have no logprob: the whole prompt goes to the target.
    if (p.has_enabled() && p.enabled()) {
      return absl::InvalidArgumentError(
          "sampling.prompt_logprobs needs the whole prompt: "
          "speculative_prefill.enabled must not be true");
    }
    o.spec_prefill = false;
  }
  v1::SpecPrefillOptions& po = o.prefill;
  po.set_keep_ratio(p.has_keep_ratio() ? p.keep_ratio() : d.prefill.keep_ratio);
  po.set_keep_mass(p.has_keep_mass() ? p.keep_mass() : d.prefill.keep_mass);
  po.set_chunk_size(p.has_chunk_size() ? p.chunk_size() : d.prefill.chunk_size);
  po.set_pool_kernel_size(p.has_pool_kernel_size()
                              ? p.pool_kernel_size()
                              : d.prefill.pool_kernel_size);
  po.set_look_ahead(p.has_look_ahead() ? p.look_ahead() : d.prefill.look_ahead);
  po.set_keep_first(p.has_keep_first() ? p.keep_first() : d.prefill.keep_first);
  po.set_keep_last(p.has_keep_last() ? p.keep_last() : d.prefill.keep_last);
  po.set_min_prompt_tokens(p.has_min_prompt_tokens()
                               ? p.min_prompt_tokens()
                               : d.prefill.min_prompt_tokens);
  // The speculator's own edge check, with this API's field names; the
  // layer count is the speculator's business (num_layers_used stays 0).
  if (auto r = ResolveScoreOptions(po, SpecPrefillDefaults{}, 1 << 20,
                                   "speculative_prefill.");
      !r.ok()) {
    return r.status();
  }

  const v1::SpeculativeDecodingConfig& sd = request.speculative_decoding();
  o.spec_decode = sd.has_enabled() ? sd.enabled() : d.spec_decode;
  o.num_draft_tokens =
      sd.has_num_draft_tokens() ? sd.num_draft_tokens() : d.num_draft_tokens;
  if (auto st = ValidateNumDraftTokens(o.num_draft_tokens,
                                       "speculative_decoding.num_draft_tokens");
      !st.ok()) {
    return st;
  }
  if (sd.has_method()) {
    auto m = ParseSpecDecodeMethod(sd.method(), "speculative_decoding.method");
    if (!m.ok()) return m.status();
    o.spec_decode_method = *m;
  } else {
    o.spec_decode_method = d.spec_decode_method;
  }
  // Prompt lookup's n range (the proto's ranges). One bound alone keeps the
  // other's default where that stays valid.
  o.prompt_lookup_min = sd.has_prompt_lookup_min() ? sd.prompt_lookup_min()
                        : sd.has_prompt_lookup_max()
                            ? std::min(d.prompt_lookup_min,
                                       sd.prompt_lookup_max())
                            : d.prompt_lookup_min;
  o.prompt_lookup_max = sd.has_prompt_lookup_max() ? sd.prompt_lookup_max()
                        : sd.has_prompt_lookup_min()
                            ? std::max(d.prompt_lookup_max,
                                       sd.prompt_lookup_min())
                            : d.prompt_lookup_max;
  if (o.prompt_lookup_min < 1) {
    return Bad("speculative_decoding.prompt_lookup_min", ">= 1",
               o.prompt_lookup_min);
  }
  if (o.prompt_lookup_max < o.prompt_lookup_min ||
      o.prompt_lookup_max > kMaxPromptLookup) {
    return Bad("speculative_decoding.prompt_lookup_max",
               absl::StrCat("in [prompt_lookup_min = ", o.prompt_lookup_min,
                            ", ", kMaxPromptLookup, "]"),
               o.prompt_lookup_max);
  }
  // The draft tree's shape.
  if (sd.tree_branching_size() > 0) {
    o.tree_branching.assign(sd.tree_branching().begin(),
                            sd.tree_branching().end());
  } else {
    o.tree_branching = d.tree_branching;
  }
  const int depth = static_cast<int>(o.tree_branching.size());
  if (depth < 1 || depth > kMaxTreeDepth) {
    return Bad("speculative_decoding.tree_branching",
               absl::StrCat("1 to ", kMaxTreeDepth, " depths long"), depth);
  }
  for (int i = 0; i < depth; ++i) {
    if (o.tree_branching[i] < 1 || o.tree_branching[i] > kMaxTreeBranching) {
      return Bad(absl::StrCat("speculative_decoding.tree_branching[", i, "]"),
                 absl::StrCat("in [1, ", kMaxTreeBranching, "]"),
                 o.tree_branching[i]);
    }
  }
  o.tree_max_nodes =
      sd.has_tree_max_nodes() ? sd.tree_max_nodes() : d.tree_max_nodes;
  if (o.tree_max_nodes < 1 || o.tree_max_nodes > kMaxTreeNodes) {
    return Bad("speculative_decoding.tree_max_nodes",
               absl::StrCat("in [1, ", kMaxTreeNodes, "]"), o.tree_max_nodes);
  }
  o.tree_min_path_prob = sd.has_tree_min_path_prob() ? sd.tree_min_path_prob()
                                                     : d.tree_min_path_prob;
  if (!(o.tree_min_path_prob >= 0.0 && o.tree_min_path_prob < 1.0)) {
    return Bad("speculative_decoding.tree_min_path_prob", "in [0, 1)",
               o.tree_min_path_prob);
  }
  return o;
}

absl::Status ValidateDefaults(const RequestDefaults& defaults) {
  auto r = ResolveOptions(v1::GenerateTextRequest(), defaults);
  if (r.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("bad --default_* flag: ", r.status().message()));
}

}  // namespace specserve
