#ifndef SPECSERVE_ROUTER_RESOLVED_OPTIONS_CHECK_H_
#define SPECSERVE_ROUTER_RESOLVED_OPTIONS_CHECK_H_

// The contract of a ResolvedOptions that ResolveOptions accepted
// (request_options.h), as one predicate for the fuzz targets that feed it
// requests: the router's gRPC request fuzzer and its OpenAI body fuzzer.

#include <cmath>
#include <string>
#include <utility>

#include "router/request_options.h"

namespace specserve {

/// The first field of `r` outside what ResolveOptions documents for an accepted
/// request ("" when every field is within it): max_new_tokens >= 1, temperature
/// finite and >= 0, top_k >= 0, top_p in (0, 1], presence / frequency penalties
/// in [-2, 2], repetition_penalty 0 (unset) or finite and > 0, min_p in [0, 1],
/// logit_bias ids >= 0 with biases in [-100, 100], min_tokens in [0,
/// max_new_tokens], non-empty stop strings, stop token ids >= 0, top_logprobs
/// in [0, 20] and only with logprobs, keep_ratio in (0, 1], num_draft_tokens in
/// [1, 64] when drafting, prompt lookup n in [1, 16] and ordered,
/// tree_max_nodes in [1, 64] and tree_min_path_prob in [0, 1).
inline std::string ResolvedOptionsViolation(const ResolvedOptions& r) {
  if (r.max_new_tokens < 1) return "max_new_tokens";
  const float t = r.sampling.temperature();
  if (!std::isfinite(t) || t < 0.f) return "temperature";
  if (r.sampling.top_k() < 0) return "top_k";
  if (!(r.sampling.top_p() > 0.f) || r.sampling.top_p() > 1.f) return "top_p";
  for (const auto& [name, v] :
       {std::pair<const char*, float>{"presence_penalty",
                                      r.sampling.presence_penalty()},
        {"frequency_penalty", r.sampling.frequency_penalty()}}) {
    if (!(v >= -2.f && v <= 2.f)) return name;
  }
  const float rep = r.sampling.repetition_penalty();
  if (!std::isfinite(rep) || rep < 0.f) return "repetition_penalty";
  const float min_p = r.sampling.min_p();
  if (!(min_p >= 0.f && min_p <= 1.f)) return "min_p";
  for (const auto& [id, bias] : r.sampling.logit_bias()) {
    if (id < 0 || !(bias >= -100.f && bias <= 100.f)) return "logit_bias";
  }
  if (r.min_tokens < 0 || r.min_tokens > r.max_new_tokens) return "min_tokens";
  for (const std::string& s : r.stop) {
    if (s.empty()) return "stop";
  }
  for (int id : r.stop_token_ids) {
    if (id < 0) return "stop_token_ids";
  }
  if (r.top_logprobs < 0 || r.top_logprobs > 20 ||
      (r.top_logprobs > 0 && !r.logprobs)) {
    return "top_logprobs";
  }
  if (!(r.prefill.keep_ratio() > 0.f) || r.prefill.keep_ratio() > 1.f) {
    return "keep_ratio";
  }
  if (r.num_draft_tokens < 0 || r.num_draft_tokens > 64 ||
      (r.spec_decode && r.num_draft_tokens < 1)) {
    return "num_draft_tokens";
  }
  if (r.spec_decode && r.spec_decode_method == SpecDecodeMethod::kNgram &&
      (r.prompt_lookup_min < 1 || r.prompt_lookup_max < r.prompt_lookup_min ||
       r.prompt_lookup_max > 16)) {
    return "prompt_lookup";
  }
  if (r.spec_decode && r.spec_decode_method == SpecDecodeMethod::kDraftTree &&
      (r.tree_max_nodes < 1 || r.tree_max_nodes > 64 ||
       !(r.tree_min_path_prob >= 0.0) || r.tree_min_path_prob >= 1.0)) {
    return "tree";
  }
  return "";
}

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_RESOLVED_OPTIONS_CHECK_H_
