#include "common/decoding/verification.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/decoding/row_sampling.h"
#include "common/decoding/sampling.h"
#include "common/decoding/stats.h"
#include "common/decoding/synthetic_models.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using ::testing::HasSubstr;

using testing_models::Dense;
using testing_models::DraftLogits;
using testing_models::TargetLogits;

// Target rows for verification: row j = target after ctx + drafts[0..j).
std::vector<float> TargetRows(const std::vector<int>& ctx,
                              const std::vector<DraftToken>& drafts,
                              int vocab) {
  std::vector<float> rows;
  std::vector<int> c = ctx;
  for (size_t j = 0; j <= drafts.size(); ++j) {
    const std::vector<float> r = TargetLogits(c, vocab);
    rows.insert(rows.end(), r.begin(), r.end());
    if (j < drafts.size()) c.push_back(drafts[j].id);
  }
  return rows;
}

// ---------------------------------------------------------------------------
// Greedy: speculative output == plain greedy decoding of the target.

enum class DraftKind { kNoisyModel, kUniformRandom };

void RunGreedyLoop(DraftKind kind) {
  constexpr int kVocab = 32;
  constexpr int kNew = 300;
  const std::vector<int> prompt = {1, 2, 3};

  std::vector<int> reference = prompt;
  for (int i = 0; i < kNew; ++i) {
    reference.push_back(Argmax(TargetLogits(reference, kVocab)));
  }

  std::mt19937_64 gen(17);
  std::vector<int> ctx = prompt;
  int accepted = 0, rejected = 0, rounds = 0;
  while (static_cast<int>(ctx.size()) < static_cast<int>(prompt.size()) + kNew) {
    const int k = rounds++ % 6;  // 0..5, includes plain steps
    std::vector<DraftToken> drafts;
    std::vector<int> dctx = ctx;
    for (int j = 0; j < k; ++j) {
      const int x = kind == DraftKind::kNoisyModel
                        ? Argmax(DraftLogits(dctx, kVocab))
                        : static_cast<int>(gen() % kVocab);
      drafts.push_back({x, {}});
      dctx.push_back(x);
    }
    const std::vector<float> rows = TargetRows(ctx, drafts, kVocab);
    absl::StatusOr<VerifyResult> r =
        VerifyDrafts(drafts, rows, kVocab, SamplingParams{}, nullptr);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->tokens.size(), static_cast<size_t>(r->num_accepted + 1));
    for (int j = 0; j < r->num_accepted; ++j) {
      EXPECT_EQ(r->tokens[j], drafts[j].id);
    }
    accepted += r->num_accepted;
    if (r->num_accepted < k) ++rejected;
    ctx.insert(ctx.end(), r->tokens.begin(), r->tokens.end());
  }
  ctx.resize(reference.size());
  EXPECT_EQ(ctx, reference);
  // Both branches were exercised.
  EXPECT_GT(rejected, 0);
  if (kind == DraftKind::kNoisyModel) {
    EXPECT_GT(accepted, 50);
  }
}

TEST(VerifyDraftsGreedyTest, NoisyDraftModelReproducesGreedyDecoding) {
  RunGreedyLoop(DraftKind::kNoisyModel);
}

TEST(VerifyDraftsGreedyTest, RandomDraftsReproduceGreedyDecoding) {
  RunGreedyLoop(DraftKind::kUniformRandom);
}

TEST(VerifyDraftsGreedyTest, HandExample) {
  // vocab 4, k = 2. Row argmaxes: 2, 1, 3.
  const std::vector<float> rows = {0, 1, 5, 2,   //
                                   0, 9, 1, 1,   //
                                   0, 0, 0, 4};
  auto run = [&](int x1, int x2) {
    std::vector<DraftToken> d = {{x1, {}}, {x2, {}}};
    return *VerifyDrafts(d, rows, 4, SamplingParams{}, nullptr);
  };
  VerifyResult all = run(2, 1);
  EXPECT_EQ(all.num_accepted, 2);
  EXPECT_EQ(all.tokens, (std::vector<int>{2, 1, 3}));
  VerifyResult second = run(2, 0);
  EXPECT_EQ(second.num_accepted, 1);
  EXPECT_EQ(second.tokens, (std::vector<int>{2, 1}));
  VerifyResult first = run(3, 1);
  EXPECT_EQ(first.num_accepted, 0);
  EXPECT_EQ(first.tokens, (std::vector<int>{2}));
  // k = 0: one plain greedy step.
  const absl::StatusOr<VerifyResult> plain = VerifyDrafts(
      {}, absl::MakeConstSpan(rows).subspan(0, 4), 4, SamplingParams{},
      nullptr);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->tokens, (std::vector<int>{2}));
}

// From the rows' argmax ids (a backend's argmax_only output) greedy
// verification gives what it gives from the logits; bad ids and sizes are
// INVALID_ARGUMENT.
TEST(VerifyDraftsGreedyTest, FromArgmaxEqualsFromLogits) {
  constexpr int kVocab = 7;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  for (int trial = 0; trial < 300; ++trial) {
    const int k = trial % 6;
    std::vector<float> rows((k + 1) * kVocab);
    for (float& x : rows) x = std::round(u(rng));  // ties on purpose
    std::vector<int> best(k + 1);
    for (int j = 0; j <= k; ++j) {
      best[j] = Argmax(absl::MakeConstSpan(rows).subspan(j * kVocab, kVocab));
    }
    std::vector<DraftToken> d(k);
    // Mostly the target's own choice, so rounds run deep.
    for (int j = 0; j < k; ++j) d[j].id = rng() % 4 ? best[j] : rng() % kVocab;
    auto a = VerifyDrafts(d, rows, kVocab, SamplingParams{}, nullptr);
    auto b = VerifyDraftsGreedy(d, best, kVocab);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->tokens, b->tokens);
    EXPECT_EQ(a->num_accepted, b->num_accepted);
  }
  const std::vector<DraftToken> one = {{1, {}}};
  EXPECT_EQ(VerifyDraftsGreedy(one, {1}, kVocab).status().code(),
            absl::StatusCode::kInvalidArgument);  // needs k + 1 ids
  EXPECT_EQ(VerifyDraftsGreedy(one, {1, kVocab}, kVocab).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(VerifyDraftsGreedy({{-1, {}}}, {1, 1}, kVocab).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------
// Sampled: the first emitted token is distributed as p_1 (lossless).

struct FirstTokenCase {
  std::string name;
  SamplingParams params;
  int k;
  bool draft_equals_target;
};

void PrintTo(const FirstTokenCase& c, std::ostream* os) { *os << c.name; }

class FirstTokenTest : public ::testing::TestWithParam<FirstTokenCase> {};

TEST_P(FirstTokenTest, FirstEmittedTokenIsDistributedAsTarget) {
  constexpr int kVocab = 20;
  constexpr int kTrials = 20000;
  const FirstTokenCase& c = GetParam();
  std::mt19937_64 gen(1000 + c.k);
  std::normal_distribution<float> normal(0.f, 1.5f);
  auto random_row = [&] {
    std::vector<float> r(kVocab);
    for (float& v : r) v = normal(gen);
    return r;
  };
  std::vector<float> rows;
  for (int j = 0; j <= c.k; ++j) {
    const std::vector<float> r = random_row();
    rows.insert(rows.end(), r.begin(), r.end());
  }
  std::vector<SparseDist> q(c.k);
  for (int j = 0; j < c.k; ++j) {
    q[j] = c.draft_equals_target
               ? ComputeDistribution(
                     absl::MakeConstSpan(rows).subspan(j * kVocab, kVocab),
                     c.params)
               : ComputeDistribution(random_row(), c.params);
  }
  const SparseDist p1 =
      ComputeDistribution(absl::MakeConstSpan(rows).subspan(0, kVocab),
                          c.params);

  Rng rng(77 + c.k);
  std::vector<int64_t> counts(kVocab, 0);
  std::vector<int64_t> draft_counts(kVocab, 0);
  int64_t total_accepted = 0;
  for (int t = 0; t < kTrials; ++t) {
    std::vector<DraftToken> drafts(c.k);
    for (int j = 0; j < c.k; ++j) drafts[j] = {SampleFrom(q[j], &rng), q[j]};
    if (c.k > 0) ++draft_counts[drafts[0].id];
    absl::StatusOr<VerifyResult> r =
        VerifyDrafts(drafts, rows, kVocab, c.params, &rng);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->tokens.size(), static_cast<size_t>(r->num_accepted + 1));
    ++counts[r->tokens[0]];
    total_accepted += r->num_accepted;
  }
  const ChiSquareResult chi = ChiSquareTest(counts, Dense(p1, kVocab));
  EXPECT_GT(chi.p_value, 1e-3) << "chi2=" << chi.statistic
                               << " dof=" << chi.dof;
  if (c.draft_equals_target) {
    // p == q: every draft is accepted (u < 1 = p/q).
    EXPECT_EQ(total_accepted, static_cast<int64_t>(kTrials) * c.k);
  } else if (c.k > 0) {
    // Power check: the draft's own samples are clearly NOT from p, so the
    // chi-square test above would have caught a verifier that just passes
    // drafts through.
    EXPECT_LT(ChiSquareTest(draft_counts, Dense(p1, kVocab)).p_value, 1e-6);
  }
}

std::vector<FirstTokenCase> FirstTokenCases() {
  std::vector<FirstTokenCase> cases;
  for (int k = 0; k <= 3; ++k) {
    const std::string ks = "k" + std::to_string(k);
    cases.push_back({"plain_" + ks, {1.f, 0, 1.f, 0}, k, false});
    cases.push_back({"topk5_" + ks, {0.8f, 5, 1.f, 0}, k, false});
    cases.push_back({"topp08_" + ks, {1.2f, 0, 0.8f, 0}, k, false});
    if (k > 0) cases.push_back({"same_" + ks, {1.f, 0, 1.f, 0}, k, true});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    Lossless, FirstTokenTest, ::testing::ValuesIn(FirstTokenCases()),
    [](const testing::TestParamInfo<FirstTokenCase>& info) {
      return info.param.name;
    });

// The row-parallel form of VerifyDrafts (ForwardInput::sampling): every
// row's SampleRow with two fresh uniforms, then VerifyDraftsFromRows.
absl::StatusOr<VerifyResult> VerifyByRows(const std::vector<DraftToken>& drafts,
                                          const std::vector<float>& rows,
                                          int vocab,
                                          const SamplingParams& params,
                                          Rng* rng) {
  const size_t k = drafts.size();
  std::vector<int> sampled(k + 1);
  std::vector<uint8_t> accepted(k + 1);
  for (size_t j = 0; j <= k; ++j) {
    const double ua = rng->Uniform(), us = rng->Uniform();
    const RowSample r = SampleRow(
        absl::MakeConstSpan(rows).subspan(j * vocab, vocab), params,
        j < k ? drafts[j].id : -1, j < k ? drafts[j].q : SparseDist{}, ua, us);
    sampled[j] = r.token;
    accepted[j] = r.accepted;
  }
  return VerifyDraftsFromRows(drafts, sampled, accepted, vocab);
}

// ---------------------------------------------------------------------------
// Sampled, whole loop: the first three emitted tokens of a speculative
// generation have the target's joint distribution (covers bonus tokens,
// corrections and later positions, with context-dependent p and q), for
// VerifyDrafts and for the row-parallel form (by_rows).

void RunJointTest(const SamplingParams& params, uint64_t seed,
                  bool by_rows = false) {
  constexpr int kVocab = 5;
  constexpr int kLen = 3;
  constexpr int kTrials = 40000;
  const std::vector<int> prompt = {4, 2};

  // Exact joint distribution of the first kLen target tokens.
  std::vector<double> joint(1, 1.0);
  std::vector<std::vector<int>> prefixes = {{}};
  for (int pos = 0; pos < kLen; ++pos) {
    std::vector<double> next_joint;
    std::vector<std::vector<int>> next_prefixes;
    for (size_t i = 0; i < prefixes.size(); ++i) {
      std::vector<int> ctx = prompt;
      ctx.insert(ctx.end(), prefixes[i].begin(), prefixes[i].end());
      const std::vector<double> p =
          Dense(ComputeDistribution(TargetLogits(ctx, kVocab), params), kVocab);
      for (int v = 0; v < kVocab; ++v) {
        next_joint.push_back(joint[i] * p[v]);
        next_prefixes.push_back(prefixes[i]);
        next_prefixes.back().push_back(v);
      }
    }
    joint.swap(next_joint);
    prefixes.swap(next_prefixes);
  }

  Rng rng(seed);
  std::vector<int64_t> counts(joint.size(), 0);
  for (int t = 0; t < kTrials; ++t) {
    std::vector<int> ctx = prompt;
    int round = 0;
    while (static_cast<int>(ctx.size() - prompt.size()) < kLen) {
      const int k = (t + round++) % 4;  // 0..3
      std::vector<DraftToken> drafts;
      std::vector<int> dctx = ctx;
      for (int j = 0; j < k; ++j) {
        SparseDist q = ComputeDistribution(DraftLogits(dctx, kVocab), params);
        const int x = SampleFrom(q, &rng);
        drafts.push_back({x, std::move(q)});
        dctx.push_back(x);
      }
      const std::vector<float> rows = TargetRows(ctx, drafts, kVocab);
      absl::StatusOr<VerifyResult> r =
          by_rows ? VerifyByRows(drafts, rows, kVocab, params, &rng)
                  : VerifyDrafts(drafts, rows, kVocab, params, &rng);
      ASSERT_TRUE(r.ok()) << r.status();
      ctx.insert(ctx.end(), r->tokens.begin(), r->tokens.end());
    }
    int bin = 0;
    for (int i = 0; i < kLen; ++i) bin = bin * kVocab + ctx[prompt.size() + i];
    ++counts[bin];
  }
  const ChiSquareResult chi = ChiSquareTest(counts, joint);
  EXPECT_GT(chi.p_value, 1e-3) << "chi2=" << chi.statistic
                               << " dof=" << chi.dof;
  EXPECT_GT(chi.dof, 20);
}

TEST(VerifyDraftsSampledTest, GenerationLoopMatchesTargetJointDistribution) {
  RunJointTest({1.f, 0, 1.f, 0}, 5);
}

TEST(VerifyDraftsSampledTest, GenerationLoopMatchesTargetJointWithTopK) {
  // top-k 3 of 5: zero-probability bins must stay empty (p-value 0 if not).
  RunJointTest({0.9f, 3, 1.f, 0}, 6);
}

TEST(VerifyDraftsFromRowsTest, GenerationLoopMatchesTargetJointDistribution) {
  RunJointTest({1.f, 0, 1.f, 0}, 7, /*by_rows=*/true);
}

TEST(VerifyDraftsFromRowsTest, GenerationLoopMatchesTargetJointWithTopKTopP) {
  RunJointTest({0.9f, 3, 1.f, 0}, 8, /*by_rows=*/true);
  RunJointTest({2.f, 0, 0.95f, 0}, 9, /*by_rows=*/true);
}

TEST(VerifyDraftsFromRowsTest, EmitsAcceptedPrefixThenFirstRejectedSample) {
  const std::vector<DraftToken> drafts = {{3, {}}, {1, {}}, {2, {}}};
  // All accepted: the drafts, then the bonus row's sample.
  VerifyResult r = *VerifyDraftsFromRows(drafts, {-1, -1, -1, 4}, {1, 1, 1, 0}, 5);
  EXPECT_EQ(r.tokens, (std::vector<int>{3, 1, 2, 4}));
  EXPECT_EQ(r.num_accepted, 3);
  // Row 1 rejected: rows after it do not matter, accepted or not.
  r = *VerifyDraftsFromRows(drafts, {-1, 0, 7, 9}, {1, 0, 1, 1}, 5);
  EXPECT_EQ(r.tokens, (std::vector<int>{3, 0}));
  EXPECT_EQ(r.num_accepted, 1);
  // k = 0: a plain sampling step.
  r = *VerifyDraftsFromRows({}, {2}, {0}, 5);
  EXPECT_EQ(r.tokens, (std::vector<int>{2}));
  EXPECT_EQ(r.num_accepted, 0);
}

TEST(VerifyDraftsFromRowsTest, RejectsBadRows) {
  const std::vector<DraftToken> drafts = {{3, {}}};
  EXPECT_EQ(VerifyDraftsFromRows(drafts, {1}, {0}, 5).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(VerifyDraftsFromRows(drafts, {1, 2}, {0}, 5).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(VerifyDraftsFromRows(drafts, {1, 2}, {0, 0}, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The token the result needs is out of range (a backend's -1, or 5).
  EXPECT_EQ(VerifyDraftsFromRows(drafts, {-1, 2}, {0, 0}, 5).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(VerifyDraftsFromRows(drafts, {-1, 5}, {1, 0}, 5).status().code(),
            absl::StatusCode::kInvalidArgument);
  // An unused row's -1 is fine.
  EXPECT_TRUE(VerifyDraftsFromRows(drafts, {2, -1}, {0, 0}, 5).ok());
}

// ---------------------------------------------------------------------------
// Acceptance rate and the correction distribution for k = 1.

struct PairCase {
  SamplingParams params;
  uint64_t seed;
};

void PrintTo(const PairCase& c, std::ostream* os) {
  *os << "T=" << c.params.temperature << " top_k=" << c.params.top_k
      << " top_p=" << c.params.top_p << " seed=" << c.seed;
}

class SingleDraftTest : public ::testing::TestWithParam<PairCase> {};

// One draft x ~ q verified kTrials times, by VerifyDrafts or (by_rows) by
// the row form.
void CheckSingleDraft(const PairCase& c, bool by_rows) {
  constexpr int kVocab = 20;
  constexpr int kTrials = 20000;
  std::mt19937_64 gen(c.seed);
  std::normal_distribution<float> normal(0.f, 1.5f);
  std::vector<float> target(2 * kVocab), draft(kVocab);
  for (float& v : target) v = normal(gen);
  for (float& v : draft) v = normal(gen);
  const SparseDist qd = ComputeDistribution(draft, c.params);
  const std::vector<double> p = Dense(
      ComputeDistribution(absl::MakeConstSpan(target).subspan(0, kVocab),
                          c.params),
      kVocab);
  const std::vector<double> q = Dense(qd, kVocab);

  // Leviathan et al. section 3.3: beta = sum_x min(p(x), q(x)).
  double alpha = 0.0;
  std::vector<double> residual(kVocab);
  for (int v = 0; v < kVocab; ++v) {
    alpha += std::min(p[v], q[v]);
    residual[v] = std::max(0.0, p[v] - q[v]);
  }

  Rng rng(c.seed * 31 + 1);
  int64_t accepted = 0;
  std::vector<int64_t> corrections(kVocab, 0);
  for (int t = 0; t < kTrials; ++t) {
    const std::vector<DraftToken> drafts = {{SampleFrom(qd, &rng), qd}};
    absl::StatusOr<VerifyResult> r =
        by_rows ? VerifyByRows(drafts, target, kVocab, c.params, &rng)
                : VerifyDrafts(drafts, target, kVocab, c.params, &rng);
    ASSERT_TRUE(r.ok()) << r.status();
    if (r->num_accepted == 1) {
      ++accepted;
    } else {
      ++corrections[r->tokens[0]];
    }
  }
  const double rate = static_cast<double>(accepted) / kTrials;
  const double sigma = std::sqrt(alpha * (1 - alpha) / kTrials);
  EXPECT_NEAR(rate, alpha, 4 * sigma) << "alpha=" << alpha;
  // Given a rejection, the correction comes from norm(max(0, p - q)).
  const ChiSquareResult chi = ChiSquareTest(corrections, residual);
  EXPECT_GT(chi.p_value, 1e-3) << "chi2=" << chi.statistic;
}

TEST_P(SingleDraftTest, AcceptanceRateAndCorrectionDistribution) {
  CheckSingleDraft(GetParam(), /*by_rows=*/false);
}

TEST_P(SingleDraftTest, AcceptanceRateAndCorrectionDistributionByRows) {
  CheckSingleDraft(GetParam(), /*by_rows=*/true);
}

INSTANTIATE_TEST_SUITE_P(Rates, SingleDraftTest,
                         ::testing::Values(PairCase{{1.f, 0, 1.f, 0}, 1},
                                           PairCase{{0.7f, 5, 1.f, 0}, 2},
                                           PairCase{{1.f, 0, 0.9f, 0}, 3},
                                           PairCase{{2.f, 8, 0.95f, 0}, 4}));

TEST(VerifyDraftsSampledTest, SameSeedSameResult) {
  constexpr int kVocab = 50;
  const SamplingParams params{1.f, 10, 0.9f, 0};
  const std::vector<int> ctx = {7, 8};
  std::vector<DraftToken> drafts;
  std::vector<int> dctx = ctx;
  Rng draft_rng(9);
  for (int j = 0; j < 4; ++j) {
    SparseDist q = ComputeDistribution(DraftLogits(dctx, kVocab), params);
    const int x = SampleFrom(q, &draft_rng);
    drafts.push_back({x, q});
    dctx.push_back(x);
  }
  const std::vector<float> rows = TargetRows(ctx, drafts, kVocab);
  for (uint64_t seed = 0; seed < 20; ++seed) {
    Rng a(seed), b(seed);
    const VerifyResult ra = *VerifyDrafts(drafts, rows, kVocab, params, &a);
    const VerifyResult rb = *VerifyDrafts(drafts, rows, kVocab, params, &b);
    EXPECT_EQ(ra.tokens, rb.tokens);
    EXPECT_EQ(ra.num_accepted, rb.num_accepted);
  }
}

// ---------------------------------------------------------------------------
// Bad input: INVALID_ARGUMENT naming the field.

void ExpectInvalid(const absl::Status& s, const std::string& field) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(field));
}

TEST(VerifyDraftsErrorsTest, RejectsBadInputNamingTheField) {
  constexpr int kVocab = 4;
  const SamplingParams sampled{1.f, 0, 1.f, 0};
  const SparseDist good_q = {{1, 0.5f}, {2, 0.5f}};
  const std::vector<float> rows2(2 * kVocab, 0.f);
  Rng rng(1);
  auto verify = [&](std::vector<DraftToken> d, const SamplingParams& p,
                    Rng* r = nullptr) {
    return VerifyDrafts(d, rows2, kVocab, p, r).status();
  };
  // Row count must be k + 1.
  ExpectInvalid(VerifyDrafts({}, rows2, kVocab, sampled, &rng).status(),
                "target_logits");
  ExpectInvalid(verify({{1, good_q}, {2, good_q}}, sampled, &rng),
                "target_logits");
  // Draft id outside the vocabulary (greedy and sampled).
  ExpectInvalid(verify({{4, {}}}, SamplingParams{}), "drafts[0].id");
  ExpectInvalid(verify({{-1, good_q}}, sampled, &rng), "drafts[0].id");
  // Malformed q when sampling.
  ExpectInvalid(verify({{1, {}}}, sampled, &rng), "drafts[0].q is empty");
  ExpectInvalid(verify({{1, {{1, 1.5f}, {2, -0.5f}}}}, sampled, &rng),
                "drafts[0].q[1].prob");
  ExpectInvalid(verify({{1, {{1, 0.5f}, {7, 0.5f}}}}, sampled, &rng),
                "drafts[0].q[1].id");
  ExpectInvalid(verify({{1, {{1, 0.5f}, {2, 0.4f}}}}, sampled, &rng),
                "drafts[0].q sums to");
  ExpectInvalid(verify({{1, {{1, 0.5f}, {1, 0.5f}}}}, sampled, &rng),
                "drafts[0].q lists id 1 more than once");
  ExpectInvalid(verify({{3, good_q}}, sampled, &rng),
                "drafts[0].id = 3 has probability 0");
  ExpectInvalid(verify({{1, {{1, NAN}, {2, 0.5f}}}}, sampled, &rng),
                "drafts[0].q[0].prob");
  // Params, vocab, rng.
  ExpectInvalid(verify({{1, good_q}}, {-1.f, 0, 1.f, 0}, &rng), "temperature");
  ExpectInvalid(verify({{1, good_q}}, {1.f, 0, 2.f, 0}, &rng), "top_p");
  ExpectInvalid(verify({{1, good_q}}, sampled, nullptr), "rng");
  ExpectInvalid(VerifyDrafts({}, {}, 0, sampled, &rng).status(), "vocab_size");
  // Greedy ignores q entirely.
  EXPECT_TRUE(verify({{1, {{9, -3.f}}}}, SamplingParams{}).ok());
}

TEST(ValidateDraftsTest, MatchesVerifyRules) {
  const SparseDist good_q = {{0, 0.25f}, {1, 0.75f}};
  EXPECT_TRUE(ValidateDrafts({}, 3, false).ok());
  EXPECT_TRUE(ValidateDrafts({{{1, good_q}, {0, good_q}}}, 3, false).ok());
  // Second draft bad: the index in the message points at it.
  ExpectInvalid(ValidateDrafts({{{1, good_q}, {1, {}}}}, 3, false),
                "drafts[1].q");
  EXPECT_TRUE(ValidateDrafts({{{1, {}}}}, 3, true).ok());
  ExpectInvalid(ValidateDrafts({{{3, {}}}}, 3, true), "drafts[0].id");
  ExpectInvalid(ValidateDrafts({}, 0, true), "vocab_size");
  // Within the 1e-3 tolerance is fine.
  EXPECT_TRUE(ValidateDrafts({{{1, {{1, 0.9995f}}}}}, 3, false).ok());
}

}  // namespace
}  // namespace specserve
