#include "common/speculation/target_session.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/tokenizer/token_bytes.h"
#include "nlohmann/json.hpp"
#include "common/decoding/stats.h"
#include "common/engine/test_util.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using testing_util::GreedyReference;
using testing_util::LoadBundled;
using testing_util::ReadJson;

class TargetSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    target_w_ = LoadBundled("stories260K");
    draft_w_ = LoadBundled("stories260K-draft");
    ASSERT_NE(target_w_, nullptr);
    ASSERT_NE(draft_w_, nullptr);
    target_ = testing_util::MakeCpuRunner(target_w_);
    draft_ = testing_util::MakeCpuRunner(draft_w_);
  }
  TargetRequest Request(std::vector<int> ids, int max_new) {
    TargetRequest r;
    r.token_ids = ids;
    r.position_ids.resize(ids.size());
    std::iota(r.position_ids.begin(), r.position_ids.end(), 0);
    r.stop.max_new_tokens = max_new;
    return r;
  }
  std::shared_ptr<const ModelWeights> target_w_, draft_w_;
  std::unique_ptr<CpuModelRunner> target_, draft_;
};

const std::vector<int> kPrompt = {1, 403, 407, 261, 378, 432, 383, 286, 261,
                                  376, 400, 428, 395};

// `m`'s logits after kPrompt (its last row).
std::vector<float> PromptLastLogits(ModelRunner& m) {
  auto cache = *m.NewSequence(64);
  std::vector<int> pos(kPrompt.size());
  std::iota(pos.begin(), pos.end(), 0);
  ForwardInput in;
  in.token_ids = kPrompt;
  in.position_ids = pos;
  ForwardOutput out;
  EXPECT_TRUE(m.Forward(in, cache.get(), &out).ok());
  return out.logits;
}

TEST_F(TargetSessionTest, GreedyWithRandomDraftsEqualsPlainGreedy) {
  const int kNew = 40;
  const auto want = GreedyReference(*target_, kPrompt, {}, kPrompt.size(), kNew);
  std::mt19937 rng(1);
  for (int trial = 0; trial < 5; ++trial) {
    auto s = TargetSession::Create(target_.get(), Request(kPrompt, kNew));
    ASSERT_TRUE(s.ok()) << s.status();
    std::vector<int> got;
    int rounds = 0, accepted = 0;
    while (!(*s)->finished()) {
      // Random drafts, half the time seeded with the true continuation so
      // that both acceptance and rejection paths run.
      const int k = rng() % 9;
      std::vector<DraftToken> drafts(k);
      for (int j = 0; j < k; ++j) {
        const size_t at = got.size() + j;
        drafts[j].id = (rng() % 3 != 0 && at < want.size()) ? want[at]
                                                             : rng() % 512;
      }
      auto round = (*s)->Step(drafts);
      ASSERT_TRUE(round.ok()) << round.status();
      EXPECT_EQ(round->tokens.size(),
                round->finish == FinishReason::kNone
                    ? size_t(round->num_accepted + 1)
                    : round->tokens.size());
      got.insert(got.end(), round->tokens.begin(), round->tokens.end());
      accepted += round->num_accepted;
      ++rounds;
    }
    EXPECT_EQ(got, want);
    EXPECT_EQ((*s)->finish_reason(), FinishReason::kLength);
    EXPECT_LT(rounds, kNew);  // some drafts were accepted
    EXPECT_GT(accepted, 0);
  }
}

// A random draft tree for the next round: `nodes` nodes, parents before
// children, some seeded with the true greedy continuation `want` (at the
// node's depth) so that deep paths are accepted, others random. Its nodes
// come in a random valid order, so accepted paths are often not in
// consecutive slots (the KV rewrite path runs).
void RandomTree(const std::vector<int>& want, size_t at, int nodes,
                int vocab, std::mt19937* rng, std::vector<DraftToken>* drafts,
                std::vector<int>* parents) {
  drafts->assign(nodes, DraftToken());
  parents->assign(nodes, -1);
  std::vector<int> depth(nodes, 0);
  std::vector<bool> on_truth(nodes, false);  // path so far == want
  for (int i = 0; i < nodes; ++i) {
    const int p = static_cast<int>((*rng)() % (i + 1)) - 1;
    (*parents)[i] = p;
    depth[i] = p < 0 ? 0 : depth[p] + 1;
    const bool parent_true = p < 0 || on_truth[p];
    const size_t pos = at + depth[i];
    const bool truth = parent_true && pos < want.size() && (*rng)() % 2 == 0;
    (*drafts)[i].id = truth ? want[pos] : static_cast<int>((*rng)() % vocab);
    on_truth[i] = parent_true && pos < want.size() &&
                  (*drafts)[i].id == want[pos];
  }
}

// Tree verification with greedy: exactly the tokens of plain greedy
// decoding of the target, on both bundled targets, full and pruned
// prompts, whatever the tree's shape and slot order.
TEST_F(TargetSessionTest, GreedyTreesEqualPlainGreedy) {
  auto big_w = LoadBundled("tinystories-656K");
  ASSERT_NE(big_w, nullptr);
  auto big = testing_util::MakeCpuRunner(big_w);
  struct Case {
    CpuModelRunner* model;
    std::vector<int> positions;  // empty = 0..n-1
  };
  std::vector<int> pruned(kPrompt.size());
  for (size_t i = 0; i < pruned.size(); ++i) pruned[i] = 3 * i + (i > 4 ? 7 : 0);
  const std::vector<Case> cases = {{target_.get(), {}},
                                   {big.get(), {}},
                                   {target_.get(), pruned}};
  const int kNew = 48;
  std::mt19937 rng(11);
  for (const Case& c : cases) {
    const int next = c.positions.empty() ? static_cast<int>(kPrompt.size())
                                         : c.positions.back() + 5;
    const auto want =
        GreedyReference(*c.model, kPrompt, c.positions, next, kNew);
    ASSERT_EQ(want.size(), static_cast<size_t>(kNew));
    TargetRequest r = Request(kPrompt, kNew);
    if (!c.positions.empty()) r.position_ids = c.positions;
    r.next_position = next;
    auto s = TargetSession::Create(c.model, r);
    ASSERT_TRUE(s.ok()) << s.status();
    std::vector<int> got;
    int rounds = 0, accepted = 0, deep = 0;
    while (!(*s)->finished()) {
      std::vector<DraftToken> drafts;
      std::vector<int> parents;
      RandomTree(want, got.size(), static_cast<int>(rng() % 20), 
                 c.model->config().vocab_size, &rng, &drafts, &parents);
      auto round = (*s)->Step(drafts, parents);
      ASSERT_TRUE(round.ok()) << round.status();
      got.insert(got.end(), round->tokens.begin(), round->tokens.end());
      accepted += round->num_accepted;
      deep += round->num_accepted >= 2;
      ++rounds;
    }
    EXPECT_EQ(got, want);
    EXPECT_LT(rounds, kNew / 2);
    EXPECT_GT(deep, 0);
  }
}

// The same with the rounds' forwards planned under a small row budget
// (prefill chunks, a tree that must wait for its own forward) and a
// preemption between some rounds: still exactly greedy decoding.
TEST_F(TargetSessionTest, TreesUnderSmallBudgetsAndPreemptionEqualGreedy) {
  const int kNew = 40;
  const auto want =
      GreedyReference(*target_, kPrompt, {}, kPrompt.size(), kNew);
  std::mt19937 rng(5);
  auto s = TargetSession::Create(target_.get(), Request(kPrompt, kNew));
  ASSERT_TRUE(s.ok()) << s.status();
  std::vector<int> got;
  int round_no = 0;
  while (!(*s)->finished()) {
    std::vector<DraftToken> drafts;
    std::vector<int> parents;
    RandomTree(want, got.size(), 1 + static_cast<int>(rng() % 12),
               target_->config().vocab_size, &rng, &drafts, &parents);
    if (round_no % 4 == 3) (*s)->Preempt();
    ASSERT_TRUE((*s)->BeginRound(drafts, parents).ok());
    while (!(*s)->round_complete()) {
      // Enough for the final rows, sometimes not for the context.
      const int budget = std::max((*s)->min_forward_rows(),
                                  static_cast<int>(rng() % 8) + 1);
      SequenceForward entry;
      ASSERT_TRUE((*s)->PlanForward(budget, &entry).ok());
      ASSERT_LE(static_cast<int>(entry.input.token_ids.size()), budget);
      ForwardOutput out;
      std::vector<ForwardOutput> outs;
      ASSERT_TRUE(target_->Forward(absl::MakeConstSpan(&entry, 1), &outs).ok());
      ASSERT_TRUE((*s)->CompleteForward(outs[0]).ok());
    }
    auto round = (*s)->TakeRoundResult();
    ASSERT_TRUE(round.ok());
    got.insert(got.end(), round->tokens.begin(), round->tokens.end());
    ++round_no;
  }
  EXPECT_EQ(got, want);
}

TEST_F(TargetSessionTest, BadTreeParentsAreRejected) {
  auto s = TargetSession::Create(target_.get(), Request(kPrompt, 8));
  ASSERT_TRUE(s.ok());
  std::vector<DraftToken> drafts(3);
  for (auto& d : drafts) d.id = 5;
  EXPECT_TRUE(absl::IsInvalidArgument(
      (*s)->BeginRound(drafts, std::vector<int>{-1, 2, 0})));
  EXPECT_TRUE(absl::IsInvalidArgument(
      (*s)->BeginRound(drafts, std::vector<int>{-1, 0})));
  EXPECT_FALSE((*s)->in_round());
  EXPECT_TRUE((*s)->BeginRound(drafts, std::vector<int>{-1, -1, 0}).ok());
}

// Pruned prompts: the KV cache holds only kept tokens at their original
// positions and decoding continues at the original length (golden cases).
// Rounds driven in steps with chunked prefill and several sessions batched
// into each forward (what the target scheduler does) emit exactly what
// Step() emits for each session alone.
TEST_F(TargetSessionTest, ChunkedBatchedRoundsEqualStep) {
  const int kNew = 24;
  std::mt19937 rng(3);
  std::vector<std::vector<int>> prompts;
  for (int len : {13, 40, 7}) {
    std::vector<int> p = {1};
    for (int i = 1; i < len; ++i) p.push_back(3 + rng() % 500);
    prompts.push_back(p);
  }
  // Per-round drafts, the same for both runs: random ids (greedy, so the
  // output is the greedy continuation whatever is accepted).
  std::vector<std::vector<std::vector<DraftToken>>> drafts(prompts.size());
  for (auto& per_session : drafts) {
    for (int r = 0; r < kNew; ++r) {
      std::vector<DraftToken> d(rng() % 5);
      for (auto& t : d) t.id = 3 + rng() % 500;
      per_session.push_back(d);
    }
  }
  std::vector<std::vector<int>> alone;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto s = TargetSession::Create(target_.get(), Request(prompts[i], kNew));
    ASSERT_TRUE(s.ok()) << s.status();
    for (int r = 0; !(*s)->finished(); ++r) {
      ASSERT_TRUE((*s)->Step(drafts[i][r]).ok());
    }
    alone.push_back((*s)->output());
  }

  std::vector<std::unique_ptr<TargetSession>> sessions;
  std::vector<int> round(prompts.size(), 0);
  for (const auto& p : prompts) {
    auto s = TargetSession::Create(target_.get(), Request(p, kNew));
    ASSERT_TRUE(s.ok()) << s.status();
    sessions.push_back(*std::move(s));
  }
  int forwards = 0, chunked = 0;
  while (true) {
    // A budget of 9 rows per forward: prompts go in chunks, verify rows of
    // other sessions ride along.
    int budget = 9;
    std::vector<SequenceForward> batch;
    std::vector<int> who;
    for (size_t i = 0; i < sessions.size(); ++i) {
      TargetSession& s = *sessions[i];
      if (s.finished()) continue;
      if (!s.in_round()) {
        ASSERT_TRUE(s.BeginRound(drafts[i][round[i]]).ok());
      }
      if (s.min_forward_rows() > budget) continue;
      SequenceForward e;
      ASSERT_TRUE(s.PlanForward(budget, &e).ok());
      budget -= static_cast<int>(e.input.token_ids.size());
      batch.push_back(e);
      who.push_back(static_cast<int>(i));
    }
    if (batch.empty()) break;
    std::vector<ForwardOutput> outs;
    ASSERT_TRUE(target_->Forward(batch, &outs).ok());
    ++forwards;
    for (size_t b = 0; b < batch.size(); ++b) {
      const absl::Status r = sessions[who[b]]->CompleteForward(outs[b]);
      ASSERT_TRUE(r.ok()) << r;
      if (sessions[who[b]]->round_complete()) {
        ASSERT_TRUE(sessions[who[b]]->TakeRoundResult().ok());
        ++round[who[b]];
      } else {
        ++chunked;
      }
    }
  }
  EXPECT_GT(chunked, 3);  // the 40-token prompt took several chunks
  for (size_t i = 0; i < sessions.size(); ++i) {
    EXPECT_EQ(sessions[i]->output(), alone[i]) << i;
  }
}

// Automatic prefix caching: a second request whose pruned prompt shares a
// long prefix (same kept tokens at the same original positions) skips
// those blocks' prefill and emits exactly the same tokens; the same tokens
// at other positions do not match.
TEST_F(TargetSessionTest, PrefixCachingSkipsSharedPrefixAndKeepsOutputs) {
  auto runner = testing_util::MakePrefixCachingRunner(target_w_, 8);
  ASSERT_NE(runner, nullptr);
  std::mt19937 rng(12);
  TargetRequest base;
  for (int i = 0; i < 60; ++i) {
    base.token_ids.push_back(i == 0 ? 1 : 3 + rng() % 500);
    base.position_ids.push_back(i == 0 ? 0 : 2 * i + 5);  // pruned
  }
  base.stop.max_new_tokens = 12;
  TargetRequest longer = base;  // same prefix, different tail
  for (int i = 0; i < 10; ++i) {
    longer.token_ids.push_back(3 + rng() % 500);
    longer.position_ids.push_back(longer.position_ids.back() + 1);
  }
  auto run = [&](ModelRunner* m, const TargetRequest& r, int* cached) {
    auto s = TargetSession::Create(m, r);
    EXPECT_TRUE(s.ok()) << s.status();
    while (s.ok() && !(*s)->finished()) {
      auto round = (*s)->Step({});
      EXPECT_TRUE(round.ok()) << round.status();
      if (!round.ok()) break;
    }
    *cached = (*s)->cached_prompt_tokens();
    return (*s)->output();
  };
  int cached = -1;
  const auto first = run(runner.get(), base, &cached);
  EXPECT_EQ(cached, 0);
  const auto again = run(runner.get(), base, &cached);
  EXPECT_EQ(cached, 56);  // 7 whole blocks of 8; the last token always runs
  EXPECT_EQ(again, first);
  const auto tail = run(runner.get(), longer, &cached);
  EXPECT_EQ(cached, 56);
  int unused;
  EXPECT_EQ(tail, run(target_.get(), longer, &unused));  // no caching
  TargetRequest moved = base;
  for (int& p : moved.position_ids) p += 1;
  run(runner.get(), moved, &cached);
  EXPECT_EQ(cached, 0);
  EXPECT_EQ(runner->kv_cache().prefix_cache_hits(), 56 + 56);
}

TEST_F(TargetSessionTest, RoundStepsRejectMisuseAndAbortRollsBack) {
  auto s = TargetSession::Create(target_.get(), Request(kPrompt, 8));
  ASSERT_TRUE(s.ok());
  SequenceForward e;
  EXPECT_EQ((*s)->PlanForward(4, &e).code(),
            absl::StatusCode::kFailedPrecondition);  // no round begun
  std::vector<DraftToken> d(3);
  for (auto& t : d) t.id = 5;
  ASSERT_TRUE((*s)->BeginRound(d).ok());
  EXPECT_EQ((*s)->BeginRound(d).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*s)->pending_rows(), static_cast<int>(kPrompt.size()) + 3);
  // Prefill all but the last prompt token, then abort: the cache is empty
  // again and the round starts over.
  ASSERT_TRUE((*s)->PlanForward(12, &e).ok());
  EXPECT_EQ(e.input.token_ids.size(), 12u);
  ForwardOutput out;
  ASSERT_TRUE(target_->Forward(e.input, e.kv, &out).ok());
  ASSERT_TRUE((*s)->CompleteForward(out).ok());
  EXPECT_EQ((*s)->kv_tokens(), 12);
  // One prompt token + 3 drafts left: a 3-row budget cannot take the final
  // forward.
  EXPECT_EQ((*s)->min_forward_rows(), 4);
  EXPECT_EQ((*s)->PlanForward(3, &e).code(),
            absl::StatusCode::kFailedPrecondition);
  (*s)->Abort();
  EXPECT_EQ((*s)->kv_tokens(), 0);
  EXPECT_FALSE((*s)->in_round());
  auto r = (*s)->Step(d);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*s)->kv_tokens(), static_cast<int>(kPrompt.size()) +
                                   r->num_accepted);
}

TEST_F(TargetSessionTest, PrunedPromptsMatchGoldenGreedy) {
  const auto g = ReadJson("tests/data/golden/stories260K.json");
  int checked = 0;
  for (const auto& cs : g["cases"]) {
    TargetRequest r;
    r.token_ids = cs["token_ids"].get<std::vector<int>>();
    r.position_ids = cs["position_ids"].get<std::vector<int>>();
    r.next_position = cs["greedy"]["start_position"];
    const std::vector<int> want = cs["greedy"]["token_ids"];
    const int robust = cs["greedy"]["robust_prefix_len"];
    r.stop.max_new_tokens = robust;
    r.ignore_eos = true;
    auto s = TargetSession::Create(target_.get(), r);
    ASSERT_TRUE(s.ok()) << s.status();
    while (!(*s)->finished()) ASSERT_TRUE((*s)->Step({}).ok());
    EXPECT_EQ((*s)->output(),
              std::vector<int>(want.begin(), want.begin() + robust))
        << cs["name"];
    ++checked;
  }
  EXPECT_EQ(checked, 6);
}

TEST_F(TargetSessionTest, KvCacheRollsBackToAcceptedLength) {
  auto s = TargetSession::Create(target_.get(), Request(kPrompt, 50));
  ASSERT_TRUE(s.ok());
  const auto want = GreedyReference(*target_, kPrompt, {}, kPrompt.size(), 10);
  // Two right drafts then three wrong ones.
  std::vector<DraftToken> d = {{want[0], {}}, {want[1], {}}, {7, {}},
                               {8, {}}, {9, {}}};
  if (want[2] == 7) d[2].id = 6;
  auto r = (*s)->Step(d);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->num_accepted, 2);
  EXPECT_EQ(r->tokens, std::vector<int>(want.begin(), want.begin() + 3));
  // Cached: prompt + the two accepted drafts (the correction is fed next).
  EXPECT_EQ((*s)->kv_tokens(), static_cast<int>(kPrompt.size() + 2));
  const size_t per_block = target_->kv_cache().bytes_per_block();
  const int bs = target_->kv_cache().block_size();
  EXPECT_EQ((*s)->kv_bytes(), (kPrompt.size() + 2 + bs - 1) / bs * per_block);
  auto r2 = (*s)->Step({});
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->tokens, std::vector<int>{want[3]});
  EXPECT_EQ((*s)->kv_tokens(), static_cast<int>(kPrompt.size() + 3));
}

// Lossless speculative sampling on real models: the first token emitted by
// verification of a draft sampled from q (stories260K-draft) is distributed
// as direct sampling from p (stories260K), both under top-k 20.
TEST_F(TargetSessionTest, SpeculativeSamplingMatchesTargetDistribution) {
  SamplingParams sp;
  sp.temperature = 1.0f;
  sp.top_k = 20;
  const int vocab = target_->config().vocab_size;
  const std::vector<float> p_logits = PromptLastLogits(*target_);
  const std::vector<float> q_logits = PromptLastLogits(*draft_);
  const SparseDist p = ComputeDistribution(p_logits, sp);
  const SparseDist q = ComputeDistribution(q_logits, sp);
  // Target rows for [last prompt token, x_1]: the first token depends only
  // on row 0; row 1 (the bonus distribution) is set to p too.
  std::vector<float> rows = p_logits;
  rows.insert(rows.end(), p_logits.begin(), p_logits.end());

  const int kTrials = 20000;
  Rng rng(12345);
  std::map<int, int> spec, direct;
  int accepted = 0;
  for (int t = 0; t < kTrials; ++t) {
    DraftToken d{SampleFrom(q, &rng), q};
    auto v = VerifyDrafts(absl::MakeConstSpan(&d, 1), rows, vocab, sp, &rng);
    ASSERT_TRUE(v.ok()) << v.status();
    ++spec[v->tokens[0]];
    accepted += v->num_accepted;
    ++direct[SampleFrom(p, &rng)];
  }
  // Two-sample chi-square over p's support, pooling cells with small
  // expected counts into one.
  double stat = 0;
  int dof = -1;
  double pooled_a = 0, pooled_b = 0;
  for (auto [id, prob] : p) {
    const double a = spec[id], b = direct[id];
    if (prob * kTrials < 20) {
      pooled_a += a;
      pooled_b += b;
      continue;
    }
    stat += (a - b) * (a - b) / (a + b);
    ++dof;
  }
  if (pooled_a + pooled_b > 0) {
    stat += (pooled_a - pooled_b) * (pooled_a - pooled_b) / (pooled_a + pooled_b);
    ++dof;
  }
  // Nothing outside p's support is ever emitted.
  int outside = 0;
  for (auto [id, c] : spec) {
    bool in = false;
    for (auto [pid, prob] : p) in |= pid == id;
    if (!in) outside += c;
  }
  EXPECT_EQ(outside, 0);
  ASSERT_GE(dof, 3);
  const double pvalue = ChiSquarePValue(stat, dof);
  EXPECT_GT(pvalue, 0.001) << "chi2 " << stat << " dof " << dof;
  // Acceptance rate ~ sum_x min(p, q).
  double overlap = 0;
  std::map<int, float> qm(q.begin(), q.end());
  for (auto [id, prob] : p) overlap += std::min<double>(prob, qm[id]);
  const double rate = double(accepted) / kTrials;
  EXPECT_NEAR(rate, overlap, 4 * std::sqrt(overlap * (1 - overlap) / kTrials));
}

// The same through the session and the backend: a sampled chain round
// samples its rows in the forward (ForwardInput::sampling), and the first
// token a round emits is distributed as the target's p.
TEST_F(TargetSessionTest, SampledRoundsThroughTheBackendMatchTarget) {
  SamplingParams sp;
  sp.temperature = 1.0f;
  sp.top_k = 12;
  const int vocab = target_->config().vocab_size;
  const SparseDist p = ComputeDistribution(PromptLastLogits(*target_), sp);
  const SparseDist q = ComputeDistribution(PromptLastLogits(*draft_), sp);
  const int kTrials = 3000;
  Rng draft_rng(77);
  std::vector<int64_t> counts(vocab, 0);
  int accepted = 0;
  for (int t = 0; t < kTrials; ++t) {
    TargetRequest r = Request(kPrompt, 4);
    r.sampling = sp;
    r.sampling.seed = 1000 + t;
    auto s = TargetSession::Create(target_.get(), r);
    ASSERT_TRUE(s.ok()) << s.status();
    const DraftToken d{SampleFrom(q, &draft_rng), q};
    absl::StatusOr<RoundResult> round = (*s)->Step(absl::MakeConstSpan(&d, 1));
    ASSERT_TRUE(round.ok()) << round.status();
    ASSERT_EQ(round->tokens.size(), 1u + round->num_accepted);
    ++counts[round->tokens[0]];
    accepted += round->num_accepted;
    if (t < 20) {
      // Seeded: the same request and drafts emit the same tokens.
      auto again = TargetSession::Create(target_.get(), r);
      ASSERT_TRUE(again.ok());
      absl::StatusOr<RoundResult> r2 =
          (*again)->Step(absl::MakeConstSpan(&d, 1));
      ASSERT_TRUE(r2.ok());
      EXPECT_EQ(r2->tokens, round->tokens);
    }
  }
  std::vector<double> pd(vocab, 0.0);
  for (auto [id, prob] : p) pd[id] = prob;
  const ChiSquareResult chi = ChiSquareTest(counts, pd);
  EXPECT_GT(chi.p_value, 1e-3) << "chi2 " << chi.statistic << " dof "
                               << chi.dof;
  EXPECT_GE(chi.dof, 5);
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, kTrials);
}

TEST_F(TargetSessionTest, StopConditionsCutTheRound) {
  const auto want = GreedyReference(*target_, kPrompt, {}, kPrompt.size(), 12);
  auto r = Request(kPrompt, 5);
  auto s = TargetSession::Create(target_.get(), r);
  ASSERT_TRUE(s.ok());
  std::vector<DraftToken> d;
  for (int j = 0; j < 10; ++j) d.push_back({want[j], {}});
  auto round = (*s)->Step(d);
  ASSERT_TRUE(round.ok());
  EXPECT_EQ(round->num_drafts, 4);  // clipped to the budget
  EXPECT_EQ(round->tokens, std::vector<int>(want.begin(), want.begin() + 5));
  EXPECT_EQ(round->finish, FinishReason::kLength);
  EXPECT_EQ((*s)->Step({}).status().code(),
            absl::StatusCode::kFailedPrecondition);

  auto r2 = Request(kPrompt, 20);
  r2.stop.stop_token_ids = {want[3]};
  auto s2 = TargetSession::Create(target_.get(), r2);
  ASSERT_TRUE(s2.ok());
  while (!(*s2)->finished()) ASSERT_TRUE((*s2)->Step(d).ok());
  EXPECT_EQ((*s2)->finish_reason(), FinishReason::kStopToken);
  EXPECT_EQ((*s2)->output(), std::vector<int>(want.begin(), want.begin() + 3));
}

TEST_F(TargetSessionTest, BadInputTable) {
  auto code = [&](TargetRequest r) {
    return TargetSession::Create(target_.get(), std::move(r)).status().code();
  };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  TargetRequest r = Request({1, 5, 9}, 4);
  EXPECT_TRUE(TargetSession::Create(target_.get(), r).ok());
  r.position_ids = {0, 2, 2};
  EXPECT_EQ(code(r), kInvalid);  // not strictly increasing
  r.position_ids = {0, 5, 512};
  EXPECT_EQ(code(r), kInvalid);  // at max context
  r.position_ids = {0, 5, 9};
  r.next_position = 9;
  EXPECT_EQ(code(r), kInvalid);  // next position <= last
  r.next_position = 512;
  EXPECT_EQ(code(r), kInvalid);  // next position at max context
  r.next_position = -1;
  r.token_ids = {1, 5, 512};
  EXPECT_EQ(code(r), kInvalid);  // outside the vocabulary
  r.token_ids = {1, 5};
  EXPECT_EQ(code(r), kInvalid);  // length mismatch
  r = Request({1, 5, 9}, 0);
  EXPECT_EQ(code(r), kInvalid);
  r = Request({1, 5, 9}, 4);
  r.sampling.temperature = -1;
  EXPECT_EQ(code(r), kInvalid);
  r.sampling.temperature = 1;
  r.sampling.top_p = 1.5f;
  EXPECT_EQ(code(r), kInvalid);

  r = Request({1, 5, 9}, 4);
  r.sampling.temperature = 1;
  auto s = TargetSession::Create(target_.get(), r);
  ASSERT_TRUE(s.ok());
  std::vector<DraftToken> too_many(65, DraftToken{5, {{5, 1.f}}});
  EXPECT_EQ((*s)->Step(too_many).status().code(), kInvalid);
  std::vector<DraftToken> bad_q = {{5, {{5, 0.5f}}}};  // sums to 0.5
  EXPECT_EQ((*s)->Step(bad_q).status().code(), kInvalid);
  bad_q = {{5, {{5, 1.5f}, {6, -0.5f}}}};
  EXPECT_EQ((*s)->Step(bad_q).status().code(), kInvalid);
  bad_q = {{5, {{600, 1.f}}}};
  EXPECT_EQ((*s)->Step(bad_q).status().code(), kInvalid);
  EXPECT_TRUE((*s)->Step({{5, {{5, 1.f}}}}).ok());
}

// ---- logprobs ----

// The raw logits after `context` (kept prompt tokens at `positions`, then
// the generated tokens at next_position + i), from a fresh sequence.
std::vector<float> ContextLogits(ModelRunner& m, const std::vector<int>& prompt,
                                 const std::vector<int>& positions,
                                 int next_position,
                                 const std::vector<int>& generated) {
  std::vector<int> tokens = prompt, pos = positions;
  for (size_t i = 0; i < generated.size(); ++i) {
    tokens.push_back(generated[i]);
    pos.push_back(next_position + static_cast<int>(i));
  }
  auto cache = *m.NewSequence(static_cast<int>(tokens.size()) + 1);
  ForwardInput in;
  in.token_ids = tokens;
  in.position_ids = pos;
  ForwardOutput out;
  EXPECT_TRUE(m.Forward(in, cache.get(), &out).ok());
  return out.logits;
}

// Independent log-softmax in long double.
std::vector<double> LogSoftmax(const std::vector<float>& logits) {
  long double max = logits[0];
  for (float x : logits) max = std::max<long double>(max, x);
  long double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<long double>(x) - max);
  std::vector<double> out;
  for (float x : logits) {
    out.push_back(static_cast<double>(x - max - std::log(sum)));
  }
  return out;
}

// Every emitted token's logprob and top list equal the log-softmax of the
// target's raw logits at the position that produced it.
void ExpectRawLogprobs(ModelRunner& m, const TargetRequest& r,
                       const std::vector<int>& tokens,
                       const std::vector<TokenLogprobs>& logprobs) {
  ASSERT_EQ(logprobs.size(), tokens.size());
  const int next = r.next_position >= 0 ? r.next_position
                                        : r.position_ids.back() + 1;
  for (size_t i = 0; i < tokens.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("token ", i));
    const std::vector<double> ref = LogSoftmax(ContextLogits(
        m, r.token_ids, r.position_ids, next,
        std::vector<int>(tokens.begin(), tokens.begin() + i)));
    double total = 0.0;
    for (double l : ref) total += std::exp(l);
    EXPECT_NEAR(total, 1.0, 1e-6);
    EXPECT_NEAR(logprobs[i].logprob, ref[tokens[i]], 1e-4);
    EXPECT_LE(logprobs[i].logprob, 0.f);
    ASSERT_EQ(logprobs[i].top.size(), static_cast<size_t>(r.top_logprobs));
    std::vector<int> order(ref.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return ref[a] > ref[b]; });
    for (int j = 0; j < r.top_logprobs; ++j) {
      const auto [id, lp] = logprobs[i].top[j];
      EXPECT_NEAR(lp, ref[id], 1e-4);
      EXPECT_NEAR(lp, ref[order[j]], 1e-4);  // the j-th largest
      if (j > 0) {
        EXPECT_LE(lp, logprobs[i].top[j - 1].second);
      }
      if (id == tokens[i]) {
        EXPECT_FLOAT_EQ(lp, logprobs[i].logprob);
      }
    }
  }
}

struct Generated {
  std::vector<int> tokens;
  std::vector<TokenLogprobs> logprobs;
};

// Runs `r` to the end; `drafts_for` proposes each round's drafts (and tree
// parents) from the tokens so far.
Generated RunSession(
    ModelRunner* m, const TargetRequest& r,
    const std::function<void(const std::vector<int>&, std::vector<DraftToken>*,
                             std::vector<int>*)>& drafts_for) {
  Generated g;
  auto s = TargetSession::Create(m, r);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return g;
  while (!(*s)->finished()) {
    std::vector<DraftToken> drafts;
    std::vector<int> parents;
    if (drafts_for) drafts_for(g.tokens, &drafts, &parents);
    auto round = (*s)->Step(drafts, parents);
    EXPECT_TRUE(round.ok()) << round.status();
    if (!round.ok()) break;
    EXPECT_EQ(round->logprobs.size(), r.logprobs ? round->tokens.size() : 0u);
    g.tokens.insert(g.tokens.end(), round->tokens.begin(), round->tokens.end());
    g.logprobs.insert(g.logprobs.end(), round->logprobs.begin(),
                      round->logprobs.end());
  }
  return g;
}

// Greedy, plain decoding, full and pruned prompts (Speculative Prefill's
// original positions): the raw log-softmax of the producing rows, and the
// same tokens as without logprobs.
TEST_F(TargetSessionTest, LogprobsAreTheRawLogSoftmax) {
  std::vector<int> pruned(kPrompt.size());
  for (size_t i = 0; i < pruned.size(); ++i) pruned[i] = 3 * i + (i > 4 ? 7 : 0);
  for (const std::vector<int>& positions : {std::vector<int>{}, pruned}) {
    TargetRequest r = Request(kPrompt, 12);
    if (!positions.empty()) {
      r.position_ids = positions;
      r.next_position = positions.back() + 5;
    }
    const Generated off = RunSession(target_.get(), r, nullptr);
    r.logprobs = true;
    r.top_logprobs = 5;
    const Generated on = RunSession(target_.get(), r, nullptr);
    EXPECT_EQ(on.tokens, off.tokens);
    EXPECT_TRUE(off.logprobs.empty());
    ExpectRawLogprobs(*target_, r, on.tokens, on.logprobs);
    // Greedy: the token is the top alternative.
    for (size_t i = 0; i < on.tokens.size(); ++i) {
      EXPECT_EQ(on.logprobs[i].top[0].first, on.tokens[i]);
    }
  }
}

// Greedy with speculative decoding (random chains, random trees) gives the
// same tokens AND logprobs as without.
TEST_F(TargetSessionTest, GreedyLogprobsWithDraftsEqualPlain) {
  const int kNew = 40;
  TargetRequest r = Request(kPrompt, kNew);
  r.logprobs = true;
  r.top_logprobs = 20;
  const Generated plain = RunSession(target_.get(), r, nullptr);
  ASSERT_EQ(plain.tokens.size(), static_cast<size_t>(kNew));
  const int vocab = target_->config().vocab_size;
  std::mt19937 rng(5);
  auto chain = [&](const std::vector<int>& got, std::vector<DraftToken>* d,
                   std::vector<int>*) {
    const int k = rng() % 9;
    for (int j = 0; j < k; ++j) {
      const size_t at = got.size() + j;
      d->push_back({(rng() % 3 != 0 && at < plain.tokens.size())
                        ? plain.tokens[at]
                        : static_cast<int>(rng() % vocab),
                    {}});
    }
  };
  auto tree = [&](const std::vector<int>& got, std::vector<DraftToken>* d,
                  std::vector<int>* p) {
    RandomTree(plain.tokens, got.size(), static_cast<int>(rng() % 20), vocab,
               &rng, d, p);
  };
  for (const auto& drafts : {std::function<void(const std::vector<int>&,
                                                std::vector<DraftToken>*,
                                                std::vector<int>*)>(chain),
                             std::function<void(const std::vector<int>&,
                                                std::vector<DraftToken>*,
                                                std::vector<int>*)>(tree)}) {
    const Generated spec = RunSession(target_.get(), r, drafts);
    ASSERT_EQ(spec.tokens, plain.tokens);
    ASSERT_EQ(spec.logprobs.size(), plain.logprobs.size());
    for (size_t i = 0; i < spec.logprobs.size(); ++i) {
      EXPECT_NEAR(spec.logprobs[i].logprob, plain.logprobs[i].logprob, 1e-4);
      ASSERT_EQ(spec.logprobs[i].top.size(), 20u);
      for (int j = 0; j < 20; ++j) {
        EXPECT_EQ(spec.logprobs[i].top[j].first, plain.logprobs[i].top[j].first);
        EXPECT_NEAR(spec.logprobs[i].top[j].second,
                    plain.logprobs[i].top[j].second, 1e-4);
      }
    }
  }
}

// Sampled: logprobs reduce the rows on the host with the same uniforms, so
// a seeded request emits the same tokens with or without them (chain
// drafts and trees); the values are the RAW distribution's, not the
// temperature / top-k one the tokens were drawn from.
TEST_F(TargetSessionTest, SampledLogprobsKeepTheTokensAndAreRaw) {
  const int vocab = target_->config().vocab_size;
  for (bool use_tree : {false, true}) {
    SCOPED_TRACE(use_tree ? "tree" : "chain");
    TargetRequest r = Request(kPrompt, 16);
    r.sampling.temperature = 0.7f;
    r.sampling.top_k = 12;
    r.sampling.seed = 42;
    std::mt19937 rng(3);
    auto drafts = [&](const std::vector<int>& got, std::vector<DraftToken>* d,
                      std::vector<int>* p) {
      const int k = rng() % 6;
      for (int j = 0; j < k; ++j) {
        const int id = static_cast<int>(rng() % vocab);
        d->push_back({id, {{id, 1.f}}});
        if (use_tree) p->push_back(static_cast<int>(rng() % (j + 1)) - 1);
      }
    };
    const Generated off = RunSession(target_.get(), r, drafts);
    rng.seed(3);
    r.logprobs = true;
    r.top_logprobs = 3;
    const Generated on = RunSession(target_.get(), r, drafts);
    EXPECT_EQ(on.tokens, off.tokens);
    ExpectRawLogprobs(*target_, r, on.tokens, on.logprobs);
  }
}

TEST_F(TargetSessionTest, BadLogprobsAreRejected) {
  TargetRequest r = Request({1, 5, 9}, 4);
  r.logprobs = true;
  for (int top : {-1, 21, 1000}) {
    r.top_logprobs = top;
    EXPECT_EQ(TargetSession::Create(target_.get(), r).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  r.top_logprobs = 20;
  EXPECT_TRUE(TargetSession::Create(target_.get(), r).ok());
  r.logprobs = false;
  EXPECT_EQ(TargetSession::Create(target_.get(), r).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Prompt logprobs (vLLM's prompt_logprobs): each prompt token after the
// first gets ComputeTokenLogprobs of the row before it in a plain full
// prefill, whatever the chunking, with a preemption in the middle of the
// collection, and although the prefix cache holds the prompt (bypassed:
// cached rows have no logits). The tokens are those of the same request
// without them; only the first round carries them.
TEST_F(TargetSessionTest, PromptLogprobsAreTeacherForcedPrefillRows) {
  auto runner = testing_util::MakePrefixCachingRunner(target_w_, 8);
  ASSERT_NE(runner, nullptr);
  ModelRunner& m = *runner;
  const int vocab = m.config().vocab_size, kTop = 3, kNew = 10;
  std::mt19937 rng(21);
  std::vector<int> prompt = {1};
  for (int i = 1; i < 60; ++i) prompt.push_back(3 + rng() % 500);
  const int n = static_cast<int>(prompt.size());
  std::vector<float> rows;  // [n, vocab]: every prompt row's logits
  {
    auto kv = *m.NewSequence(64);
    ForwardInput in;
    in.token_ids = prompt;
    std::vector<int> pos(n);
    std::iota(pos.begin(), pos.end(), 0);
    in.position_ids = pos;
    for (int r = 0; r < n; ++r) in.logit_rows.push_back(r);
    ForwardOutput out;
    ASSERT_TRUE(m.Forward(in, kv.get(), &out).ok());
    rows = out.logits;
  }
  // The same request without prompt logprobs, which also fills the
  // prefix cache with the prompt's blocks.
  std::vector<int> plain;
  {
    auto s = TargetSession::Create(&m, Request(prompt, kNew));
    ASSERT_TRUE(s.ok()) << s.status();
    while (!(*s)->finished()) ASSERT_TRUE((*s)->Step({}).ok());
    plain = (*s)->output();
  }
  TargetRequest r = Request(prompt, kNew);
  r.prompt_logprobs = kTop;
  auto s = TargetSession::Create(&m, r);
  ASSERT_TRUE(s.ok()) << s.status();
  std::vector<int> got;
  int round_no = 0, prompt_chunks = 0;
  while (!(*s)->finished()) {
    std::vector<DraftToken> drafts(rng() % 4);
    for (auto& d : drafts) d.id = 3 + rng() % 500;
    ASSERT_TRUE((*s)->BeginRound(drafts).ok());
    int forwards = 0;
    while (!(*s)->round_complete()) {
      if (round_no == 0 && forwards == 3) (*s)->Preempt();
      const int budget = std::max((*s)->min_forward_rows(),
                                  static_cast<int>(rng() % 24) + 1);
      SequenceForward entry;
      ASSERT_TRUE((*s)->PlanForward(budget, &entry).ok());
      if (!entry.input.logprob_ids.empty()) ++prompt_chunks;
      std::vector<ForwardOutput> outs;
      ASSERT_TRUE(m.Forward(absl::MakeConstSpan(&entry, 1), &outs).ok());
      ASSERT_TRUE((*s)->CompleteForward(outs[0]).ok());
      ++forwards;
    }
    auto round = (*s)->TakeRoundResult();
    ASSERT_TRUE(round.ok());
    if (round_no == 0) {
      ASSERT_EQ(round->prompt_logprobs.size(), static_cast<size_t>(n - 1));
      for (int i = 0; i + 1 < n; ++i) {
        const TokenLogprobs want = ComputeTokenLogprobs(
            absl::MakeConstSpan(rows.data() + static_cast<size_t>(i) * vocab,
                                vocab),
            prompt[i + 1], kTop);
        const TokenLogprobs& lp = round->prompt_logprobs[i];
        EXPECT_NEAR(lp.logprob, want.logprob, 1e-4) << "token " << i + 1;
        ASSERT_EQ(lp.top.size(), static_cast<size_t>(kTop));
        for (int t = 0; t < kTop; ++t) {
          EXPECT_EQ(lp.top[t].first, want.top[t].first) << i << " " << t;
          EXPECT_NEAR(lp.top[t].second, want.top[t].second, 1e-4);
        }
      }
    } else {
      EXPECT_TRUE(round->prompt_logprobs.empty()) << round_no;
    }
    got.insert(got.end(), round->tokens.begin(), round->tokens.end());
    ++round_no;
  }
  EXPECT_GT(prompt_chunks, 3);
  EXPECT_EQ((*s)->cached_prompt_tokens(), 0);
  EXPECT_EQ(got, plain);
}

TEST_F(TargetSessionTest, BadPromptLogprobsAreRejected) {
  TargetRequest r = Request({1, 5, 9, 12}, 4);
  for (int top : {-2, 21}) {
    r.prompt_logprobs = top;
    const auto s = TargetSession::Create(target_.get(), r);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << top;
    EXPECT_NE(s.status().message().find("prompt_logprobs"), std::string::npos);
  }
  r.prompt_logprobs = 0;
  EXPECT_TRUE(TargetSession::Create(target_.get(), r).ok());
  // A pruned prompt (Speculative Prefill's): no row before a dropped token.
  TargetRequest pruned = r;
  pruned.position_ids = {0, 1, 3, 4};
  pruned.next_position = 5;
  EXPECT_EQ(TargetSession::Create(target_.get(), pruned).status().code(),
            absl::StatusCode::kInvalidArgument);
  TargetRequest tail = r;
  tail.next_position = 9;
  EXPECT_EQ(TargetSession::Create(target_.get(), tail).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A one-token prompt has no prompt logprobs to give.
  TargetRequest one = Request({1}, 2);
  one.prompt_logprobs = 2;
  auto s = TargetSession::Create(target_.get(), one);
  ASSERT_TRUE(s.ok());
  auto round = (*s)->Step({});
  ASSERT_TRUE(round.ok());
  EXPECT_TRUE(round->prompt_logprobs.empty());
}

// ---- penalties ----

// The logit bias, then presence / frequency / repetition penalties as vLLM
// defines them, written out here independently of logits_processors.h:
// `logits` after `prompt` (ids the repetition penalty covers) and `output`.
std::vector<float> PenalizedByHand(std::vector<float> logits,
                                   const std::vector<int>& prompt,
                                   const std::vector<int>& output,
                                   const SamplingParams& sp) {
  for (const auto& [id, bias] : sp.logit_bias) logits[id] += bias;
  std::map<int, int> count;
  for (int id : output) ++count[id];
  for (int id = 0; id < static_cast<int>(logits.size()); ++id) {
    const bool in_prompt =
        std::find(prompt.begin(), prompt.end(), id) != prompt.end();
    const int c = count.count(id) ? count[id] : 0;
    float x = logits[id];
    if (in_prompt || c > 0) {
      x = x > 0 ? x / sp.repetition_penalty : x * sp.repetition_penalty;
    }
    if (c > 0) x -= sp.frequency_penalty * c + sp.presence_penalty;
    logits[id] = x;
  }
  return logits;
}

// Greedy decoding of `r`, one fresh forward per token, up to n tokens or
// before the first EOS (unless ignore_eos), each row's logits first passed
// through adjust(row, output so far).
std::vector<int> AdjustedGreedyReference(
    ModelRunner& m, const TargetRequest& r, int n,
    const std::function<void(std::vector<float>*, const std::vector<int>&)>&
        adjust) {
  const int next = r.next_position >= 0 ? r.next_position
                                        : r.position_ids.back() + 1;
  std::vector<int> out;
  const std::vector<int>& eos = m.config().eos_token_ids;
  // One sequence, one row per token (the prompt's logits first).
  auto cache = *m.NewSequence(static_cast<int>(r.token_ids.size()) + n + 1);
  ForwardInput in;
  in.token_ids = r.token_ids;
  in.position_ids = r.position_ids;
  ForwardOutput fwd;
  EXPECT_TRUE(m.Forward(in, cache.get(), &fwd).ok());
  for (int i = 0; i < n; ++i) {
    std::vector<float> row = fwd.logits;
    adjust(&row, out);
    const int id = static_cast<int>(
        std::max_element(row.begin(), row.end()) - row.begin());
    // The session ends at EOS without emitting it.
    if (!r.ignore_eos && std::find(eos.begin(), eos.end(), id) != eos.end()) {
      break;
    }
    out.push_back(id);
    const int pos = next + i;
    ForwardInput step;
    step.token_ids = absl::MakeConstSpan(&out.back(), 1);
    step.position_ids = absl::MakeConstSpan(&pos, 1);
    EXPECT_TRUE(m.Forward(step, cache.get(), &fwd).ok());
  }
  return out;
}

// Greedy decoding of `r` with its logit bias and penalties, and its EOS
// ids masked before min_new_tokens.
std::vector<int> PenalizedGreedyReference(ModelRunner& m,
                                          const TargetRequest& r, int n) {
  const std::vector<int>& prompt =
      r.penalty_prompt_ids.empty() ? r.token_ids : r.penalty_prompt_ids;
  const std::vector<int>& eos = m.config().eos_token_ids;
  return AdjustedGreedyReference(
      m, r, n, [&](std::vector<float>* row, const std::vector<int>& out) {
        *row = PenalizedByHand(*row, prompt, out, r.sampling);
        if (static_cast<int>(out.size()) < r.stop.min_new_tokens) {
          for (int id : eos) (*row)[id] = -INFINITY;
        }
      });
}

// Greedy with penalties: plain rounds, random chain drafts and random trees
// all emit the tokens of penalized greedy decoding, for a full prompt, a
// pruned one, and a pruned one whose penalties read the whole prompt;
// logprobs stay the raw distribution's.
TEST_F(TargetSessionTest, PenalizedGreedyRoundsEqualPenalizedDecoding) {
  const int kNew = 32;
  const int vocab = target_->config().vocab_size;
  std::vector<int> pruned(kPrompt.size());
  for (size_t i = 0; i < pruned.size(); ++i) {
    pruned[i] = 2 * i + (i > 4 ? 5 : 0);
  }
  // The whole prompt a router pruned to kPrompt: ids kPrompt lacks too.
  std::vector<int> whole = kPrompt;
  for (int id : {300, 301, 302, 303, 304, 305, 306, 307}) whole.push_back(id);
  struct Case {
    std::vector<int> positions;  // empty = 0..n-1
    std::vector<int> penalty_prompt;
  };
  const std::vector<Case> cases = {{{}, {}}, {pruned, {}}, {pruned, whole}};
  std::mt19937 rng(23);
  std::vector<std::vector<int>> wants;
  for (const Case& c : cases) {
    TargetRequest r = Request(kPrompt, kNew);
    if (!c.positions.empty()) {
      r.position_ids = c.positions;
      r.next_position = c.positions.back() + 9;
    }
    r.penalty_prompt_ids = c.penalty_prompt;
    r.ignore_eos = true;
    r.sampling.presence_penalty = 0.6f;
    r.sampling.frequency_penalty = 0.4f;
    r.sampling.repetition_penalty = 1.3f;
    const std::vector<int> want = PenalizedGreedyReference(*target_, r, kNew);
    // The penalties change what greedy decoding emits.
    EXPECT_NE(want, GreedyReference(*target_, kPrompt, r.position_ids,
                                    r.next_position < 0
                                        ? static_cast<int>(kPrompt.size())
                                        : r.next_position,
                                    kNew));
    wants.push_back(want);
    auto chain = [&](const std::vector<int>& got, std::vector<DraftToken>* d,
                     std::vector<int>*) {
      const int k = rng() % 9;
      for (int j = 0; j < k; ++j) {
        const size_t at = got.size() + j;
        d->push_back({(rng() % 4 != 0 && at < want.size())
                          ? want[at]
                          : static_cast<int>(rng() % vocab),
                      {}});
      }
    };
    auto tree = [&](const std::vector<int>& got, std::vector<DraftToken>* d,
                    std::vector<int>* p) {
      RandomTree(want, got.size(), static_cast<int>(rng() % 20), vocab, &rng,
                 d, p);
    };
    EXPECT_EQ(RunSession(target_.get(), r, nullptr).tokens, want);
    EXPECT_EQ(RunSession(target_.get(), r, chain).tokens, want);
    r.logprobs = true;
    r.top_logprobs = 3;
    const Generated spec = RunSession(target_.get(), r, tree);
    EXPECT_EQ(spec.tokens, want);
    ExpectRawLogprobs(*target_, r, spec.tokens, spec.logprobs);
  }
  // Reading the whole prompt penalizes what pruning dropped.
  EXPECT_NE(wants[1], wants[2]);
}

// Sampled with penalties: a round with one draft x emits its first token
// from the penalized p0 (the prompt's ids under the repetition penalty) and,
// once x is accepted, its second from p1 penalized with x counted as
// output, though x was never emitted before the round.
TEST_F(TargetSessionTest, PenalizedSampledRoundsMatchPenalizedTarget) {
  SamplingParams sp;
  sp.temperature = 3.0f;  // a flat p1 gives the chi-square cells
  sp.top_k = 12;
  sp.presence_penalty = 1.5f;
  sp.frequency_penalty = 0.5f;
  sp.repetition_penalty = 1.2f;
  const int vocab = target_->config().vocab_size;
  const int n = static_cast<int>(kPrompt.size());
  std::vector<int> pos(n);
  std::iota(pos.begin(), pos.end(), 0);
  const SparseDist p0 = ComputeDistribution(
      PenalizedByHand(ContextLogits(*target_, kPrompt, pos, n, {}), kPrompt,
                      {}, sp),
      sp);
  // The draft x: the one whose counting changes p1 most, weighted by how
  // often it is accepted (p0(x)). p1_wrong forgets to count it.
  int x = -1;
  double px = 0, best = -1;
  SparseDist p1, p1_wrong;
  for (auto [id, prob] : p0) {
    const std::vector<float> raw =
        ContextLogits(*target_, kPrompt, pos, n, {id});
    const SparseDist with =
        ComputeDistribution(PenalizedByHand(raw, kPrompt, {id}, sp), sp);
    const SparseDist without =
        ComputeDistribution(PenalizedByHand(raw, kPrompt, {}, sp), sp);
    double tv = 0;
    for (int v = 0; v < vocab; ++v) {
      tv += std::abs(ProbabilityOf(with, v) - ProbabilityOf(without, v)) / 2;
    }
    if (prob * tv > best) {
      best = prob * tv;
      x = id;
      px = prob;
      p1 = with;
      p1_wrong = without;
    }
  }
  ASSERT_GT(px, 0.1);
  const int kTrials = 3000;
  std::vector<int64_t> second(vocab, 0);
  int accepted = 0;
  for (int t = 0; t < kTrials; ++t) {
    TargetRequest r = Request(kPrompt, 4);
    r.sampling = sp;
    r.sampling.seed = 5000 + t;
    auto s = TargetSession::Create(target_.get(), r);
    ASSERT_TRUE(s.ok()) << s.status();
    const DraftToken d{x, {{x, 1.f}}};
    absl::StatusOr<RoundResult> round = (*s)->Step(absl::MakeConstSpan(&d, 1));
    ASSERT_TRUE(round.ok()) << round.status();
    ASSERT_EQ(round->tokens.size(), 1u + round->num_accepted);
    if (round->num_accepted == 1) {
      ++accepted;
      ++second[round->tokens[1]];
    }
  }
  // A point-mass draft is accepted with probability p0(x).
  EXPECT_NEAR(static_cast<double>(accepted) / kTrials, px,
              4 * std::sqrt(px * (1 - px) / kTrials));
  std::vector<double> pd(vocab, 0.0);
  for (auto [id, prob] : p1) pd[id] = prob;
  const ChiSquareResult chi = ChiSquareTest(second, pd);
  EXPECT_GT(chi.p_value, 1e-3) << "chi2 " << chi.statistic << " dof "
                               << chi.dof;
  EXPECT_GE(chi.dof, 5);
  // The test tells the two apart: x's own count matters at row 1.
  std::vector<double> wrong(vocab, 0.0);
  for (auto [id, prob] : p1_wrong) wrong[id] = prob;
  EXPECT_LT(ChiSquareTest(second, wrong).p_value, 1e-3);
}

// Random chain drafts (some the reference's tokens, some EOS, some random)
// and random trees for a request's next rounds.
struct RandomDrafts {
  std::vector<int> want;
  int vocab;
  int eos;
  std::mt19937 rng{29};
  void Chain(const std::vector<int>& got, std::vector<DraftToken>* d,
             std::vector<int>*) {
    const int k = rng() % 9;
    for (int j = 0; j < k; ++j) {
      const size_t at = got.size() + j;
      const int pick = rng() % 6;
      int id = static_cast<int>(rng() % vocab);
      if (pick < 4 && at < want.size()) id = want[at];
      if (pick == 4) id = eos;
      d->push_back({id, {}});
    }
  }
  void Tree(const std::vector<int>& got, std::vector<DraftToken>* d,
            std::vector<int>* p) {
    RandomTree(want, got.size(), static_cast<int>(rng() % 20), vocab, &rng, d,
               p);
  }
};

// `r` run with no drafts, random chains and random trees emits
// drafts->want each time.
void ExpectEveryDraftingEmits(ModelRunner* m, const TargetRequest& r,
                              RandomDrafts* drafts) {
  const auto chain = [&](auto& g, auto* d, auto* p) {
    drafts->Chain(g, d, p);
  };
  const auto tree = [&](auto& g, auto* d, auto* p) { drafts->Tree(g, d, p); };
  EXPECT_EQ(RunSession(m, r, nullptr).tokens, drafts->want);
  EXPECT_EQ(RunSession(m, r, chain).tokens, drafts->want);
  EXPECT_EQ(RunSession(m, r, tree).tokens, drafts->want);
}

// OpenAI's logit_bias: greedy rounds, with chain drafts and trees, emit
// the tokens of greedy decoding of the biased logits; -100 bans the plain
// output's first token.
TEST_F(TargetSessionTest, LogitBiasRoundsEqualBiasedDecoding) {
  const int kNew = 24;
  TargetRequest r = Request(kPrompt, kNew);
  r.ignore_eos = true;
  const std::vector<int> plain = RunSession(target_.get(), r, nullptr).tokens;
  ASSERT_EQ(plain.size(), static_cast<size_t>(kNew));
  std::map<int, float> bias = {{300, 4.f}, {plain[3], 2.5f}};
  bias[plain[0]] = -100.f;
  r.sampling.logit_bias.assign(bias.begin(), bias.end());  // ids ascending
  const std::vector<int> want = PenalizedGreedyReference(*target_, r, kNew);
  EXPECT_NE(want[0], plain[0]);
  EXPECT_EQ(std::count(want.begin(), want.end(), plain[0]), 0);
  RandomDrafts drafts{want, target_->config().vocab_size, 2};
  ExpectEveryDraftingEmits(target_.get(), r, &drafts);
  r.sampling.logit_bias = {{target_->config().vocab_size, 1.f}};
  EXPECT_EQ(TargetSession::Create(target_.get(), r).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// vLLM's min_tokens: EOS is masked until min_new_tokens tokens are out, in
// plain rounds, chains (with EOS drafts, which must be rejected) and
// trees; after that the request ends at EOS as before.
TEST_F(TargetSessionTest, MinTokensMasksEosUntilReached) {
  // tinystories-656K ends this story (EOS after 372 tokens; the session
  // does not emit the EOS).
  auto big_w = LoadBundled("tinystories-656K");
  ASSERT_NE(big_w, nullptr);
  auto big = testing_util::MakeCpuRunner(big_w);
  const std::vector<int>& eos = big->config().eos_token_ids;
  ASSERT_FALSE(eos.empty());
  TargetRequest r = Request({1, 403, 407, 261}, 420);
  const std::vector<int> plain = RunSession(big.get(), r, nullptr).tokens;
  ASSERT_LT(plain.size(), 400u) << "the plain story never ends";
  EXPECT_EQ(plain, PenalizedGreedyReference(*big, r, 420));
  r.stop.min_new_tokens = static_cast<int>(plain.size()) + 10;
  const std::vector<int> want = PenalizedGreedyReference(*big, r, 420);
  ASSERT_GE(want.size(), plain.size() + 10);
  // Up to where the plain output ended the two agree; there EOS is masked.
  EXPECT_TRUE(std::equal(plain.begin(), plain.end(), want.begin()));
  EXPECT_EQ(std::count(want.begin(), want.end(), eos[0]), 0);
  RandomDrafts drafts{want, big->config().vocab_size, eos[0]};
  ExpectEveryDraftingEmits(big.get(), r, &drafts);
  r.stop.min_new_tokens = 421;
  EXPECT_EQ(TargetSession::Create(big.get(), r).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A stop id is masked the same way: min_new_tokens past the first place
  // the plain output emits it.
  TargetRequest s = Request(kPrompt, 40);
  s.ignore_eos = true;
  const std::vector<int> free_run =
      RunSession(target_.get(), s, nullptr).tokens;
  const int stop_id = free_run[5];
  s.stop.stop_token_ids = {stop_id};
  s.stop.min_new_tokens = 20;
  const std::vector<int> got = RunSession(target_.get(), s, nullptr).tokens;
  ASSERT_GE(got.size(), 20u);
  EXPECT_EQ(std::count(got.begin(), got.begin() + 19, stop_id), 0);
  // Sampled: never an EOS before min_new_tokens.
  for (int seed = 0; seed < 20; ++seed) {
    TargetRequest t = Request(kPrompt, 40);
    t.sampling.temperature = 1.5f;
    t.sampling.seed = seed;
    t.stop.min_new_tokens = 30;
    const std::vector<int> out =
        RunSession(big.get(), t, [&](auto& g, auto* d, auto* p) {
          drafts.Chain(g, d, p);
          for (DraftToken& x : *d) x.q = {{x.id, 1.f}};
        }).tokens;
    ASSERT_GE(out.size(), 30u);
    for (int i = 0; i < 29; ++i) EXPECT_NE(out[i], eos[0]) << i;
  }
}

// JSON mode: masked greedy decoding written out here, independent of
// JsonTokenMask (every id's bytes tried on a JsonMatcher; EOS once the
// object is complete, or when nothing else is left).
std::vector<int> JsonGreedyReference(ModelRunner& m, const TargetRequest& r,
                                     const TokenByteTable& table, int n) {
  const std::vector<int>& eos = m.config().eos_token_ids;
  const int vocab = m.config().vocab_size;
  return AdjustedGreedyReference(m, r, n, [&](std::vector<float>* row_ptr,
                                              const std::vector<int>& out) {
    std::vector<float>& row = *row_ptr;
    JsonMatcher json(r.sampling.json_schema.get());
    for (int id : out) EXPECT_TRUE(json.Advance(table.bytes[id]));
    ApplyLogitBias(r.sampling, absl::MakeSpan(row));
    bool any = false;
    for (int id = 0; id < vocab; ++id) {
      JsonMatcher next = json;
      const bool is_eos = std::find(eos.begin(), eos.end(), id) != eos.end();
      const bool ok = !is_eos && !json.complete() &&
                      id < static_cast<int>(table.bytes.size()) &&
                      !table.special[id] && next.Advance(table.bytes[id]);
      any |= ok;
      if (!ok && !is_eos) row[id] = -INFINITY;
    }
    if (any) {
      for (int id : eos) row[id] = -INFINITY;
    }
  });
}

// JSON mode (response_format json_object): greedy rounds with no drafts,
// random chains (EOS and invalid ids among them) and random trees emit
// exactly masked greedy decoding; every output is a valid prefix of an
// object, and with a bias towards '"' and '}' the object closes and the
// request ends at EOS with text that parses as a JSON object. Sampled
// outputs stay valid prefixes too.
TEST_F(TargetSessionTest, JsonModeRoundsEqualMaskedGreedyDecoding) {
  // tinystories-656K's vocabulary has no '{' (and no byte pieces): refused.
  {
    auto w = LoadBundled("tinystories-656K");
    ASSERT_NE(w, nullptr);
    auto runner = testing_util::MakeCpuRunner(w);
    auto tok = LoadTokenizer("models/tinystories-656K");
    ASSERT_TRUE(tok.ok()) << tok.status();
    const JsonTokenMask braceless(*BuildTokenByteTable(**tok),
                                  runner->config().eos_token_ids);
    EXPECT_FALSE(braceless.can_open());
    TargetRequest r = Request({1, 403, 407, 261}, 40);
    r.sampling.json_object = true;
    r.json_mask = &braceless;
    const absl::Status st = TargetSession::Create(runner.get(), r).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("'{'"), std::string::npos) << st;
  }
  // stories260K's sentencepiece vocabulary has every byte.
  ModelRunner* big = target_.get();
  auto tok = LoadTokenizer("models/stories260K");
  ASSERT_TRUE(tok.ok()) << tok.status();
  absl::StatusOr<TokenByteTable> table = BuildTokenByteTable(**tok);
  ASSERT_TRUE(table.ok()) << table.status();
  const std::vector<int>& eos = big->config().eos_token_ids;
  ASSERT_FALSE(eos.empty());
  const JsonTokenMask mask(*table, eos);
  ASSERT_TRUE(mask.can_open());
  const auto text_of = [&](const std::vector<int>& ids) {
    std::string t;
    for (int id : ids) t += table->bytes[id];
    return t;
  };
  TargetRequest r = Request({1, 403, 407, 261}, 40);
  r.sampling.json_object = true;
  EXPECT_EQ(TargetSession::Create(big, r).status().code(),
            absl::StatusCode::kInvalidArgument);  // no mask: no tokenizer
  r.json_mask = &mask;
  const std::vector<int> want = JsonGreedyReference(*big, r, *table, 40);
  ASSERT_EQ(want.size(), 40u) << text_of(want);
  JsonMatcher m;
  EXPECT_TRUE(m.Advance(text_of(want))) << text_of(want);
  RandomDrafts drafts{want, big->config().vocab_size, eos[0]};
  ExpectEveryDraftingEmits(big, r, &drafts);

  // Nudged to close: '"' and '}' cheaper, ',' and whitespace dearer (this
  // story model loves newlines and long lists).
  for (int id = 0; id < static_cast<int>(table->bytes.size()); ++id) {
    const std::string& b = table->bytes[id];
    if (b == "\"") {
      r.sampling.logit_bias.push_back({id, 6.f});
    } else if (b == "}") {  // a byte piece, never seen in training
      r.sampling.logit_bias.push_back({id, 30.f});
    } else if (b == ",") {
      r.sampling.logit_bias.push_back({id, -10.f});
    } else if (!b.empty() &&
               b.find_first_not_of(" \n\t\r") == std::string::npos) {
      r.sampling.logit_bias.push_back({id, -20.f});
    }
  }
  ASSERT_FALSE(r.sampling.logit_bias.empty());
  r.stop.max_new_tokens = 60;
  const std::vector<int> closed = JsonGreedyReference(*big, r, *table, 60);
  ASSERT_LT(closed.size(), 60u) << text_of(closed) << [&] {
    std::string s;
    for (int id : closed) s += absl::StrCat(id, "[", table->bytes[id], "] ");
    return s;
  }();
  const nlohmann::json parsed =
      nlohmann::json::parse(text_of(closed), nullptr, false);
  EXPECT_TRUE(parsed.is_object()) << text_of(closed);
  RandomDrafts closing{closed, big->config().vocab_size, eos[0]};
  ExpectEveryDraftingEmits(big, r, &closing);
  auto s = TargetSession::Create(big, r);
  ASSERT_TRUE(s.ok());
  while (!(*s)->finished()) ASSERT_TRUE((*s)->Step({}, {}).ok());
  EXPECT_EQ((*s)->finish_reason(), FinishReason::kEos);
  // A closed object ends the output even before min_new_tokens: EOS is all
  // the grammar allows, and masking it too would leave no token at all.
  r.stop.min_new_tokens = 59;
  EXPECT_EQ(RunSession(big, r, nullptr).tokens, closed);
  r.stop.min_new_tokens = 0;

  // Sampled, with point-mass drafts of random ids: valid prefixes only.
  r.sampling.logit_bias.clear();
  r.sampling.temperature = 1.2f;
  r.stop.max_new_tokens = 30;
  for (int seed = 0; seed < 10; ++seed) {
    r.sampling.seed = seed;
    const std::vector<int> out =
        RunSession(big, r, [&](auto& g, auto* d, auto* p) {
          drafts.Chain(g, d, p);
          for (DraftToken& x : *d) x.q = {{x.id, 1.f}};
        }).tokens;
    JsonMatcher sm;
    EXPECT_TRUE(sm.Advance(text_of(out))) << seed << ": " << text_of(out);
  }
}

// JSON Schema (response_format json_schema): greedy rounds with no
// drafts, random chains and random trees emit exactly masked greedy
// decoding under the schema's matcher; every value of this schema is
// bounded, so the object closes, ends at EOS, and is an instance of the
// schema with its properties in order.
TEST_F(TargetSessionTest, JsonSchemaRoundsEqualMaskedGreedyDecoding) {
  ModelRunner* m = target_.get();
  auto tok = LoadTokenizer("models/stories260K");
  ASSERT_TRUE(tok.ok()) << tok.status();
  absl::StatusOr<TokenByteTable> table = BuildTokenByteTable(**tok);
  ASSERT_TRUE(table.ok()) << table.status();
  const std::vector<int>& eos = m->config().eos_token_ids;
  const JsonTokenMask mask(*table, eos);
  auto schema = JsonSchema::Compile(R"({"type": "object", "properties": {
      "mood": {"enum": ["happy", "sad"]},
      "name": {"type": "string", "maxLength": 6},
      "n": {"enum": [1, 2, 3]},
      "ok": {"type": "boolean"}},
    "required": ["mood", "name", "ok"]})");
  ASSERT_TRUE(schema.ok()) << schema.status();
  TargetRequest r = Request({1, 403, 407, 261}, 200);
  r.sampling.json_object = true;
  r.sampling.json_schema = *schema;
  r.json_mask = &mask;
  const std::vector<int> want = JsonGreedyReference(*m, r, *table, 200);
  std::string text;
  for (int id : want) text += table->bytes[id];
  ASSERT_LT(want.size(), 200u) << text;
  const nlohmann::ordered_json v =
      nlohmann::ordered_json::parse(text, nullptr, false);
  ASSERT_TRUE(v.is_object()) << text;
  EXPECT_TRUE(v["mood"] == "happy" || v["mood"] == "sad") << text;
  EXPECT_LE(v["name"].get<std::string>().size(), 6u) << text;
  EXPECT_TRUE(v["ok"].is_boolean()) << text;
  std::vector<std::string> keys;
  for (const auto& [k, x] : v.items()) keys.push_back(k);
  EXPECT_EQ(keys.front(), "mood") << text;
  EXPECT_EQ(keys.back(), "ok") << text;
  RandomDrafts drafts{want, m->config().vocab_size, eos[0]};
  ExpectEveryDraftingEmits(m, r, &drafts);
  auto s = TargetSession::Create(m, r);
  ASSERT_TRUE(s.ok());
  while (!(*s)->finished()) ASSERT_TRUE((*s)->Step({}, {}).ok());
  EXPECT_EQ((*s)->finish_reason(), FinishReason::kEos);
}

// min_p on a sampled request (the backend samples it, as top-k and top-p):
// the first token of a round with a draft is distributed as p after min_p
// (then top-k), and no emitted token, drafted or sampled, is ever below
// min_p times the likeliest at its position.
TEST_F(TargetSessionTest, MinPRoundsMatchTheMinPDistribution) {
  SamplingParams sp;
  sp.temperature = 1.5f;
  sp.top_k = 40;
  sp.min_p = 0.1f;
  const int vocab = target_->config().vocab_size;
  const std::vector<float> raw = PromptLastLogits(*target_);
  const SparseDist p = ComputeDistribution(raw, sp);
  SamplingParams no_min_p = sp;
  no_min_p.min_p = 0.f;
  const SparseDist wide = ComputeDistribution(raw, no_min_p);
  ASSERT_LT(p.size(), wide.size());  // min_p cuts something here
  const SparseDist q = ComputeDistribution(PromptLastLogits(*draft_), no_min_p);
  const int kTrials = 3000;
  Rng draft_rng(5);
  std::vector<int64_t> counts(vocab, 0);
  for (int t = 0; t < kTrials; ++t) {
    TargetRequest r = Request(kPrompt, 4);
    r.sampling = sp;
    r.sampling.seed = 9000 + t;
    auto s = TargetSession::Create(target_.get(), r);
    ASSERT_TRUE(s.ok()) << s.status();
    const DraftToken d{SampleFrom(q, &draft_rng), q};
    auto round = (*s)->Step(absl::MakeConstSpan(&d, 1));
    ASSERT_TRUE(round.ok()) << round.status();
    ++counts[round->tokens[0]];
  }
  std::vector<double> pd(vocab, 0.0);
  for (auto [id, prob] : p) pd[id] = prob;
  const ChiSquareResult chi = ChiSquareTest(counts, pd);
  EXPECT_GT(chi.p_value, 1e-3) << "chi2 " << chi.statistic;
  EXPECT_GE(chi.dof, 3);
  for (int v = 0; v < vocab; ++v) {
    if (pd[v] == 0.0) EXPECT_EQ(counts[v], 0) << v;
  }
  // Longer runs with chain drafts: every token passes min_p at its place.
  RandomDrafts drafts{{}, vocab, 2};
  for (int seed = 0; seed < 5; ++seed) {
    TargetRequest r = Request(kPrompt, 24);
    r.sampling = sp;
    r.sampling.seed = seed;
    r.ignore_eos = true;
    const std::vector<int> out =
        RunSession(target_.get(), r, [&](auto& g, auto* d, auto* p) {
          drafts.Chain(g, d, p);
          for (DraftToken& x : *d) x.q = {{x.id, 1.f}};
        }).tokens;
    for (size_t i = 0; i < out.size(); ++i) {
      const std::vector<float> row = ContextLogits(
          *target_, kPrompt, r.position_ids, static_cast<int>(kPrompt.size()),
          std::vector<int>(out.begin(), out.begin() + i));
      const float top = *std::max_element(row.begin(), row.end());
      EXPECT_GE(row[out[i]], top + sp.temperature * std::log(sp.min_p) - 1e-4)
          << "seed " << seed << " token " << i;
    }
  }
}

TEST_F(TargetSessionTest, BadPenaltiesAreRejected) {
  TargetRequest r = Request({1, 5, 9}, 4);
  r.sampling.repetition_penalty = 0.f;
  EXPECT_EQ(TargetSession::Create(target_.get(), r).status().code(),
            absl::StatusCode::kInvalidArgument);
  r.sampling.repetition_penalty = 1.1f;
  r.penalty_prompt_ids = {1, 5, target_->config().vocab_size};
  const absl::Status s = TargetSession::Create(target_.get(), r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("penalty_prompt_ids[2]"), std::string::npos);
}

}  // namespace
}  // namespace specserve
