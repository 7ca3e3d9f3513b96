#include "common/decoding/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "common/decoding/stats.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using ::testing::HasSubstr;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Straightforward reference transform: full sort, full softmax, top-k prefix,
// renormalise, top-p prefix, renormalise. Same documented order and ties.
SparseDist NaiveDistribution(const std::vector<float>& logits,
                             const SamplingParams& p) {
  const int n = logits.size();
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  const double mx = logits[order[0]];
  std::vector<double> prob(n);
  double z = 0;
  for (int i = 0; i < n; ++i) {
    prob[i] = std::exp((logits[order[i]] - mx) / p.temperature);
    z += prob[i];
  }
  for (double& v : prob) v /= z;
  int keep = n;
  if (p.top_k > 0) keep = std::min(keep, p.top_k);
  double zk = 0;
  for (int i = 0; i < keep; ++i) zk += prob[i];
  for (int i = 0; i < keep; ++i) prob[i] /= zk;
  double cum = 0;
  // top_p = 1 means "off" (HF and vLLM skip the warper): cumulative sums can
  // reach 1.0 in double before the smallest probabilities are added.
  for (int i = 0; i < keep && p.top_p < 1.f; ++i) {
    cum += prob[i];
    if (cum >= p.top_p) {
      keep = i + 1;
      break;
    }
  }
  double zp = 0;
  for (int i = 0; i < keep; ++i) zp += prob[i];
  SparseDist out;
  for (int i = 0; i < keep; ++i) {
    const float v = static_cast<float>(prob[i] / zp);
    if (v > 0.f) out.emplace_back(order[i], v);
  }
  // The documented output order: probability descending, then lower id
  // (distinct logits can round to the same float probability).
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.second > b.second || (a.second == b.second && a.first < b.first);
  });
  return out;
}

std::vector<float> RandomLogits(int n, std::mt19937_64* gen, float scale,
                                bool quantize) {
  std::normal_distribution<float> normal(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) {
    x = normal(*gen);
    if (quantize) x = std::round(x * 2.f) / 2.f;  // many exact ties
  }
  return v;
}

void ExpectSameDist(const SparseDist& got, const SparseDist& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first) << "entry " << i;
    EXPECT_NEAR(got[i].second, want[i].second, 1e-6 + 1e-5 * want[i].second)
        << "entry " << i;
  }
}

void ExpectWellFormed(const SparseDist& d) {
  ASSERT_FALSE(d.empty());
  double sum = 0;
  for (size_t i = 0; i < d.size(); ++i) {
    EXPECT_GT(d[i].second, 0.f);
    sum += d[i].second;
    if (i > 0) {
      EXPECT_TRUE(d[i - 1].second > d[i].second ||
                  (d[i - 1].second == d[i].second &&
                   d[i - 1].first < d[i].first))
          << "order broken at " << i;
    }
  }
  EXPECT_NEAR(sum, 1.0, 1e-5);
}

TEST(ValidateSamplingParamsTest, AcceptsValid) {
  EXPECT_TRUE(ValidateSamplingParams({}).ok());
  EXPECT_TRUE(ValidateSamplingParams({0.7f, 20, 0.9f, 1}).ok());
  EXPECT_TRUE(ValidateSamplingParams({1.f, 1000000, 1.f, 0}).ok());
  EXPECT_TRUE(ValidateSamplingParams({0.f, 0, 1.f, 0, -2.f, 2.f, 0.01f}).ok());
  EXPECT_TRUE(ValidateSamplingParams({0.f, 0, 1.f, 0, 2.f, -2.f, 10.f}).ok());
  EXPECT_TRUE(ValidateSamplingParams(
                  {0.f, 0, 1.f, 0, 0.f, 0.f, 1.f, {{0, -100.f}, {7, 100.f}}})
                  .ok());
  SamplingParams many;
  for (int i = 0; i <= kMaxLogitBias; ++i) many.logit_bias.push_back({i, 1.f});
  EXPECT_THAT(std::string(ValidateSamplingParams(many).message()),
              HasSubstr("at most 1024"));
}

TEST(ValidateSamplingParamsTest, HasPenaltiesIsAnyPenaltyOffItsDefault) {
  EXPECT_FALSE(SamplingParams().has_penalties());
  EXPECT_TRUE(SamplingParams({0.f, 0, 1.f, 0, 0.1f}).has_penalties());
  EXPECT_TRUE(SamplingParams({0.f, 0, 1.f, 0, 0.f, -0.1f}).has_penalties());
  EXPECT_TRUE(
      SamplingParams({0.f, 0, 1.f, 0, 0.f, 0.f, 1.1f}).has_penalties());
}

TEST(ValidateSamplingParamsTest, RejectsNamingTheField) {
  struct Case {
    SamplingParams p;
    const char* field;
  };
  const Case cases[] = {
      {{-0.1f, 0, 1.f, 0}, "temperature"},
      {{NAN, 0, 1.f, 0}, "temperature"},
      {{kInf, 0, 1.f, 0}, "temperature"},
      {{1.f, -1, 1.f, 0}, "top_k"},
      {{1.f, 0, 0.f, 0}, "top_p"},
      {{1.f, 0, 1.5f, 0}, "top_p"},
      {{1.f, 0, NAN, 0}, "top_p"},
      {{1.f, 0, 1.f, 0, 2.5f}, "presence_penalty"},
      {{1.f, 0, 1.f, 0, NAN}, "presence_penalty"},
      {{1.f, 0, 1.f, 0, 0.f, -2.01f}, "frequency_penalty"},
      {{1.f, 0, 1.f, 0, 0.f, kInf}, "frequency_penalty"},
      {{1.f, 0, 1.f, 0, 0.f, 0.f, 0.f}, "repetition_penalty"},
      {{1.f, 0, 1.f, 0, 0.f, 0.f, -1.f}, "repetition_penalty"},
      {{1.f, 0, 1.f, 0, 0.f, 0.f, kInf}, "repetition_penalty"},
      {{1.f, 0, 1.f, 0, 0.f, 0.f, 1.f, {{3, 1.f}, {3, 2.f}}}, "logit_bias"},
      {{1.f, 0, 1.f, 0, 0.f, 0.f, 1.f, {{5, 1.f}, {3, 2.f}}}, "logit_bias"},
      {{1.f, 0, 1.f, 0, 0.f, 0.f, 1.f, {{-1, 1.f}}}, "logit_bias"},
      {{1.f, 0, 1.f, 0, 0.f, 0.f, 1.f, {{1, 100.5f}}}, "logit_bias[1]"},
      {{1.f, 0, 1.f, 0, 0.f, 0.f, 1.f, {{1, NAN}}}, "logit_bias[1]"},
      {{1.f, 0, 1.f, 0, 0.f, 0.f, 1.f, {}, 1.5f}, "min_p"},
      {{1.f, 0, 1.f, 0, 0.f, 0.f, 1.f, {}, -0.1f}, "min_p"},
      {{1.f, 0, 1.f, 0, 0.f, 0.f, 1.f, {}, NAN}, "min_p"},
  };
  for (const Case& c : cases) {
    const absl::Status s = ValidateSamplingParams(c.p);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.field));
  }
}

TEST(ArgmaxTest, TiesAndNaN) {
  EXPECT_EQ(Argmax(std::vector<float>{1, 3, 3, 2}), 1);
  EXPECT_EQ(Argmax(std::vector<float>{-5, -2, -7}), 1);
  EXPECT_EQ(Argmax(std::vector<float>{NAN, 0.5f, NAN, 0.7f}), 3);
  EXPECT_EQ(Argmax(std::vector<float>{-kInf, -kInf}), 0);
  EXPECT_EQ(Argmax(std::vector<float>{0, kInf, kInf}), 1);
  EXPECT_EQ(Argmax(std::vector<float>{}), -1);
}

TEST(ComputeDistributionTest, GreedyIsArgmaxWithProbabilityOne) {
  const std::vector<float> logits = {0.1f, 2.f, -1.f, 2.f};
  const SparseDist d = ComputeDistribution(logits, SamplingParams{});
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].first, 1);
  EXPECT_EQ(d[0].second, 1.f);
}

TEST(ComputeDistributionTest, HandComputedSoftmax) {
  // logits ln(1), ln(2), ln(5) at T = 1 -> 0.125, 0.25, 0.625.
  const std::vector<float> logits = {0.f, std::log(2.f), std::log(5.f),
                                     std::log(0.f)};  // -inf: out of support
  const SparseDist d = ComputeDistribution(logits, {1.f, 0, 1.f, 0});
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d[0].first, 2);
  EXPECT_NEAR(d[0].second, 0.625f, 1e-6);
  EXPECT_EQ(d[1].first, 1);
  EXPECT_NEAR(d[1].second, 0.25f, 1e-6);
  EXPECT_EQ(d[2].first, 0);
  EXPECT_NEAR(d[2].second, 0.125f, 1e-6);
  // T = 2 halves the log-odds: weights 1, sqrt2, sqrt5.
  const SparseDist d2 = ComputeDistribution(logits, {2.f, 0, 1.f, 0});
  const double z = 1 + std::sqrt(2.0) + std::sqrt(5.0);
  EXPECT_NEAR(d2[0].second, std::sqrt(5.0) / z, 1e-6);
  EXPECT_NEAR(d2[2].second, 1.0 / z, 1e-6);
}

TEST(ComputeDistributionTest, MatchesNaiveOnRandomLogits) {
  std::mt19937_64 gen(1234);
  const int vocabs[] = {1, 2, 7, 100, 1000, 5000};
  const float temps[] = {0.05f, 0.3f, 0.7f, 1.f, 1.5f, 10.f};
  const float top_ps[] = {1.f, 0.999f, 0.95f, 0.5f, 0.1f, 1e-6f};
  int cases = 0;
  for (int vocab : vocabs) {
    const int top_ks[] = {0, 1, 5, 50, vocab, vocab + 3};
    for (bool quantize : {false, true}) {
      const std::vector<float> logits = RandomLogits(vocab, &gen, 3.f, quantize);
      for (float t : temps) {
        for (int k : top_ks) {
          for (float top_p : top_ps) {
            const SamplingParams p{t, k, top_p, 0};
            SCOPED_TRACE(testing::Message()
                         << "vocab=" << vocab << " T=" << t << " top_k=" << k
                         << " top_p=" << top_p << " quantized=" << quantize);
            const SparseDist got = ComputeDistribution(logits, p);
            ExpectWellFormed(got);
            ExpectSameDist(got, NaiveDistribution(logits, p));
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 1000);
}

TEST(ComputeDistributionTest, MatchesNaiveAtLlama3Vocab) {
  std::mt19937_64 gen(99);
  const std::vector<float> logits = RandomLogits(128256, &gen, 4.f, false);
  for (const SamplingParams& p :
       {SamplingParams{1.f, 20, 1.f, 0}, SamplingParams{0.8f, 0, 0.9f, 0},
        SamplingParams{1.f, 50, 0.8f, 0}, SamplingParams{1.f, 0, 1.f, 0}}) {
    const SparseDist got = ComputeDistribution(logits, p);
    ExpectWellFormed(got);
    ExpectSameDist(got, NaiveDistribution(logits, p));
  }
}

TEST(ComputeDistributionTest, MatchesNaiveOnEveryCodePath) {
  // Heap top-k (<= 4096), nth_element top-k (> 4096) followed by a radix sort
  // of scrambled candidates, radix sort in id order, partial sorts for top-p;
  // with and without exact logit ties.
  std::mt19937_64 gen(2024);
  for (bool quantize : {false, true}) {
    const std::vector<float> logits = RandomLogits(20000, &gen, 3.f, quantize);
    for (int k : {0, 1, 100, 4096, 4097, 10000, 19999}) {
      for (float top_p : {1.f, 0.99f, 0.7f}) {
        const SamplingParams p{1.1f, k, top_p, 0};
        SCOPED_TRACE(testing::Message() << "top_k=" << k << " top_p=" << top_p
                                        << " quantized=" << quantize);
        const SparseDist got = ComputeDistribution(logits, p);
        ExpectWellFormed(got);
        ExpectSameDist(got, NaiveDistribution(logits, p));
      }
    }
  }
}

// min_p keeps exactly the tokens whose probability at the request's
// temperature is at least min_p times the likeliest one's (the whole
// support at that temperature, computed here), then top-k and top-p act on
// what is left.
TEST(ComputeDistributionTest, MinPKeepsTokensAboveTheRatioOfTheLikeliest) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 2.f);
  for (float temperature : {0.5f, 1.f, 2.f}) {
    for (float min_p : {0.01f, 0.1f, 0.5f, 1.f}) {
      std::vector<float> row(300);
      for (float& x : row) x = normal(rng);
      row[7] = NAN;
      SamplingParams full;
      full.temperature = temperature;
      const SparseDist all = ComputeDistribution(row, full);
      const float top = all[0].second;
      SamplingParams p = full;
      p.min_p = min_p;
      const SparseDist got = ComputeDistribution(row, p);
      for (int v = 0; v < 300; ++v) {
        const float pv = ProbabilityOf(all, v);
        if (std::abs(pv - min_p * top) < 1e-5f * top) continue;  // a tie
        EXPECT_EQ(ProbabilityOf(got, v) > 0.f, pv >= min_p * top)
            << "T " << temperature << " min_p " << min_p << " id " << v;
      }
      double kept_mass = 0;
      for (auto [id, prob] : got) kept_mass += ProbabilityOf(all, id);
      // Renormalised over what stays.
      for (auto [id, prob] : got) {
        EXPECT_NEAR(prob, ProbabilityOf(all, id) / kept_mass, 1e-4) << id;
      }
      // Then top-k: the min_p set's k likeliest.
      p.top_k = 2;
      const SparseDist k2 = ComputeDistribution(row, p);
      EXPECT_EQ(k2.size(), std::min<size_t>(2, got.size()));
      EXPECT_EQ(k2[0].first, got[0].first);
    }
  }
  // Greedy: no effect.
  SamplingParams greedy;
  greedy.min_p = 0.9f;
  EXPECT_EQ(ComputeDistribution(std::vector<float>{1.f, 5.f}, greedy),
            (SparseDist{{1, 1.f}}));
  EXPECT_EQ(MinPLogitThreshold(std::vector<float>{1.f, 5.f}, greedy),
            -HUGE_VAL);
}

TEST(ComputeDistributionTest, TinyTopPKeepsOneToken) {
  std::mt19937_64 gen(7);
  const std::vector<float> logits = RandomLogits(300, &gen, 1.f, false);
  const SparseDist d = ComputeDistribution(logits, {1.f, 0, 1e-9f, 0});
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].first, Argmax(logits));
  EXPECT_EQ(d[0].second, 1.f);
}

TEST(ComputeDistributionTest, TiesBreakTowardsLowerId) {
  const std::vector<float> logits = {1.f, 3.f, 0.f, 3.f, 3.f};
  // top-p tiny and top-k 1 both keep the lowest id among the tied best.
  EXPECT_EQ(ComputeDistribution(logits, {1.f, 0, 1e-6f, 0}),
            (SparseDist{{1, 1.f}}));
  EXPECT_EQ(ComputeDistribution(logits, {1.f, 1, 1.f, 0}),
            (SparseDist{{1, 1.f}}));
  // top-k 2 cuts inside the tie: ids 1 and 3, equal mass.
  EXPECT_EQ(ComputeDistribution(logits, {1.f, 2, 1.f, 0}),
            (SparseDist{{1, 0.5f}, {3, 0.5f}}));
  // top-p 0.5 over three equal tokens (1/3 each): two are needed.
  const SparseDist d = ComputeDistribution(logits, {1.f, 3, 0.5f, 0});
  EXPECT_EQ(d, (SparseDist{{1, 0.5f}, {3, 0.5f}}));
}

TEST(ComputeDistributionTest, TopPAppliesAfterTopKRenormalisation) {
  // Probabilities 0.4, 0.3, 0.2, 0.1. top-k 2 -> 4/7, 3/7; top_p 0.55 is
  // met by the first token alone only after renormalisation (4/7 > 0.55).
  const std::vector<float> logits = {std::log(0.4f), std::log(0.3f),
                                     std::log(0.2f), std::log(0.1f)};
  EXPECT_EQ(ComputeDistribution(logits, {1.f, 2, 0.55f, 0}),
            (SparseDist{{0, 1.f}}));
  const SparseDist no_k = ComputeDistribution(logits, {1.f, 0, 0.55f, 0});
  ASSERT_EQ(no_k.size(), 2u);
  EXPECT_NEAR(no_k[0].second, 4.f / 7.f, 1e-6);
}

TEST(ComputeDistributionTest, NonFiniteLogits) {
  // +inf logits share all mass; NaN is treated as -inf.
  EXPECT_EQ(ComputeDistribution(std::vector<float>{kInf, 0.f, kInf},
                                {1.f, 0, 1.f, 0}),
            (SparseDist{{0, 0.5f}, {2, 0.5f}}));
  const SparseDist d = ComputeDistribution(
      std::vector<float>{NAN, 0.f, 0.f}, {1.f, 0, 1.f, 0});
  EXPECT_EQ(d, (SparseDist{{1, 0.5f}, {2, 0.5f}}));
  EXPECT_EQ(ComputeDistribution(std::vector<float>{-kInf, -kInf},
                                {1.f, 0, 1.f, 0}),
            (SparseDist{{0, 1.f}}));
  EXPECT_TRUE(ComputeDistribution({}, {1.f, 0, 1.f, 0}).empty());
}

TEST(ComputeDistributionTest, ExtremeTemperatures) {
  const std::vector<float> logits = {0.f, 1.f, 0.5f};
  // Tiny temperature: everything but the max underflows -> one token.
  EXPECT_EQ(ComputeDistribution(logits, {1e-30f, 0, 1.f, 0}),
            (SparseDist{{1, 1.f}}));
  // Huge temperature: close to uniform, order kept.
  const SparseDist d = ComputeDistribution(logits, {1e6f, 0, 1.f, 0});
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d[0].first, 1);
  for (const auto& e : d) EXPECT_NEAR(e.second, 1.0 / 3, 1e-5);
}

TEST(RngTest, MatchesStandardMt19937_64) {
  // [rand.predef]: the 10000th output of a default-constructed mt19937_64
  // (seed 5489) is 9981545732273789042. First outputs: reference mt19937-64
  // (Matsumoto & Nishimura, init_genrand64(5489)), also in libc++'s tests.
  Rng rng(5489);
  EXPECT_EQ(rng.Next(), 14514284786278117030ull);
  EXPECT_EQ(rng.Next(), 4620546740167642908ull);
  EXPECT_EQ(rng.Next(), 13109570281517897720ull);
  EXPECT_EQ(rng.Next(), 17462938647148434322ull);
  EXPECT_EQ(rng.Next(), 355488278567739596ull);
  uint64_t last = 0;
  for (int i = 6; i <= 10000; ++i) last = rng.Next();
  EXPECT_EQ(last, 9981545732273789042ull);
}

TEST(RngTest, UniformIsTop53BitsAndReproducible) {
  Rng a(42), b(42), raw(42), other(43);
  bool differs = false;
  for (int i = 0; i < 1000; ++i) {
    const double u = a.Uniform();
    EXPECT_EQ(u, b.Uniform());
    EXPECT_EQ(u, std::ldexp(static_cast<double>(raw.Next() >> 11), -53));
    EXPECT_GE(u, 0.0);
    EXPECT_LT(u, 1.0);
    if (u != other.Uniform()) differs = true;
  }
  EXPECT_TRUE(differs);
  // 5489's first output 14514284786278117030 >> 11 = 7087053118299861,
  // / 2^53 = 0.786820 (hand-computed).
  EXPECT_NEAR(Rng(5489).Uniform(), 7087053118299861.0 / 9007199254740992.0,
              0);
}

TEST(SampleFromTest, InverseCdfWithOneDraw) {
  const SparseDist d = {{7, 0.5f}, {3, 0.3f}, {9, 0.2f}};
  for (uint64_t seed = 0; seed < 50; ++seed) {
    const double u = Rng(seed).Uniform();
    const int want = u < 0.5 ? 7 : (u < 0.8 ? 3 : 9);
    Rng rng(seed);
    EXPECT_EQ(SampleFrom(d, &rng), want) << "u=" << u;
  }
}

TEST(SampleFromTest, SkipsZerosAndHandlesEmpty) {
  Rng rng(1);
  EXPECT_EQ(SampleFrom({}, &rng), -1);
  EXPECT_EQ(SampleFrom({{4, 0.f}}, &rng), -1);
  for (int i = 0; i < 200; ++i) {
    EXPECT_EQ(SampleFrom({{1, 0.f}, {2, 1.f}, {3, 0.f}}, &rng), 2);
  }
}

TEST(SampleFromTest, FrequenciesMatchProbabilities) {
  std::mt19937_64 gen(5);
  const std::vector<float> logits = RandomLogits(30, &gen, 1.5f, false);
  const SparseDist d = ComputeDistribution(logits, {1.f, 0, 1.f, 0});
  std::vector<int64_t> counts(30, 0);
  std::vector<double> probs(30, 0.0);
  for (const auto& e : d) probs[e.first] = e.second;
  Rng rng(11);
  for (int i = 0; i < 50000; ++i) ++counts[SampleFrom(d, &rng)];
  EXPECT_GT(ChiSquareTest(counts, probs).p_value, 1e-3);
}

TEST(SampleTokenTest, GreedyNeedsNoRngAndSampledIsReproducible) {
  const std::vector<float> logits = {0.3f, 0.1f, 0.9f, 0.2f};
  EXPECT_EQ(SampleToken(logits, SamplingParams{}, nullptr), 2);
  const SamplingParams p{1.f, 3, 0.95f, 0};
  Rng a(3), b(3);
  for (int i = 0; i < 100; ++i) {
    const int t = SampleToken(logits, p, &a);
    EXPECT_EQ(t, SampleFrom(ComputeDistribution(logits, p), &b));
    EXPECT_NE(t, 1);  // outside the top-3
  }
}

}  // namespace
}  // namespace specserve
