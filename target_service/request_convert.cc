#include "target_service/request_convert.h"

#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/decoding/ngram_proposer.h"
#include "common/service/wire_options.h"

namespace specserve {

TargetRequest ToTargetRequest(const v1::Prefill& p,
                              int default_max_new_tokens, int max_drafts) {
  TargetRequest r;
  r.token_ids.assign(p.token_ids().begin(), p.token_ids().end());
  if (p.position_ids().empty()) {
    r.position_ids.resize(r.token_ids.size());
    std::iota(r.position_ids.begin(), r.position_ids.end(), 0);
  } else {
    r.position_ids.assign(p.position_ids().begin(), p.position_ids().end());
  }
  r.next_position = p.next_position() == 0 ? -1 : p.next_position();
  r.sampling = ToSamplingParams(p.sampling());
  r.penalty_prompt_ids.assign(p.penalty_prompt_ids().begin(),
                              p.penalty_prompt_ids().end());
  r.stop.max_new_tokens = p.stop().max_new_tokens() == 0
                              ? default_max_new_tokens
                              : p.stop().max_new_tokens();
  r.stop.stop_token_ids.assign(p.stop().stop_token_ids().begin(),
                               p.stop().stop_token_ids().end());
  r.ignore_eos = p.stop().ignore_eos();
  r.stop.min_new_tokens = p.stop().min_new_tokens();
  r.max_drafts = max_drafts;
  r.logprobs = p.logprobs();
  r.top_logprobs = p.top_logprobs();
  r.prompt_logprobs = p.has_prompt_logprobs() ? p.prompt_logprobs() : -1;
  return r;
}

std::vector<DraftToken> ToDrafts(
    const google::protobuf::RepeatedPtrField<v1::DraftToken>& in) {
  std::vector<DraftToken> out(in.size());
  for (int j = 0; j < in.size(); ++j) {
    out[j].id = in[j].id();
    out[j].q.reserve(in[j].q_size());
    for (const v1::TokenProb& tp : in[j].q()) {
      out[j].q.emplace_back(tp.id(), tp.prob());
    }
  }
  return out;
}

absl::Status ValidatePromptLookup(const v1::Prefill& p, int max_drafts) {
  if (!p.has_prompt_lookup()) return absl::OkStatus();
  const v1::PromptLookup& l = p.prompt_lookup();
  if (!p.continuous()) {
    return absl::InvalidArgumentError(
        "prefill.prompt_lookup needs prefill.continuous");
  }
  if (l.min_n() < 1 || l.max_n() < l.min_n() ||
      l.max_n() > kMaxPromptLookup) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill.prompt_lookup: need 1 <= min_n <= max_n <= ",
        kMaxPromptLookup, ", got min_n ", l.min_n(), ", max_n ", l.max_n()));
  }
  if (l.num_draft_tokens() < 1 || l.num_draft_tokens() > max_drafts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill.prompt_lookup.num_draft_tokens must be in [1, ", max_drafts,
        "], got ", l.num_draft_tokens()));
  }
  return absl::OkStatus();
}

std::vector<DraftToken> PointMassDrafts(const std::vector<int>& ids,
                                        bool greedy) {
  std::vector<DraftToken> out(ids.size());
  for (size_t j = 0; j < ids.size(); ++j) {
    out[j].id = ids[j];
    if (!greedy) out[j].q = {{ids[j], 1.f}};
  }
  return out;
}

}  // namespace specserve
