#include "common/decoding/tree_verification.h"

#include <cstddef>

#include "absl/strings/str_cat.h"

namespace specserve {

bool IsChain(absl::Span<const int> parents) {
  for (size_t i = 0; i < parents.size(); ++i) {
    if (parents[i] != static_cast<int>(i) - 1) return false;
  }
  return true;
}

std::vector<int> TreeDepths(absl::Span<const int> parents) {
  std::vector<int> depth(parents.size(), 0);
  for (size_t i = 0; i < parents.size(); ++i) {
    if (parents[i] >= 0) depth[i] = depth[parents[i]] + 1;
  }
  return depth;
}

absl::Status ValidateTreeParents(absl::Span<const int> parents,
                                 int num_nodes) {
  if (static_cast<int>(parents.size()) != num_nodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("parents has ", parents.size(), " entries for ",
                     num_nodes, " drafts"));
  }
  for (size_t i = 0; i < parents.size(); ++i) {
    if (parents[i] < -1 || parents[i] >= static_cast<int>(i)) {
      return absl::InvalidArgumentError(
          absl::StrCat("parents[", i, "] = ", parents[i], " must be in [-1, ",
                       i, ")"));
    }
  }
  return absl::OkStatus();
}

namespace {

// Greedy: from the root, move to the first child (index order) whose id is
// the target's argmax at the current node, while one exists. children[s]:
// slot s's children (slot 0 the root, 1 + i node i); best_of(slot): the
// argmax of that slot's row, asked only along the walked path.
template <typename BestOf>
TreeVerifyResult WalkGreedy(absl::Span<const DraftToken> drafts,
                            const std::vector<std::vector<int>>& children,
                            const BestOf& best_of) {
  TreeVerifyResult result;
  int slot = 0;
  for (;;) {
    const int best = best_of(slot);
    int next = -1;
    for (int c : children[slot]) {
      if (drafts[c].id == best) {
        next = c;
        break;
      }
    }
    result.tokens.push_back(best);
    if (next < 0) return result;
    result.path.push_back(next);
    slot = next + 1;
  }
}

}  // namespace

absl::StatusOr<TreeVerifyResult> VerifyDraftTree(
    absl::Span<const DraftToken> drafts, absl::Span<const int> parents,
    absl::Span<const float> target_logits, int vocab_size,
    const SamplingParams& params, Rng* rng) {
  if (absl::Status s = ValidateSamplingParams(params); !s.ok()) return s;
  if (vocab_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size must be > 0, got ", vocab_size));
  }
  const int n = static_cast<int>(drafts.size());
  if (absl::Status s = ValidateTreeParents(parents, n); !s.ok()) return s;
  if (target_logits.size() != static_cast<size_t>(n + 1) * vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target_logits has ", target_logits.size(),
        " values; expected (1 + n) * vocab_size = ", n + 1, " * ", vocab_size,
        " for n = ", n, " tree nodes"));
  }
  const bool greedy = params.greedy();
  if (absl::Status s = ValidateDrafts(drafts, vocab_size, greedy); !s.ok()) {
    return s;
  }
  if (!greedy && rng == nullptr) {
    return absl::InvalidArgumentError("rng must not be null when sampling");
  }
  // Children of every node in index order; slot 0 is the root, 1 + i node i.
  std::vector<std::vector<int>> children(n + 1);
  for (int i = 0; i < n; ++i) children[parents[i] + 1].push_back(i);
  auto row = [&](int slot) {
    return target_logits.subspan(static_cast<size_t>(slot) * vocab_size,
                                 vocab_size);
  };

  if (greedy) {
    return WalkGreedy(drafts, children,
                      [&](int slot) { return Argmax(row(slot)); });
  }

  TreeVerifyResult result;
  int slot = 0;  // the current node: 0 = root, 1 + i = node i

  // Sampled: p is the current node's (residual) distribution, mirrored in
  // p_dense so a child's p(x) is one lookup (cleared after use); q_dense is
  // Residual's scratch.
  std::vector<float> p_dense(vocab_size, 0.f), q_dense(vocab_size, 0.f);
  SparseDist p;
  const auto assign_p = [&](SparseDist next) {
    for (const auto& e : p) p_dense[e.first] = 0.f;
    p = std::move(next);
    for (const auto& e : p) p_dense[e.first] = e.second;
  };
  for (;;) {
    assign_p(ComputeDistribution(row(slot), params));
    int next = -1;
    for (int c : children[slot]) {
      const DraftToken& d = drafts[c];
      // q(x) > 0, checked by ValidateDrafts.
      const double q_x = ProbabilityOf(d.q, d.id);
      // Accept with probability min(1, p/q): u < p/q without division.
      if (rng->Uniform() * q_x < p_dense[d.id]) {
        next = c;
        break;
      }
      // Rejected: p <- norm(max(0, p - q)). p == q leaves nothing: then p
      // stays (the next sibling, drawn from q = p, is accepted for sure).
      SparseDist residual = Residual(p, d.q, &q_dense);
      double total = 0.0;
      for (const auto& e : residual) total += e.second;
      if (total > 0.0) {
        for (auto& e : residual) {
          e.second = static_cast<float>(e.second / total);
        }
        assign_p(std::move(residual));
      }
    }
    if (next < 0) {
      result.tokens.push_back(SampleFrom(p, rng));
      return result;
    }
    result.tokens.push_back(drafts[next].id);
    result.path.push_back(next);
    slot = next + 1;
  }
}

absl::StatusOr<TreeVerifyResult> VerifyDraftTreeGreedy(
    absl::Span<const DraftToken> drafts, absl::Span<const int> parents,
    absl::Span<const int> target_argmax, int vocab_size) {
  if (vocab_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size must be > 0, got ", vocab_size));
  }
  const int n = static_cast<int>(drafts.size());
  if (absl::Status s = ValidateTreeParents(parents, n); !s.ok()) return s;
  if (absl::Status s = ValidateDrafts(drafts, vocab_size, /*greedy=*/true);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ValidateTargetArgmax(
          target_argmax, static_cast<size_t>(n) + 1, vocab_size);
      !s.ok()) {
    return s;
  }
  std::vector<std::vector<int>> children(n + 1);
  for (int i = 0; i < n; ++i) children[parents[i] + 1].push_back(i);
  return WalkGreedy(drafts, children,
                    [&](int slot) { return target_argmax[slot]; });
}

}  // namespace specserve
