#include "common/speculation/draft_session.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <numeric>
#include <random>
#include <set>

#include "common/engine/test_util.h"
#include "common/tokenizer/token_bytes.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using testing_util::GreedyReference;
using testing_util::LoadBundled;
using testing_util::ReadJson;

class DraftSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    weights_ = LoadBundled("stories260K-draft");
    ASSERT_NE(weights_, nullptr);
    model_ = testing_util::MakeCpuRunner(weights_);
  }
  std::unique_ptr<DraftSession> NewSession(SamplingParams p = {}) {
    auto s = DraftSession::Create(model_.get(), 512, p);
    EXPECT_TRUE(s.ok()) << s.status();
    return *std::move(s);
  }
  std::shared_ptr<const ModelWeights> weights_;
  std::unique_ptr<CpuModelRunner> model_;
};

// The speculator's logits after `context` (fresh cache): the reference a
// tree's nodes are checked against.
std::vector<float> ContextLogits(ModelRunner& model,
                                 const std::vector<int>& context) {
  auto seq = model.NewSequence(512);
  EXPECT_TRUE(seq.ok());
  std::vector<int> pos(context.size());
  std::iota(pos.begin(), pos.end(), 0);
  ForwardInput in;
  in.token_ids = context;
  in.position_ids = pos;
  ForwardOutput out;
  EXPECT_TRUE(model.Forward(in, seq->get(), &out).ok());
  return out.logits;
}

// A greedy tree: valid parents in depth-first preorder, within the shape
// and budget, and every node's children are the top tokens of the
// speculator's logits after the node's path, in rank order. After any
// accepted path, the next Draft equals a fresh session's (the tree's KV
// was dropped).
TEST_F(DraftSessionTest, GreedyTreeNodesAreTopTokensOfTheirPaths) {
  const std::vector<int> prompt = {1, 403, 407, 261, 378, 432, 383, 286};
  ScoreOptions opt;
  opt.look_ahead = 2;
  auto session = NewSession();
  auto scored = session->Score(prompt, opt);
  ASSERT_TRUE(scored.ok());
  std::vector<int> committed = prompt;
  std::vector<int> emitted = {scored->look_ahead_tokens[0]};
  const DraftTreeShape shape{{3, 2, 2, 1}, 14};
  std::mt19937 rng(4);
  const int vocab = model_->config().vocab_size;
  for (int round = 0; round < 4; ++round) {
    std::vector<int> parents;
    auto drafts = session->DraftTree(emitted, shape, &parents);
    ASSERT_TRUE(drafts.ok()) << drafts.status();
    committed.insert(committed.end(), emitted.begin(), emitted.end());
    const int n = static_cast<int>(drafts->size());
    ASSERT_EQ(parents.size(), drafts->size());
    EXPECT_GT(n, 4);
    EXPECT_LE(n, shape.max_nodes);
    std::vector<int> depth(n);
    std::vector<std::vector<int>> children(n + 1);
    for (int i = 0; i < n; ++i) {
      ASSERT_GE(parents[i], -1);
      ASSERT_LT(parents[i], i);
      depth[i] = parents[i] < 0 ? 0 : depth[parents[i]] + 1;
      ASSERT_LT(depth[i], static_cast<int>(shape.branching.size()));
      children[parents[i] + 1].push_back(i);
      EXPECT_TRUE((*drafts)[i].q.empty());  // greedy
    }
    for (int v = -1; v < n; ++v) {
      const std::vector<int>& kids = children[v + 1];
      if (kids.empty()) continue;
      const int d = v < 0 ? 0 : depth[v] + 1;
      EXPECT_LE(static_cast<int>(kids.size()), shape.branching[d]);
      std::vector<int> ctx = committed;
      std::vector<int> path;
      for (int a = v; a >= 0; a = parents[a]) path.push_back((*drafts)[a].id);
      ctx.insert(ctx.end(), path.rbegin(), path.rend());
      const std::vector<float> logits = ContextLogits(*model_, ctx);
      std::vector<int> order(vocab);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int a, int b) { return logits[a] > logits[b]; });
      for (size_t c = 0; c < kids.size(); ++c) {
        EXPECT_EQ((*drafts)[kids[c]].id, order[c])
            << "round " << round << " node " << v << " child " << c;
      }
    }
    // The target accepts a random root-to-node path, then a bonus token.
    const int last = static_cast<int>(rng() % n);
    std::vector<int> path;
    for (int a = last; a >= 0; a = parents[a]) path.push_back((*drafts)[a].id);
    emitted.assign(path.rbegin(), path.rend());
    emitted.push_back(static_cast<int>(3 + rng() % 400));
    path.clear();
  }
  // The next chain Draft equals a fresh session's on the same tokens.
  committed.insert(committed.end(), emitted.begin(), emitted.end());
  auto next = session->Draft(emitted, 5);
  ASSERT_TRUE(next.ok());
  std::vector<int> want_ctx = committed;
  std::vector<int> got_ids;
  for (const DraftToken& d : *next) got_ids.push_back(d.id);
  const auto want = GreedyReference(*model_, committed, {}, committed.size(),
                                    static_cast<int>(got_ids.size()));
  EXPECT_EQ(got_ids, want);
}

// The root-to-node token paths of a tree (parents in preorder).
std::set<std::vector<int>> TreePaths(const std::vector<DraftToken>& drafts,
                                     const std::vector<int>& parents) {
  std::set<std::vector<int>> paths;
  for (size_t i = 0; i < drafts.size(); ++i) {
    std::vector<int> path;
    for (int a = static_cast<int>(i); a >= 0; a = parents[a]) {
      path.push_back(drafts[a].id);
    }
    paths.insert(std::vector<int>(path.rbegin(), path.rend()));
  }
  return paths;
}

// The speculator's probability (softmax at temperature 1) of `path` after
// `committed`, from fresh forwards.
double PathProb(ModelRunner& model, const std::vector<int>& committed,
                const std::vector<int>& path) {
  double p = 1.0;
  std::vector<int> ctx = committed;
  for (int id : path) {
    std::vector<float> l = ContextLogits(model, ctx);
    const float m = *std::max_element(l.begin(), l.end());
    double z = 0;
    for (float v : l) z += std::exp(double(v) - m);
    p *= std::exp(double(l[id]) - m) / z;
    ctx.push_back(id);
  }
  return p;
}

// min_path_prob sizes a greedy tree by confidence: its nodes are exactly
// those of the full tree whose path probability reaches the threshold, and
// the root's likeliest child (a threshold no root child reaches gives that
// one node: an empty tree would cost a round trip for one token), and the
// session goes on drafting after either.
TEST_F(DraftSessionTest, GreedyTreeKeepsExactlyTheConfidentNodes) {
  const std::vector<int> prompt = {1, 403, 407, 261, 378, 432, 383, 286};
  ScoreOptions opt;
  opt.look_ahead = 1;
  for (double tau : {0.02, 0.1, 0.3, 0.999}) {
    SCOPED_TRACE(tau);
    auto full = NewSession();
    auto pruned = NewSession();
    auto a = full->Score(prompt, opt);
    auto b = pruned->Score(prompt, opt);
    ASSERT_TRUE(a.ok() && b.ok());
    std::vector<int> committed = prompt;
    std::vector<int> emitted = {a->look_ahead_tokens[0]};
    const DraftTreeShape shape{{3, 2, 2, 2}, 64, 0.0};
    DraftTreeShape sized = shape;
    sized.min_path_prob = tau;
    for (int round = 0; round < 3; ++round) {
      std::vector<int> pf, pp;
      auto df = full->DraftTree(emitted, shape, &pf);
      auto dp = pruned->DraftTree(emitted, sized, &pp);
      ASSERT_TRUE(df.ok()) << df.status();
      ASSERT_TRUE(dp.ok()) << dp.status();
      committed.insert(committed.end(), emitted.begin(), emitted.end());
      std::set<std::vector<int>> want;
      std::vector<int> top;  // the likeliest root child
      double top_prob = -1.0;
      for (const std::vector<int>& path : TreePaths(*df, pf)) {
        const double prob = PathProb(*model_, committed, path);
        if (prob >= tau) want.insert(path);
        if (path.size() == 1 && prob > top_prob) top = path, top_prob = prob;
      }
      ASSERT_FALSE(top.empty());
      want.insert(top);
      EXPECT_EQ(TreePaths(*dp, pp), want) << "round " << round;
      if (tau > 0.99) {
        EXPECT_EQ(dp->size(), 1u);
      }
      // Accept the full tree's first root-to-leaf path, then a bonus token.
      emitted.clear();
      for (size_t i = 0; i < df->size(); ++i) {
        if (pf[i] != static_cast<int>(i) - 1) break;
        emitted.push_back((*df)[i].id);
      }
      emitted.push_back(static_cast<int>(3 + 37 * round));
    }
  }
  DraftTreeShape bad{{2}, 4, 1.0};
  std::vector<int> parents;
  auto s = NewSession();
  ASSERT_TRUE(s->Score(prompt, opt).ok());
  EXPECT_EQ(s->DraftTree({5}, bad, &parents).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(DraftSessionTest, SampledTreeChildrenAreDrawsFromQ) {
  const std::vector<int> prompt = {1, 403, 407, 261, 378, 432};
  ScoreOptions opt;
  opt.look_ahead = 1;
  SamplingParams p;
  p.temperature = 0.9f;
  p.seed = 3;
  auto session = NewSession(p);
  ASSERT_TRUE(session->Score(prompt, opt).ok());
  std::vector<int> parents;
  auto drafts = session->DraftTree({407}, DraftTreeShape{{4, 2}, 12}, &parents);
  ASSERT_TRUE(drafts.ok()) << drafts.status();
  EXPECT_EQ(drafts->size(), 12u);  // 4 children, each expanded with 2
  for (size_t i = 0; i < drafts->size(); ++i) {
    const DraftToken& d = (*drafts)[i];
    ASSERT_FALSE(d.q.empty());
    double sum = 0, own = 0;
    for (const auto& [id, prob] : d.q) {
      sum += prob;
      if (id == d.id) own = prob;
    }
    EXPECT_NEAR(sum, 1.0, 1e-3);
    EXPECT_GT(own, 0.0);
    // Siblings share their q (one distribution, i.i.d. draws).
    if (i > 0 && parents[i] == parents[i - 1]) {
      EXPECT_EQ(d.q, (*drafts)[i - 1].q);
    }
  }
  EXPECT_TRUE(ValidateDrafts(*drafts, model_->config().vocab_size, false).ok());
}

// With min_path_prob a sampled tree still draws every expanded node's full
// set of children from q (dropping unlikely draws would bias them): only
// nodes whose own path probability (the product of q along the path)
// falls below the threshold stay leaves.
TEST_F(DraftSessionTest, SampledTreeWithThresholdExpandsOnlyLikelyNodes) {
  const std::vector<int> prompt = {1, 403, 407, 261, 378, 432};
  ScoreOptions opt;
  opt.look_ahead = 1;
  SamplingParams p;
  p.temperature = 0.9f;
  p.seed = 5;
  int leaves_below = 0, expanded = 0;
  for (int trial = 0; trial < 8; ++trial) {
    p.seed = 5 + trial;
    auto session = NewSession(p);
    ASSERT_TRUE(session->Score(prompt, opt).ok());
    std::vector<int> parents;
    const double tau = 0.05;
    auto drafts =
        session->DraftTree({407}, DraftTreeShape{{3, 3, 3}, 40, tau}, &parents);
    ASSERT_TRUE(drafts.ok()) << drafts.status();
    const int n = static_cast<int>(drafts->size());
    std::vector<double> path_q(n);
    std::vector<int> kids(n + 1, 0);
    for (int i = 0; i < n; ++i) {
      const DraftToken& d = (*drafts)[i];
      double own = 0;
      for (const auto& [id, prob] : d.q) {
        if (id == d.id) own = prob;
      }
      path_q[i] = (parents[i] < 0 ? 1.0 : path_q[parents[i]]) * own;
      ++kids[parents[i] + 1];
    }
    EXPECT_EQ(kids[0], 3);  // the root's path probability is 1
    for (int i = 0; i < n; ++i) {
      const int depth_left = [&] {
        int d = 0;
        for (int a = i; a >= 0; a = parents[a]) ++d;
        return 3 - d;
      }();
      if (depth_left == 0) continue;  // at the last depth
      if (path_q[i] < tau - 1e-6) {
        EXPECT_EQ(kids[i + 1], 0) << "node " << i;
        ++leaves_below;
      } else if (path_q[i] >= tau + 1e-6) {
        EXPECT_EQ(kids[i + 1], 3) << "node " << i;  // all of them, drawn
        ++expanded;
      }
    }
  }
  EXPECT_GT(leaves_below, 0);  // the threshold did cut
  EXPECT_GT(expanded, 0);
}

TEST_F(DraftSessionTest, BadTreeShapesAreRejected) {
  auto session = NewSession();
  ScoreOptions opt;
  opt.look_ahead = 1;
  ASSERT_TRUE(session->Score({1, 403, 407}, opt).ok());
  std::vector<int> parents;
  EXPECT_TRUE(absl::IsInvalidArgument(
      session->DraftTree({5}, DraftTreeShape{{}, 8}, &parents).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      session->DraftTree({5}, DraftTreeShape{{9}, 8}, &parents).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      session->DraftTree({5}, DraftTreeShape{{2}, 65}, &parents).status()));
}

// The scoring options of a golden specprefill_case*.json's "params" (the
// reference keeps no first / last tokens).
ScoreOptions GoldenScoreOptions(const nlohmann::json& p) {
  ScoreOptions opt;
  opt.look_ahead = p["lookahead_N"];
  opt.scoring.pool_kernel_size = p.value("pool_kernel", 1);
  opt.selection.chunk_size = p["chunk_size"];
  opt.selection.keep_ratio = p["keep_fraction"];
  opt.selection.keep_first = 0;
  opt.selection.keep_last = 0;
  return opt;
}

// End to end against the independent reference: the model's own queries
// and keys -> importance -> kept chunks (golden specprefill_case*.json).
TEST_F(DraftSessionTest, ScoreMatchesGoldenSpecPrefillCases) {
  for (const char* name : {"specprefill_case1", "specprefill_case2"}) {
    SCOPED_TRACE(name);
    const auto g =
        ReadJson(std::string("tests/data/golden/") + name + ".json");
    ASSERT_EQ(g["speculator_model_dir"], "stories260K-draft");
    const ScoreOptions opt = GoldenScoreOptions(g["params"]);
    const std::vector<int> prompt = g["prompt_token_ids"];
    auto session = NewSession();
    auto r = session->Score(prompt, opt);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->look_ahead_tokens,
              g["lookahead_token_ids"].get<std::vector<int>>());
    const std::vector<float> want = g["importance"];
    ASSERT_EQ(r->importance.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(r->importance[i], want[i], 1e-4) << "token " << i;
    }
    const auto& rows = g["per_row_importance"];
    ASSERT_EQ(r->per_row_importance.size(), rows.size());
    for (size_t j = 0; j < rows.size(); ++j) {
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(r->per_row_importance[j][i], float(rows[j][i]), 1e-4)
            << "row " << j << " token " << i;
      }
    }
    EXPECT_EQ(r->selection.kept_indices,
              g["kept_token_indices"].get<std::vector<int>>());
    EXPECT_EQ(r->selection.kept_chunks,
              g["kept_chunks"].get<std::vector<int>>());
    EXPECT_EQ(r->selection.next_position, int(prompt.size()));
    EXPECT_GT(r->prefill_ns, 0);
  }
}

// Speculative Prefill scored from a bf16 KV cache (keys widened for the
// importance reduction) against the f32 cache on the golden cases: the
// importance within 2e-2 of the f32 cache's (measured: 2.3e-4 and 1.1e-2,
// importance up to 0.07 and 0.9), and the kept token indices overlap the
// f32 selection in at least 90% of them (measured: 100%, 74 and 154).
TEST_F(DraftSessionTest, ScoreWithBf16KvCacheKeepsTheF32Selection) {
  auto bf16_model =
      testing_util::MakeCpuRunner(weights_, 8, KvCacheDType::kBF16);
  ASSERT_NE(bf16_model, nullptr);
  for (const char* name : {"specprefill_case1", "specprefill_case2"}) {
    SCOPED_TRACE(name);
    const auto g =
        ReadJson(std::string("tests/data/golden/") + name + ".json");
    const ScoreOptions opt = GoldenScoreOptions(g["params"]);
    const std::vector<int> prompt = g["prompt_token_ids"];
    auto want = NewSession()->Score(prompt, opt);
    ASSERT_TRUE(want.ok()) << want.status();
    auto session = DraftSession::Create(bf16_model.get(), 512, {});
    ASSERT_TRUE(session.ok());
    auto got = (*session)->Score(prompt, opt);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->importance.size(), want->importance.size());
    float max_diff = 0.f, max_value = 0.f;
    for (size_t i = 0; i < want->importance.size(); ++i) {
      max_diff = std::max(
          max_diff, std::abs(got->importance[i] - want->importance[i]));
      max_value = std::max(max_value, std::abs(want->importance[i]));
    }
    EXPECT_LT(max_diff, 2e-2);
    const std::vector<int>& a = want->selection.kept_indices;
    const std::vector<int>& b = got->selection.kept_indices;
    ASSERT_FALSE(a.empty());
    std::vector<int> both;
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(),
                          std::back_inserter(both));
    const double overlap = double(both.size()) / a.size();
    EXPECT_GE(overlap, 0.9);
    EXPECT_EQ(got->look_ahead_tokens.size(), want->look_ahead_tokens.size());
    std::printf("%s: bf16 KV importance max |diff| %.3g (max importance "
                "%.3g); kept %zu vs %zu tokens, overlap %zu (%.1f%%); "
                "look-ahead %s\n",
                name, max_diff, max_value, b.size(), a.size(), both.size(),
                100 * overlap,
                got->look_ahead_tokens == want->look_ahead_tokens
                    ? "equal"
                    : "differs");
  }
}

// A prompt that starts with blocks another Score computed attaches them:
// same look-ahead, importance and selection as without the cache.
TEST_F(DraftSessionTest, PrefixCachedScoreEqualsUncached) {
  auto cached_runner = testing_util::MakePrefixCachingRunner(weights_, 16);
  ASSERT_NE(cached_runner, nullptr);
  std::mt19937 rng(6);
  std::vector<int> prompt = {1};
  for (int i = 1; i < 90; ++i) prompt.push_back(3 + rng() % 500);
  std::vector<int> other = prompt;  // same first 80 tokens
  for (int i = 80; i < 90; ++i) other[i] = 3 + rng() % 500;
  ScoreOptions so;
  so.look_ahead = 4;
  so.selection.chunk_size = 8;
  for (const auto& p : {prompt, other}) {
    auto warm = DraftSession::Create(cached_runner.get(), 512, {});
    ASSERT_TRUE(warm.ok());
    ASSERT_TRUE((*warm)->Score(prompt, so).ok());  // fills the cache
    auto hit = DraftSession::Create(cached_runner.get(), 512, {});
    ASSERT_TRUE(hit.ok());
    auto got = (*hit)->Score(p, so);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ((*hit)->cached_prompt_tokens(), 80);
    auto want = NewSession()->Score(p, so);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(got->look_ahead_tokens, want->look_ahead_tokens);
    EXPECT_EQ(got->selection.kept_indices, want->selection.kept_indices);
    for (size_t i = 0; i < p.size(); ++i) {
      ASSERT_NEAR(got->importance[i], want->importance[i], 1e-6);
    }
  }
}

TEST_F(DraftSessionTest, ScoreSelectionInvariants) {
  std::mt19937 rng(7);
  for (int n : {1, 2, 31, 100, 300}) {
    std::vector<int> prompt(n);
    for (int& t : prompt) t = 3 + rng() % 500;
    prompt[0] = 1;
    ScoreOptions opt;
    opt.selection.keep_ratio = 0.3f;
    opt.selection.chunk_size = 8;
    auto session = NewSession();
    auto r = session->Score(prompt, opt);
    ASSERT_TRUE(r.ok()) << r.status();
    const auto& kept = r->selection.kept_indices;
    ASSERT_FALSE(kept.empty());
    EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()));
    EXPECT_EQ(std::adjacent_find(kept.begin(), kept.end()), kept.end());
    EXPECT_EQ(kept.front(), 0);
    EXPECT_EQ(kept.back(), n - 1);
    EXPECT_EQ(r->selection.position_ids, kept);
    const int chunks = (n + 7) / 8;
    const int want_chunks = NumChunksToKeep(chunks, 0.3f);
    EXPECT_GE(static_cast<int>(kept.size()),
              std::min(n, (want_chunks - 1) * 8 + 1));
    EXPECT_LE(static_cast<int>(kept.size()), std::min(n, want_chunks * 8 + 2));
  }
}

// Draft proposals equal the draft model's own greedy continuation of the
// committed sequence, after full, partial or no acceptance.
TEST_F(DraftSessionTest, GreedyDraftsFollowTheModelAfterAnyAcceptedPrefix) {
  const std::vector<int> prompt = {1, 403, 407, 261, 378, 432, 383, 286};
  ScoreOptions opt;
  opt.look_ahead = 4;
  auto session = NewSession();
  auto r = session->Score(prompt, opt);
  ASSERT_TRUE(r.ok());
  const auto ref = GreedyReference(*model_, prompt, {}, prompt.size(), 4);
  EXPECT_EQ(r->look_ahead_tokens, ref);  // the first proposal

  std::vector<int> committed = prompt;
  std::mt19937 rng(3);
  std::vector<int> last_proposal = r->look_ahead_tokens;
  for (int round = 0; round < 12; ++round) {
    // Accept a random prefix of the last proposal, then a token that may
    // or may not match (a correction or a bonus).
    const int a = rng() % (last_proposal.size() + 1);
    std::vector<int> emitted(last_proposal.begin(), last_proposal.begin() + a);
    emitted.push_back(rng() % 2 ? 3 + rng() % 500
                                : (a < int(last_proposal.size())
                                       ? last_proposal[a]
                                       : 42));
    committed.insert(committed.end(), emitted.begin(), emitted.end());
    const int k = 1 + rng() % 6;
    auto drafts = session->Draft(emitted, k);
    ASSERT_TRUE(drafts.ok()) << drafts.status();
    ASSERT_EQ(static_cast<int>(drafts->size()), k);
    const auto want =
        GreedyReference(*model_, committed, {}, committed.size(), k);
    last_proposal.clear();
    for (int j = 0; j < k; ++j) {
      EXPECT_EQ((*drafts)[j].id, want[j]) << "round " << round << " j " << j;
      EXPECT_TRUE((*drafts)[j].q.empty());
      last_proposal.push_back((*drafts)[j].id);
    }
    EXPECT_EQ(session->committed(), committed);
  }
}

TEST_F(DraftSessionTest, SampledDraftsCarryNormalisedQAndAreSeeded) {
  SamplingParams sp;
  sp.temperature = 0.8f;
  sp.top_k = 20;
  sp.top_p = 0.95f;
  sp.seed = 11;
  const std::vector<int> prompt = {1, 403, 407, 261};
  std::vector<int> first;
  for (int rep = 0; rep < 2; ++rep) {
    auto session = NewSession(sp);
    ScoreOptions no_look_ahead;  // drafting only: the prompt, scored
    no_look_ahead.look_ahead = 0;
    ASSERT_TRUE(session->Score(prompt, no_look_ahead).ok());
    auto drafts = session->Draft({}, 8);
    ASSERT_TRUE(drafts.ok()) << drafts.status();
    std::vector<int> ids;
    for (const DraftToken& d : *drafts) {
      ASSERT_FALSE(d.q.empty());
      ASSERT_LE(d.q.size(), 20u);
      double sum = 0;
      bool in_support = false;
      for (auto [id, p] : d.q) {
        sum += p;
        in_support |= id == d.id;
      }
      EXPECT_NEAR(sum, 1.0, 1e-5);
      EXPECT_TRUE(in_support);
      ids.push_back(d.id);
    }
    if (rep == 0) {
      first = ids;
    } else {
      EXPECT_EQ(ids, first);
    }
  }
}

// The request's logit bias shapes the drafts as it shapes the target's p:
// greedy chains and tree nodes are the argmax / top tokens of the biased
// logits, and a sampled q gives a banned token no mass.
// JSON mode: with the vocabulary's mask, greedy chains, sampled chains and
// greedy trees draft only what keeps the output (the emitted tokens, then
// the drafts on the path) a JSON object prefix; without it they do not.
TEST_F(DraftSessionTest, JsonModeDraftsKeepTheObjectValid) {
  auto tok = LoadTokenizer("models/stories260K-draft");
  ASSERT_TRUE(tok.ok()) << tok.status();
  absl::StatusOr<TokenByteTable> table = BuildTokenByteTable(**tok);
  ASSERT_TRUE(table.ok());
  const JsonTokenMask mask(*table, model_->config().eos_token_ids);
  const std::vector<int> prompt = {1, 403, 407, 261};
  ScoreOptions no_look_ahead;
  no_look_ahead.look_ahead = 0;
  // The target emitted "{": a key or "}" must follow (a story model's
  // words would not).
  int open = -1;
  for (int id = 0; id < static_cast<int>(table->bytes.size()); ++id) {
    if (table->bytes[id] == "{" && open < 0) open = id;
  }
  ASSERT_GE(open, 0);
  const std::vector<int> emitted = {open};
  const auto valid = [&](std::vector<int> ids) {
    JsonMatcher m;
    for (int id : ids) {
      if (!mask.Advance(&m, id)) return false;
    }
    return true;
  };
  int unconstrained_valid = 0;
  for (const bool json : {true, false}) {
    for (const float temperature : {0.f, 1.f}) {
      SamplingParams p;
      p.json_object = true;
      p.temperature = temperature;
      p.seed = 5;
      auto s = DraftSession::Create(model_.get(), 512, p,
                                    json ? &mask : nullptr);
      ASSERT_TRUE(s.ok());
      ASSERT_TRUE((*s)->Score(prompt, no_look_ahead).ok());
      auto drafts = (*s)->Draft({}, 1);  // the first: must open
      ASSERT_TRUE(drafts.ok());
      std::vector<int> out;
      for (const DraftToken& d : *drafts) out.push_back(d.id);
      if (json) EXPECT_TRUE(valid(out)) << temperature;
      drafts = (*s)->Draft(emitted, 8);
      ASSERT_TRUE(drafts.ok());
      out = emitted;
      for (const DraftToken& d : *drafts) out.push_back(d.id);
      if (json) {
        EXPECT_TRUE(valid(out)) << temperature;
      } else {
        unconstrained_valid += valid(out);
      }
    }
    if (!json) continue;
    auto tree = DraftSession::Create(model_.get(), 512,
                                     [] { SamplingParams p; p.json_object = true; return p; }(),
                                     &mask);
    ASSERT_TRUE(tree.ok());
    ASSERT_TRUE((*tree)->Score(prompt, no_look_ahead).ok());
    ASSERT_TRUE((*tree)->Draft({}, 1).ok());
    std::vector<int> parents;
    auto nodes = (*tree)->DraftTree(emitted, DraftTreeShape{{3, 2, 2}, 12, 0.0},
                                    &parents);
    ASSERT_TRUE(nodes.ok());
    ASSERT_GT(nodes->size(), 3u);
    for (size_t i = 0; i < nodes->size(); ++i) {
      std::vector<int> path;
      for (int n = static_cast<int>(i); n >= 0; n = parents[n]) {
        path.push_back((*nodes)[n].id);
      }
      std::reverse(path.begin(), path.end());
      path.insert(path.begin(), emitted.begin(), emitted.end());
      EXPECT_TRUE(valid(path)) << "node " << i;
    }
  }
  // The story model left alone does not write JSON.
  EXPECT_LT(unconstrained_valid, 2);
}

TEST_F(DraftSessionTest, DraftsFollowTheLogitBias) {
  const std::vector<int> prompt = {1, 403, 407, 261};
  ScoreOptions no_look_ahead;
  no_look_ahead.look_ahead = 0;
  SamplingParams forced;
  forced.logit_bias = {{300, 100.f}};
  auto chain = NewSession(forced);
  ASSERT_TRUE(chain->Score(prompt, no_look_ahead).ok());
  auto drafts = chain->Draft({}, 6);
  ASSERT_TRUE(drafts.ok()) << drafts.status();
  ASSERT_EQ(drafts->size(), 6u);
  for (const DraftToken& d : *drafts) EXPECT_EQ(d.id, 300);
  auto tree = NewSession(forced);
  ASSERT_TRUE(tree->Score(prompt, no_look_ahead).ok());
  std::vector<int> parents;
  auto nodes = tree->DraftTree({}, DraftTreeShape{{2, 2}, 6, 0.0}, &parents);
  ASSERT_TRUE(nodes.ok()) << nodes.status();
  ASSERT_FALSE(nodes->empty());
  // Every node's likeliest child (its first, in preorder) is 300.
  std::set<int> seen;
  for (size_t i = 0; i < nodes->size(); ++i) {
    if (seen.insert(parents[i]).second) EXPECT_EQ((*nodes)[i].id, 300) << i;
  }
  // Sampled: the unbiased argmax, banned, is never drafted and has no q.
  const std::vector<float> raw = ContextLogits(*model_, prompt);
  const int top = static_cast<int>(
      std::max_element(raw.end() - model_->config().vocab_size, raw.end()) -
      (raw.end() - model_->config().vocab_size));
  SamplingParams banned;
  banned.temperature = 1.f;
  banned.seed = 3;
  banned.logit_bias = {{top, -100.f}};
  auto sampled = NewSession(banned);
  ASSERT_TRUE(sampled->Score(prompt, no_look_ahead).ok());
  auto q = sampled->Draft({}, 4);
  ASSERT_TRUE(q.ok()) << q.status();
  for (const DraftToken& d : *q) {
    EXPECT_NE(d.id, top);
    EXPECT_LT(ProbabilityOf(d.q, top), 1e-30f);
  }
}

// Penalties shape the drafts as they shape the target's rows: each greedy
// chain draft is the argmax of the speculator's logits after the prompt,
// the emitted tokens and the drafts before it, penalized for those (by
// hand here: repetition on prompt and output ids, then frequency and
// presence on output ids).
TEST_F(DraftSessionTest, GreedyDraftsFollowThePenalties) {
  const std::vector<int> prompt = {1, 403, 407, 261, 378, 432};
  SamplingParams sp;
  // Negative: seen ids are favoured, so the penalized argmax differs from
  // the raw one (this small model rarely repeats an id on its own).
  sp.presence_penalty = -2.f;
  sp.frequency_penalty = -1.f;
  sp.repetition_penalty = 0.5f;
  auto session = NewSession(sp);
  ScoreOptions no_look_ahead;
  no_look_ahead.look_ahead = 0;
  ASSERT_TRUE(session->Score(prompt, no_look_ahead).ok());
  // The target emitted the plain greedy continuation, twice over.
  std::vector<int> emitted;
  {
    std::vector<int> ctx = prompt;
    for (int i = 0; i < 3; ++i) {
      const std::vector<float> all = ContextLogits(*model_, ctx);
      ctx.push_back(static_cast<int>(
          std::max_element(all.end() - model_->config().vocab_size,
                           all.end()) -
          (all.end() - model_->config().vocab_size)));
      emitted.push_back(ctx.back());
    }
    const std::vector<int> again = emitted;
    emitted.insert(emitted.end(), again.begin(), again.end());
  }
  auto drafts = session->Draft(emitted, 6);
  ASSERT_TRUE(drafts.ok()) << drafts.status();
  ASSERT_EQ(drafts->size(), 6u);
  std::vector<int> context = prompt, output = emitted;
  context.insert(context.end(), emitted.begin(), emitted.end());
  const int vocab = model_->config().vocab_size;
  bool differs = false;  // from the unpenalized argmax somewhere
  for (const DraftToken& d : *drafts) {
    const std::vector<float> all = ContextLogits(*model_, context);
    std::vector<float> row(all.end() - vocab, all.end());
    const int raw = static_cast<int>(std::max_element(row.begin(), row.end()) -
                                     row.begin());
    for (int v = 0; v < vocab; ++v) {
      const int count = static_cast<int>(
          std::count(output.begin(), output.end(), v));
      const bool in_prompt =
          std::find(prompt.begin(), prompt.end(), v) != prompt.end();
      if (in_prompt || count > 0) {
        row[v] = row[v] > 0 ? row[v] / 0.5f : row[v] * 0.5f;
      }
      if (count > 0) row[v] -= -1.f * count + -2.f;
    }
    const int want = static_cast<int>(
        std::max_element(row.begin(), row.end()) - row.begin());
    EXPECT_EQ(d.id, want);
    differs |= raw != want;
    context.push_back(d.id);
    output.push_back(d.id);
  }
  EXPECT_TRUE(differs);
}

TEST_F(DraftSessionTest, BadInputIsRejected) {
  auto session = NewSession();
  EXPECT_EQ(session->Draft({}, 4).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(session->Score({}, ScoreOptions{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(session->Score({1, 512}, ScoreOptions{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  ScoreOptions bad;
  bad.look_ahead = 65;
  EXPECT_EQ(session->Score({1, 5}, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = ScoreOptions{};
  bad.selection.keep_ratio = 0;
  EXPECT_EQ(session->Score({1, 5}, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = ScoreOptions{};
  bad.scoring.pool_kernel_size = 4;
  EXPECT_EQ(session->Score({1, 5}, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(session->Score({1, 5, 9}, ScoreOptions{}).ok());
  EXPECT_EQ(session->Draft({}, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(session->Draft({}, 65).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(session->Draft({600}, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(DraftSessionTest, ProposesFewerDraftsAtTheContextLimit) {
  auto s = DraftSession::Create(model_.get(), 12, SamplingParams{});
  ASSERT_TRUE(s.ok());
  auto& session = *s;
  ScoreOptions no_look_ahead;
  no_look_ahead.look_ahead = 0;
  ASSERT_TRUE(session
                  ->Score({1, 403, 407, 261, 378, 432, 383, 286, 261, 376},
                          no_look_ahead)
                  .ok());
  auto d = session->Draft({}, 8);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->size(), 3u);  // 10 cached + 2 fed drafts fill 12 slots
  auto none = session->Draft({5, 6, 7, 8}, 8);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

}  // namespace
}  // namespace specserve
