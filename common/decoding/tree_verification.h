#ifndef SPECSERVE_COMMON_DECODING_TREE_VERIFICATION_H_
#define SPECSERVE_COMMON_DECODING_TREE_VERIFICATION_H_

// Verification of a token tree of drafts (SpecInfer, Miao et al. 2024,
// "tree-based speculative inference and verification"; Medusa and EAGLE
// use the same greedy rule). A tree is a list of draft tokens plus
// parents[i] in [-1, i): the node drafts[i] follows, -1 = the last emitted
// token (the root). A chain of k drafts is parents = {-1, 0, 1, ..., k-2}.

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/decoding/sampling.h"
#include "common/decoding/verification.h"

namespace specserve {

/// Outcome of verifying one draft tree.
struct TreeVerifyResult {
  /// Accepted nodes from the root down (indices into the drafts), so
  /// path.size() drafts were accepted.
  std::vector<int> path;
  /// Emitted tokens: the accepted nodes' ids, then the correction (no
  /// child of the last accepted node survived) or the bonus token (it has
  /// no children). Size path.size() + 1.
  std::vector<int> tokens;
};

/// Whether `parents` describes a chain (parents[i] == i - 1 for all i).
bool IsChain(absl::Span<const int> parents);

/// Depth of every node: 0 for the root's children. parents must be valid
/// (ValidateTreeParents).
std::vector<int> TreeDepths(absl::Span<const int> parents);

/// INVALID_ARGUMENT naming the field unless parents.size() == num_nodes
/// and every parents[i] is in [-1, i) (parents come before their children,
/// so a tree is acyclic by construction).
absl::Status ValidateTreeParents(absl::Span<const int> parents, int num_nodes);

/// Verifies a draft tree against the target (lossless).
///
/// target_logits: [1 + n, vocab_size] row-major, n = drafts.size(): row 0
/// is the target's logits after the root (the last emitted token), row
/// 1 + i after node i (its ancestors' tokens and its own in the context).
///
/// Greedy params: from the root, move to the child whose id is the argmax
/// of the current row (the first such child in index order), while one
/// exists; the argmax of the row where it stops is the correction or bonus.
/// The tokens are exactly those of greedy decoding with the target alone.
///
/// Sampled params: multi-step speculative sampling (SpecInfer, Alg. 2): at
/// node v with distribution p (ComputeDistribution of v's row), its
/// children c_1..c_m in index order are tried in turn: c_j is accepted with
/// probability min(1, p(x_j) / q_j(x_j)), else p becomes
/// norm(max(0, p - q_j)); if none is accepted the final token is sampled
/// from p. The output is distributed as the target's alone PROVIDED the
/// siblings are independent draws from the same q (a sampled draft tree
/// must draw each node's children i.i.d., duplicates allowed). A node's q
/// is the draft distribution it was drawn from, as for chains. Rng draws:
/// one per tested child plus one for the final token.
///
/// Errors (INVALID_ARGUMENT, naming the field): invalid params, bad
/// parents (ValidateTreeParents), vocab_size <= 0, target_logits.size() !=
/// (1 + n) * vocab_size, anything ValidateDrafts rejects, or a null rng
/// when sampling.
absl::StatusOr<TreeVerifyResult> VerifyDraftTree(
    absl::Span<const DraftToken> drafts, absl::Span<const int> parents,
    absl::Span<const float> target_logits, int vocab_size,
    const SamplingParams& params, Rng* rng);

/// Greedy tree verification from the target's argmax per row (what a
/// backend returns for ForwardInput::argmax_only): target_argmax [1 + n],
/// row 0 the root's, row 1 + i node i's. The same result as VerifyDraftTree
/// with greedy params on the rows' logits. INVALID_ARGUMENT for bad
/// parents, vocab_size <= 0, target_argmax.size() != 1 + n, or an id
/// outside [0, vocab_size).
absl::StatusOr<TreeVerifyResult> VerifyDraftTreeGreedy(
    absl::Span<const DraftToken> drafts, absl::Span<const int> parents,
    absl::Span<const int> target_argmax, int vocab_size);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_DECODING_TREE_VERIFICATION_H_
