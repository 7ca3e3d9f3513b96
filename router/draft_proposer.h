#ifndef SPECSERVE_ROUTER_DRAFT_PROPOSER_H_
#define SPECSERVE_ROUTER_DRAFT_PROPOSER_H_

// The messages of one request's drafting rounds, by method
// (request_options.h, SpecDecodeMethod): what the router asks the
// speculator for ("draft" a chain of k, "draft_tree" a token tree), and
// how proposals become the target's drafts (protos/target.proto, Drafts):
// chains and trees from the speculator, deterministic proposals (the
// speculator's greedy look-ahead, prompt lookup) as point masses.
// No backend is touched here; request_runner.cc sends the messages.

#include <vector>

#include "absl/status/status.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "protos/speculator.pb.h"
#include "protos/target.pb.h"
#include "router/request_options.h"

namespace specserve {

/// Appends `ids` to `out` as drafts of a deterministic proposer: greedy
/// requests send no q (the target accepts while a draft is its argmax);
/// sampled ones q = a point mass {id: 1.0}, with which speculative
/// sampling (Leviathan et al. 2023) stays lossless: the target accepts x
/// with probability p(x) and otherwise resamples from norm(max(0, p - q)).
void AddPointMassDrafts(
    const std::vector<int>& ids, bool greedy,
    google::protobuf::RepeatedPtrField<v1::DraftToken>* out);

/// The confidence threshold of a draft tree's nodes with `running`
/// requests in flight: min(0.5, min_path_prob) alone, min(0.5, 2 *
/// min_path_prob * running) from two on. A node with path probability p
/// adds p tokens per round in expectation and one verify row; with more
/// requests sharing the machine a row costs more of everyone's throughput,
/// so fewer, likelier nodes pay (Sequoia, Chen et al. 2024, sizes trees to
/// the hardware the same way). At 16 clients on the bundled pair the tree
/// with 0.32 beat the chain by 1.078x (36 runs) where 0.16 tied it
/// (bench/results/draft_methods.md). 0 stays 0.
double TreeMinPathProbUnderLoad(double min_path_prob, int running);

/// The speculator's next round: the tokens the target emitted since the
/// last one, and k drafts as a chain, or for "draft_tree" with the full
/// k (not cut by the load rule) the tree's shape (opts.tree_branching,
/// opts.tree_max_nodes, and the node threshold TreeMinPathProbUnderLoad(
/// opts.tree_min_path_prob, running)); a load-reduced round asks for a
/// chain of k. `session_id` may be "" after the stream's first message.
v1::DraftRequest MakeDraftRequest(const ResolvedOptions& opts,
                                  const std::string& session_id,
                                  const std::vector<int>& emitted, int k,
                                  int running = 1);

/// The target's drafts for a speculator's answer: its drafts, and a tree's
/// parents (DraftResponse.parents, depth-first preorder) as Drafts.parents.
/// FAILED_PRECONDITION (and `drafts` left empty) when the parents are not
/// a tree over the drafts: not one per draft, or parents[i] outside
/// [-1, i); or when parents come for a request that asked for no tree.
absl::Status ToTargetDrafts(const v1::DraftResponse& response,
                            bool tree_requested, v1::Drafts* drafts);

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_DRAFT_PROPOSER_H_
