#include "common/decoding/tree_verification.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/decoding/sampling.h"
#include "common/decoding/stats.h"
#include "common/decoding/synthetic_models.h"
#include "common/decoding/verification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using ::testing::HasSubstr;

using testing_models::Dense;
using testing_models::DraftLogits;
using testing_models::TargetLogits;

// A drafted tree and the context each node extends.
struct Tree {
  std::vector<DraftToken> drafts;
  std::vector<int> parents;
  std::vector<std::vector<int>> node_ctx;  // ctx + path through node i
};

// Grows a tree breadth-first: every node at depth d gets branching[d]
// children. Greedy: the draft's top tokens (distinct). Sampled: i.i.d.
// draws from q, duplicates kept (what lossless tree sampling needs).
Tree DraftTree(const std::vector<int>& ctx, const std::vector<int>& branching,
               int vocab, const SamplingParams& params, Rng* rng) {
  Tree t;
  std::vector<int> frontier = {-1};
  for (int b : branching) {
    std::vector<int> next;
    for (int parent : frontier) {
      const std::vector<int> pctx = parent < 0 ? ctx : t.node_ctx[parent];
      const std::vector<float> logits = DraftLogits(pctx, vocab);
      SparseDist q = ComputeDistribution(
          logits, params.greedy() ? SamplingParams{1.f, 0, 1.f, 0} : params);
      for (int c = 0; c < b; ++c) {
        DraftToken d;
        if (params.greedy()) {
          d.id = q[c % q.size()].first;  // the c-th most likely
        } else {
          d.id = SampleFrom(q, rng);
          d.q = q;
        }
        t.drafts.push_back(d);
        t.parents.push_back(parent);
        t.node_ctx.push_back(pctx);
        t.node_ctx.back().push_back(d.id);
        next.push_back(static_cast<int>(t.drafts.size()) - 1);
      }
    }
    frontier = next;
  }
  return t;
}

std::vector<float> TreeRows(const std::vector<int>& ctx, const Tree& t,
                            int vocab) {
  std::vector<float> rows = TargetLogits(ctx, vocab);
  for (const std::vector<int>& c : t.node_ctx) {
    const std::vector<float> r = TargetLogits(c, vocab);
    rows.insert(rows.end(), r.begin(), r.end());
  }
  return rows;
}

TEST(TreeParentsTest, ChainsAndDepths) {
  EXPECT_TRUE(IsChain({}));
  EXPECT_TRUE(IsChain({-1, 0, 1}));
  EXPECT_FALSE(IsChain({-1, -1}));
  EXPECT_EQ(TreeDepths({-1, 0, 0, 1, -1}), (std::vector<int>{0, 1, 1, 2, 0}));
}

TEST(TreeParentsTest, RejectsBadParents) {
  EXPECT_TRUE(ValidateTreeParents({-1, 0, 0, 2}, 4).ok());
  EXPECT_THAT(ValidateTreeParents({-1, 1}, 2).message(),
              HasSubstr("parents[1] = 1 must be in [-1, 1)"));
  EXPECT_THAT(ValidateTreeParents({-2}, 1).message(),
              HasSubstr("parents[0] = -2"));
  EXPECT_THAT(ValidateTreeParents({-1}, 2).message(),
              HasSubstr("1 entries for 2 drafts"));
  const std::vector<float> logits(2 * 4, 0.f);
  auto r = VerifyDraftTree({DraftToken{9, {}}}, {-1}, logits, 4,
                           SamplingParams{}, nullptr);
  EXPECT_THAT(r.status().message(), HasSubstr("drafts[0].id = 9"));
  r = VerifyDraftTree({DraftToken{1, {}}}, {-1}, absl::MakeConstSpan(logits)
                          .subspan(0, 4), 4, SamplingParams{}, nullptr);
  EXPECT_THAT(r.status().message(), HasSubstr("expected (1 + n) * vocab_size"));
}

// Greedy over random tree shapes: the emitted tokens are exactly greedy
// decoding of the target, and trees accept more than the chain of the
// same draft model on average.
TEST(TreeVerifyTest, GreedyTreesReproduceTargetGreedy) {
  constexpr int kVocab = 24;
  constexpr int kNew = 400;
  const std::vector<int> prompt = {3, 1, 4};
  std::vector<int> reference = prompt;
  for (int i = 0; i < kNew; ++i) {
    reference.push_back(Argmax(TargetLogits(reference, kVocab)));
  }
  const std::vector<std::vector<int>> shapes = {
      {1}, {3}, {2, 2}, {4, 2, 1}, {1, 1, 1, 1}, {3, 1, 1, 1}};
  std::mt19937_64 gen(5);
  std::vector<int> ctx = prompt;
  int64_t accepted = 0, rounds = 0;
  while (static_cast<int>(ctx.size()) < static_cast<int>(reference.size())) {
    const std::vector<int>& shape = shapes[gen() % shapes.size()];
    Tree t = DraftTree(ctx, shape, kVocab, SamplingParams{}, nullptr);
    auto r = VerifyDraftTree(t.drafts, t.parents, TreeRows(ctx, t, kVocab),
                             kVocab, SamplingParams{}, nullptr);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->tokens.size(), r->path.size() + 1);
    for (size_t j = 0; j < r->path.size(); ++j) {
      EXPECT_EQ(t.drafts[r->path[j]].id, r->tokens[j]);
      EXPECT_EQ(t.parents[r->path[j]], j == 0 ? -1 : r->path[j - 1]);
    }
    ctx.insert(ctx.end(), r->tokens.begin(), r->tokens.end());
    accepted += static_cast<int64_t>(r->path.size());
    ++rounds;
  }
  ctx.resize(reference.size());
  EXPECT_EQ(ctx, reference);
  EXPECT_GT(accepted, rounds / 2);  // the trees do get accepted
}

// From the rows' argmax ids (a backend's argmax_only output) greedy tree
// verification gives what it gives from the logits, over random shapes.
TEST(TreeVerifyTest, GreedyFromArgmaxEqualsFromLogits) {
  constexpr int kVocab = 24;
  const std::vector<std::vector<int>> shapes = {
      {1}, {3}, {2, 2}, {4, 2, 1}, {1, 1, 1, 1}, {3, 1, 1, 1}};
  std::mt19937_64 gen(9);
  std::vector<int> ctx = {3, 1, 4};
  for (int round = 0; round < 200; ++round) {
    const std::vector<int>& shape = shapes[gen() % shapes.size()];
    Tree t = DraftTree(ctx, shape, kVocab, SamplingParams{}, nullptr);
    const std::vector<float> rows = TreeRows(ctx, t, kVocab);
    std::vector<int> best(t.drafts.size() + 1);
    for (size_t r = 0; r < best.size(); ++r) {
      best[r] = Argmax(absl::MakeConstSpan(rows).subspan(r * kVocab, kVocab));
    }
    auto a = VerifyDraftTree(t.drafts, t.parents, rows, kVocab,
                             SamplingParams{}, nullptr);
    auto b = VerifyDraftTreeGreedy(t.drafts, t.parents, best, kVocab);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->tokens, b->tokens);
    EXPECT_EQ(a->path, b->path);
    ctx.insert(ctx.end(), a->tokens.begin(), a->tokens.end());
  }
  EXPECT_EQ(VerifyDraftTreeGreedy({{1, {}}}, {-1}, {1}, kVocab).status().code(),
            absl::StatusCode::kInvalidArgument);  // needs 1 + n ids
  EXPECT_EQ(
      VerifyDraftTreeGreedy({{1, {}}}, {0}, {1, 1}, kVocab).status().code(),
      absl::StatusCode::kInvalidArgument);  // a node its own parent
  EXPECT_EQ(VerifyDraftTreeGreedy({{1, {}}}, {-1}, {1, -3}, kVocab)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// A chain given as a tree verifies exactly as VerifyDrafts does (same rng
// draws), greedy and sampled.
TEST(TreeVerifyTest, ChainTreeMatchesChainVerification) {
  constexpr int kVocab = 16;
  const SamplingParams sampled{0.9f, 0, 1.f, 0};
  for (int trial = 0; trial < 300; ++trial) {
    const bool greedy = trial % 3 == 0;
    const SamplingParams params = greedy ? SamplingParams{} : sampled;
    std::vector<int> ctx = {trial % kVocab, 7};
    Rng draft_rng(trial);
    Tree t = DraftTree(ctx, {1, 1, 1}, kVocab, params, &draft_rng);
    const std::vector<float> rows = TreeRows(ctx, t, kVocab);
    Rng a(1000 + trial), b(1000 + trial);
    auto chain = VerifyDrafts(t.drafts, rows, kVocab, params, &a);
    auto tree = VerifyDraftTree(t.drafts, t.parents, rows, kVocab, params, &b);
    ASSERT_TRUE(chain.ok() && tree.ok());
    EXPECT_EQ(tree->tokens, chain->tokens) << "trial " << trial;
    EXPECT_EQ(static_cast<int>(tree->path.size()), chain->num_accepted);
  }
}

// Sampled trees are lossless: the joint distribution of the first three
// emitted tokens equals the target's (chi-square), for several shapes.
struct JointCase {
  std::string name;
  SamplingParams params;
  std::vector<std::vector<int>> shapes;  // one per round, cycled
};

class TreeJointTest : public ::testing::TestWithParam<JointCase> {};

TEST_P(TreeJointTest, FirstTokensHaveTheTargetsJointDistribution) {
  const JointCase& c = GetParam();
  constexpr int kVocab = 5;
  constexpr int kLen = 3;
  constexpr int kTrials = 30000;
  const std::vector<int> prompt = {4, 2};
  std::vector<double> joint(1, 1.0);
  std::vector<std::vector<int>> prefixes = {{}};
  for (int pos = 0; pos < kLen; ++pos) {
    std::vector<double> next_joint;
    std::vector<std::vector<int>> next_prefixes;
    for (size_t i = 0; i < prefixes.size(); ++i) {
      std::vector<int> ctx = prompt;
      ctx.insert(ctx.end(), prefixes[i].begin(), prefixes[i].end());
      const std::vector<double> p = Dense(
          ComputeDistribution(TargetLogits(ctx, kVocab), c.params), kVocab);
      for (int v = 0; v < kVocab; ++v) {
        next_joint.push_back(joint[i] * p[v]);
        next_prefixes.push_back(prefixes[i]);
        next_prefixes.back().push_back(v);
      }
    }
    joint.swap(next_joint);
    prefixes.swap(next_prefixes);
  }
  Rng rng(99);
  std::vector<int64_t> counts(joint.size(), 0);
  int64_t accepted = 0, rejected_siblings = 0;
  for (int t = 0; t < kTrials; ++t) {
    std::vector<int> ctx = prompt;
    int round = 0;
    while (static_cast<int>(ctx.size() - prompt.size()) < kLen) {
      const std::vector<int>& shape = c.shapes[(t + round++) % c.shapes.size()];
      Tree tree = DraftTree(ctx, shape, kVocab, c.params, &rng);
      auto r = VerifyDraftTree(tree.drafts, tree.parents,
                               TreeRows(ctx, tree, kVocab), kVocab, c.params,
                               &rng);
      ASSERT_TRUE(r.ok()) << r.status();
      accepted += static_cast<int64_t>(r->path.size());
      if (!r->path.empty() && r->path[0] != 0) ++rejected_siblings;
      ctx.insert(ctx.end(), r->tokens.begin(), r->tokens.end());
    }
    int bin = 0;
    for (int i = 0; i < kLen; ++i) bin = bin * kVocab + ctx[prompt.size() + i];
    ++counts[bin];
  }
  const ChiSquareResult chi = ChiSquareTest(counts, joint);
  EXPECT_GT(chi.p_value, 1e-3) << "chi2=" << chi.statistic
                               << " dof=" << chi.dof;
  EXPECT_GT(chi.dof, 8);  // top-p leaves fewer sequences possible
  EXPECT_GT(accepted, 0);
  // Branching shapes do accept later siblings (the residual path runs).
  bool branches = false;
  for (const auto& s : c.shapes) branches |= !s.empty() && s[0] > 1;
  if (branches) {
    EXPECT_GT(rejected_siblings, 0);
  }
}

std::vector<JointCase> JointCases() {
  const SamplingParams plain{1.f, 0, 1.f, 0};
  const SamplingParams topk{0.8f, 3, 1.f, 0};
  const SamplingParams topp{1.2f, 0, 0.8f, 0};
  const std::vector<std::vector<int>> shapes = {
      {3}, {2, 2}, {1, 3}, {4, 1, 1}, {}};
  return {{"plain", plain, shapes},
          {"topk3", topk, shapes},
          {"topp08", topp, shapes},
          {"wide", plain, {{5, 2}}}};
}

INSTANTIATE_TEST_SUITE_P(
    Lossless, TreeJointTest, ::testing::ValuesIn(JointCases()),
    [](const testing::TestParamInfo<JointCase>& info) {
      return info.param.name;
    });

// A verifier that skipped the residual update between siblings would emit
// the target's p at the root even after rejecting a likely sibling; the
// first token's distribution would then over-weight rejected tokens. The
// chi-square test above has the power to see that: check it on one root.
TEST(TreeVerifyTest, FirstTokenOfWideRootsFollowsTarget) {
  constexpr int kVocab = 6;
  constexpr int kTrials = 60000;
  const SamplingParams params{1.f, 0, 1.f, 0};
  const std::vector<int> ctx = {1, 5};
  const SparseDist p1 = ComputeDistribution(TargetLogits(ctx, kVocab), params);
  Rng rng(3);
  std::vector<int64_t> counts(kVocab, 0);
  for (int t = 0; t < kTrials; ++t) {
    Tree tree = DraftTree(ctx, {3}, kVocab, params, &rng);
    auto r = VerifyDraftTree(tree.drafts, tree.parents,
                             TreeRows(ctx, tree, kVocab), kVocab, params, &rng);
    ASSERT_TRUE(r.ok());
    ++counts[r->tokens[0]];
  }
  const ChiSquareResult chi = ChiSquareTest(counts, Dense(p1, kVocab));
  EXPECT_GT(chi.p_value, 1e-3) << "chi2=" << chi.statistic;
}

}  // namespace
}  // namespace specserve
