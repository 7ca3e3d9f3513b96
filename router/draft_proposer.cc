#include "router/draft_proposer.h"

#include "absl/strings/str_cat.h"

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

v1::DraftRequest MakeDraftRequest(const ResolvedOptions& opts,
                                  const std::string& session_id,
                                  const std::vector<int>& emitted, int k) {
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
    if (parents.size() != response.drafts_size()) {
      return absl::FailedPreconditionError(
          absl::StrCat("parents: ", parents.size(), " for ",
                       response.drafts_size(), " drafts"));
    }
    for (int i = 0; i < parents.size(); ++i) {
      if (parents[i] < -1 || parents[i] >= i) {
        return absl::FailedPreconditionError(absl::StrCat(
            "parents[", i, "] = ", parents[i], " is outside [-1, ", i, ")"));
      }
    }
  }
  *drafts->mutable_drafts() = response.drafts();
  *drafts->mutable_parents() = parents;
  return absl::OkStatus();
}

}  // namespace specserve
