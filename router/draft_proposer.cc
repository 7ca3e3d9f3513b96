#include "router/draft_proposer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/decoding/tree_verification.h"

namespace specserve {

void AddPointMassDrafts(
    const std::vector<int>& ids, bool greedy,
    google::protobuf::RepeatedPtrField<v1::DraftToken>* out) {
  for (int id : ids) {
    v1::DraftToken* d = out->Add();
    d->set_id(id);
    if (!greedy) {
      v1::TokenProb* q = d->add_q();
      q->set_id(id);
      q->set_prob(1.f);
    }
  }
}

double TreeMinPathProbUnderLoad(double min_path_prob, int running) {
  if (running <= 1) return std::min(0.5, min_path_prob);
  return std::min(0.5, 2 * min_path_prob * running);
}

v1::DraftRequest MakeDraftRequest(const ResolvedOptions& opts,
                                  const std::string& session_id,
                                  const std::vector<int>& emitted, int k,
                                  int running) {
  v1::DraftRequest req;
  req.set_session_id(session_id);
  req.mutable_emitted_token_ids()->Add(emitted.begin(), emitted.end());
  req.set_num_draft_tokens(k);
  if (opts.spec_decode_method == SpecDecodeMethod::kDraftTree &&
      k >= opts.num_draft_tokens) {
    v1::DraftTreeShape* tree = req.mutable_tree();
    tree->mutable_branching()->Add(opts.tree_branching.begin(),
                                   opts.tree_branching.end());
    tree->set_max_nodes(opts.tree_max_nodes);
    tree->set_min_path_prob(
        TreeMinPathProbUnderLoad(opts.tree_min_path_prob, running));
  }
  return req;
}

absl::Status ToTargetDrafts(const v1::DraftResponse& response,
                            bool tree_requested, v1::Drafts* drafts) {
  drafts->Clear();
  const auto& parents = response.parents();
  if (!parents.empty()) {
    if (!tree_requested) {
      return absl::FailedPreconditionError(
          "parents: a tree answered a request for a chain");
    }
    if (absl::Status s = ValidateTreeParents(
            absl::MakeConstSpan(parents.data(), parents.size()),
            response.drafts_size());
        !s.ok()) {
      return absl::FailedPreconditionError(s.message());
    }
  }
  *drafts->mutable_drafts() = response.drafts();
  *drafts->mutable_parents() = parents;
  return absl::OkStatus();
}

}  // namespace specserve
