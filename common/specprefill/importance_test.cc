#include "common/specprefill/importance.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/specprefill/selection.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using ::testing::HasSubstr;
using Aggregation = ScoringOptions::Aggregation;

// ---------------------------------------------------------------------------
// Worked example (seeds/speculative_prefill_worked_example.md, "Step-by-step
// toy example"): H=4, KV=2, S=3, D=2, one layer, one row, no pooling.
// ---------------------------------------------------------------------------
TEST(ImportanceTest, WorkedExampleGqaToy) {
  // Q_l[h, d], h = 0..3.
  const std::vector<float> queries = {1, 0, 0, 1, 1, 1, 2, 1};
  // Token s's row is [K[g=0, s, :], K[g=1, s, :]].
  const std::vector<float> keys = {1, 0, 1, 2,   // s = 0
                                   0, 1, 0, 2,   // s = 1
                                   1, 1, 2, 2};  // s = 2
  ScoringOptions opts;
  opts.pool_kernel_size = 1;
  ImportanceAccumulator acc(/*prompt_len=*/3, /*num_rows=*/1, /*num_heads=*/4,
                            /*num_kv_heads=*/2, /*head_dim=*/2,
                            /*num_layers=*/1, opts);
  ASSERT_TRUE(acc.status().ok()) << acc.status();
  ASSERT_TRUE(acc.AddLayer(0, queries.data(), keys.data(), 4).ok());
  EXPECT_TRUE(acc.complete());
  const std::vector<float> importance = acc.Importance();
  ASSERT_EQ(importance.size(), 3u);
  EXPECT_NEAR(importance[0], 0.401, 1e-3);
  EXPECT_NEAR(importance[1], 0.401, 1e-3);
  EXPECT_NEAR(importance[2], 0.768, 1e-3);

  // Top-k keep 1/2: k = ceil(1.5) = 2 -> tokens [0, 2]; forcing the last
  // token changes nothing (it is already kept).
  SelectionOptions sel_opts;
  sel_opts.keep_ratio = 0.5f;
  sel_opts.chunk_size = 1;
  sel_opts.keep_first = 0;
  sel_opts.keep_last = 0;
  absl::StatusOr<Selection> sel = SelectTokens(importance, sel_opts);
  ASSERT_TRUE(sel.ok()) << sel.status();
  EXPECT_EQ(sel->kept_indices, (std::vector<int>{0, 2}));
  sel_opts.keep_last = 1;
  sel = SelectTokens(importance, sel_opts);
  ASSERT_TRUE(sel.ok()) << sel.status();
  EXPECT_EQ(sel->kept_indices, (std::vector<int>{0, 2}));
  EXPECT_EQ(sel->position_ids, (std::vector<int>{0, 2}));
  EXPECT_EQ(sel->next_position, 3);
}

// The worked example's 6-token smoothing step: P[L0, H0, step 0] ->
// Smooth[L0, H0, step 0]. Kernel 3 (padding 1, count_include_pad) reproduces
// every printed value to the 4 decimals given, e.g. (0 + 0.0924 + 0.7706)/3
// = 0.2877 and (0.0111 + 0.0924 + 0)/3 = 0.0345; kernels 1 and 5 do not.
// (The example's "Max over (L,H)" and final importance need the full score
// tensor, which the example does not print, so only the selection step from
// its importance vector is tested, in selection_test.)
TEST(AvgPool1dTest, WorkedExampleSixTokensIsKernelThree) {
  const std::vector<float> p = {0.0924f, 0.7706f, 0.0225f,
                                0.0111f, 0.0111f, 0.0924f};
  const std::vector<float> smooth = {0.2877f, 0.2952f, 0.2681f,
                                     0.0149f, 0.0382f, 0.0345f};
  const std::vector<float> k3 = AvgPool1d(p, 3);
  ASSERT_EQ(k3.size(), smooth.size());
  for (size_t i = 0; i < smooth.size(); ++i) {
    EXPECT_NEAR(k3[i], smooth[i], 1e-4) << "i=" << i;
  }
  for (int kernel : {1, 5}) {
    const std::vector<float> other = AvgPool1d(p, kernel);
    float worst = 0.0f;
    for (size_t i = 0; i < smooth.size(); ++i) {
      worst = std::max(worst, std::abs(other[i] - smooth[i]));
    }
    EXPECT_GT(worst, 1e-2) << "kernel " << kernel;
  }
}

// avg_pool1d(kernel k, stride 1, padding k/2, count_include_pad=True), the
// obvious O(n k) way in double.
std::vector<double> NaivePool(const std::vector<double>& x, int k) {
  const int n = static_cast<int>(x.size());
  std::vector<double> out(n, 0.0);
  for (int j = 0; j < n; ++j) {
    double s = 0.0;
    for (int t = j - k / 2; t <= j + k / 2; ++t) {
      if (t >= 0 && t < n) s += x[t];
    }
    out[j] = s / k;
  }
  return out;
}

TEST(AvgPool1dTest, MatchesNaiveForManyLengthsAndKernels) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int n : {1, 2, 3, 7, 8, 9, 16, 31, 100, 1000}) {
    for (int k : {1, 3, 5, 7, 9, 13, 15, 31, 33}) {
      std::vector<float> x(n);
      for (float& v : x) v = u(rng);
      const std::vector<double> xd(x.begin(), x.end());
      const std::vector<double> ref = NaivePool(xd, k);
      const std::vector<float> got = AvgPool1d(x, k);
      ASSERT_EQ(got.size(), x.size());
      for (int j = 0; j < n; ++j) {
        ASSERT_NEAR(got[j], ref[j], 1e-6)
            << "n=" << n << " k=" << k << " j=" << j;
      }
    }
  }
}

// Values spanning 9 orders of magnitude: each output must stay accurate
// relative to ITS window, not to the largest value in the row (which a
// running fp32 sum would not guarantee).
TEST(AvgPool1dTest, SmallValuesNextToLargeOnesKeepRelativeAccuracy) {
  std::vector<float> x(4096);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(1e-9f, 2e-9f);
  for (float& v : x) v = u(rng);
  for (int i = 0; i < 4096; i += 97) x[i] = 1.0f;
  const std::vector<double> ref = NaivePool({x.begin(), x.end()}, 13);
  const std::vector<float> got = AvgPool1d(x, 13);
  for (size_t j = 0; j < x.size(); ++j) {
    ASSERT_NEAR(got[j], ref[j], 1e-5 * ref[j]) << "j=" << j;
  }
}

// ---------------------------------------------------------------------------
// Random problems against a naive reference that materialises the whole
// [layers, heads, rows, n] score tensor in double.
// ---------------------------------------------------------------------------
struct Problem {
  int n, rows, heads, kv_heads, dim, layers;
  size_t stride;         // floats between token rows
  int extra_key_rows;    // rows after the prompt (must not be read)
  std::vector<float> q;  // [layers][rows][heads][dim]
  std::vector<float> k;  // [layers][(n + extra) * stride]

  const float* Queries(int l) const {
    return q.data() + static_cast<size_t>(l) * rows * heads * dim;
  }
  const float* Keys(int l) const {
    return k.data() + static_cast<size_t>(l) * (n + extra_key_rows) * stride;
  }
};

Problem MakeProblem(int n, int rows, int heads, int kv_heads, int dim,
                    int layers, int stride_pad, int extra_key_rows,
                    unsigned seed) {
  Problem p{n,
            rows,
            heads,
            kv_heads,
            dim,
            layers,
            static_cast<size_t>(kv_heads) * dim + stride_pad,
            extra_key_rows,
            {},
            {}};
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  p.q.resize(static_cast<size_t>(layers) * rows * heads * dim);
  for (float& v : p.q) v = normal(rng);
  // Stride padding and rows past the prompt hold NaN: reading them would
  // poison the result.
  p.k.assign(static_cast<size_t>(layers) * (n + extra_key_rows) * p.stride,
             std::numeric_limits<float>::quiet_NaN());
  for (int l = 0; l < layers; ++l) {
    for (int t = 0; t < n; ++t) {
      float* row =
          p.k.data() +
          (static_cast<size_t>(l) * (n + extra_key_rows) + t) * p.stride;
      for (int i = 0; i < kv_heads * dim; ++i) row[i] = normal(rng);
    }
  }
  return p;
}

std::vector<std::vector<double>> NaivePerRow(const Problem& p,
                                             const ScoringOptions& opts) {
  const int first_layer =
      opts.num_layers_used == 0 ? 0 : p.layers - opts.num_layers_used;
  const int used = p.layers - first_layer;
  // scores[l][h][r][j] for the used layers.
  std::vector<double> scores(static_cast<size_t>(used) * p.heads * p.rows *
                             p.n);
  auto at = [&](int l, int h, int r, int j) -> double& {
    return scores[((static_cast<size_t>(l) * p.heads + h) * p.rows + r) * p.n +
                  j];
  };
  const int group = p.heads / p.kv_heads;
  for (int l = 0; l < used; ++l) {
    const float* q = p.Queries(first_layer + l);
    const float* keys = p.Keys(first_layer + l);
    for (int h = 0; h < p.heads; ++h) {
      const int g = h / group;
      for (int r = 0; r < p.rows; ++r) {
        std::vector<double> logits(p.n);
        for (int j = 0; j < p.n; ++j) {
          double dot = 0.0;
          for (int d = 0; d < p.dim; ++d) {
            dot += static_cast<double>(
                       q[(static_cast<size_t>(r) * p.heads + h) * p.dim + d]) *
                   keys[j * p.stride + g * p.dim + d];
          }
          logits[j] = dot / std::sqrt(static_cast<double>(p.dim));
        }
        const double mx = *std::max_element(logits.begin(), logits.end());
        double sum = 0.0;
        for (double& v : logits) sum += (v = std::exp(v - mx));
        for (double& v : logits) v /= sum;
        const std::vector<double> pooled =
            NaivePool(logits, opts.pool_kernel_size);
        for (int j = 0; j < p.n; ++j) at(l, h, r, j) = pooled[j];
      }
    }
  }
  std::vector<std::vector<double>> out(p.rows, std::vector<double>(p.n));
  for (int r = 0; r < p.rows; ++r) {
    for (int j = 0; j < p.n; ++j) {
      double agg =
          opts.head_layer_aggregation == Aggregation::kMax ? -1.0 : 0.0;
      for (int l = 0; l < used; ++l) {
        for (int h = 0; h < p.heads; ++h) {
          if (opts.head_layer_aggregation == Aggregation::kMax) {
            agg = std::max(agg, at(l, h, r, j));
          } else {
            agg += at(l, h, r, j);
          }
        }
      }
      if (opts.head_layer_aggregation == Aggregation::kMean) {
        agg /= static_cast<double>(used) * p.heads;
      }
      out[r][j] = agg;
    }
  }
  return out;
}

ImportanceAccumulator RunAccumulator(const Problem& p,
                                     const ScoringOptions& opts, int threads) {
  ImportanceAccumulator acc(p.n, p.rows, p.heads, p.kv_heads, p.dim, p.layers,
                            opts);
  EXPECT_TRUE(acc.status().ok()) << acc.status();
  acc.set_num_threads(threads);
  // Every layer is passed in; unused ones must be ignored.
  for (int l = 0; l < p.layers; ++l) {
    const absl::Status s = acc.AddLayer(l, p.Queries(l), p.Keys(l), p.stride);
    EXPECT_TRUE(s.ok()) << s;
  }
  EXPECT_TRUE(acc.complete());
  return acc;
}

struct RandomCase {
  int n, rows, heads, kv_heads, dim, layers, kernel, layers_used;
  Aggregation agg;
  int stride_pad, extra_rows;
};

std::string CaseName(const RandomCase& c) {
  return absl::StrCat("n=", c.n, " rows=", c.rows, " H=", c.heads,
                      " KV=", c.kv_heads, " D=", c.dim, " L=", c.layers,
                      " k=", c.kernel, " used=", c.layers_used,
                      " agg=", c.agg == Aggregation::kMax ? "max" : "mean",
                      " pad=", c.stride_pad, " extra=", c.extra_rows);
}

TEST(ImportanceAccumulatorTest, MatchesNaiveReference) {
  const std::vector<RandomCase> cases = {
      // GQA group 1 (MHA); scalar key packing (D=2, 12), AVX2 (D=8, 64).
      {37, 1, 2, 2, 2, 2, 1, 0, Aggregation::kMax, 0, 0},
      {37, 3, 2, 2, 12, 3, 5, 0, Aggregation::kMax, 3, 2},
      {100, 2, 4, 4, 8, 2, 13, 0, Aggregation::kMean, 0, 5},
      // Group 3: rows * group = 9 exercises the 4-query blocks and a tail.
      {65, 3, 6, 2, 16, 3, 3, 2, Aggregation::kMax, 7, 1},
      {17, 5, 6, 2, 8, 2, 13, 1, Aggregation::kMean, 1, 0},
      // Group 4 (Llama-3.2-1B ratio) with head_dim 64.
      {300, 5, 8, 2, 64, 4, 13, 2, Aggregation::kMax, 16, 4},
      {129, 9, 8, 2, 64, 2, 7, 0, Aggregation::kMean, 0, 0},
      // Kernel longer than the prompt; one-token prompt.
      {5, 2, 4, 1, 8, 2, 13, 0, Aggregation::kMax, 0, 3},
      {1, 2, 4, 2, 8, 1, 3, 0, Aggregation::kMax, 0, 0},
      {16, 1, 4, 2, 64, 1, 1, 1, Aggregation::kMax, 0, 0},
  };
  unsigned seed = 1;
  for (const RandomCase& c : cases) {
    SCOPED_TRACE(CaseName(c));
    const Problem p = MakeProblem(c.n, c.rows, c.heads, c.kv_heads, c.dim,
                                  c.layers, c.stride_pad, c.extra_rows, seed++);
    ScoringOptions opts;
    opts.pool_kernel_size = c.kernel;
    opts.num_layers_used = c.layers_used;
    opts.head_layer_aggregation = c.agg;
    const std::vector<std::vector<double>> ref = NaivePerRow(p, opts);
    const ImportanceAccumulator acc = RunAccumulator(p, opts, 1);
    const std::vector<std::vector<float>> got = acc.PerRowImportance();
    ASSERT_EQ(got.size(), static_cast<size_t>(c.rows));
    std::vector<double> ref_mean(c.n, 0.0);
    for (int r = 0; r < c.rows; ++r) {
      ASSERT_EQ(got[r].size(), static_cast<size_t>(c.n));
      for (int j = 0; j < c.n; ++j) {
        ASSERT_NEAR(got[r][j], ref[r][j], 1e-7 + 1e-4 * ref[r][j])
            << "row " << r << " token " << j;
        ref_mean[j] += ref[r][j] / c.rows;
      }
    }
    // Threads split the key range and the kv heads; same bits expected.
    EXPECT_EQ(RunAccumulator(p, opts, 3).PerRowImportance(), got);
    const std::vector<float> importance = acc.Importance();
    ASSERT_EQ(importance.size(), static_cast<size_t>(c.n));
    for (int j = 0; j < c.n; ++j) {
      ASSERT_NEAR(importance[j], ref_mean[j], 1e-7 + 1e-4 * ref_mean[j])
          << "token " << j;
    }
  }
}

TEST(ImportanceAccumulatorTest, ResultDoesNotDependOnThreadCount) {
  const Problem p = MakeProblem(333, 9, 8, 2, 64, 3, 0, 0, 99);
  for (Aggregation agg : {Aggregation::kMax, Aggregation::kMean}) {
    ScoringOptions opts;
    opts.head_layer_aggregation = agg;
    const std::vector<std::vector<float>> one =
        RunAccumulator(p, opts, 1).PerRowImportance();
    for (int threads : {2, 3, 5, 16}) {
      EXPECT_EQ(RunAccumulator(p, opts, threads).PerRowImportance(), one)
          << "threads=" << threads;
    }
  }
}

TEST(ImportanceAccumulatorTest, ExtremeLogitsStayFinite) {
  // One key aligned with the query at a huge scale, the rest opposed: the
  // softmax is one-hot, others underflow to 0 and nothing becomes NaN.
  const int n = 40, dim = 8;
  std::vector<float> q(dim, 0.0f);
  q[0] = 100.0f;
  std::vector<float> keys(n * dim, 0.0f);
  for (int t = 0; t < n; ++t) keys[t * dim] = (t == 17) ? 100.0f : -100.0f;
  ScoringOptions opts;
  opts.pool_kernel_size = 1;
  ImportanceAccumulator acc(n, 1, 1, 1, dim, 1, opts);
  ASSERT_TRUE(acc.AddLayer(0, q.data(), keys.data(), dim).ok());
  const std::vector<float> imp = acc.Importance();
  for (int t = 0; t < n; ++t) {
    ASSERT_TRUE(std::isfinite(imp[t]));
    EXPECT_FLOAT_EQ(imp[t], t == 17 ? 1.0f : 0.0f) << t;
  }
  // Equal logits: uniform 1/n (pooled with zero padding at the edges).
  std::fill(keys.begin(), keys.end(), 0.5f);
  ImportanceAccumulator uniform(n, 1, 1, 1, dim, 1, ScoringOptions{});
  ASSERT_TRUE(uniform.AddLayer(0, q.data(), keys.data(), dim).ok());
  const std::vector<float> u = uniform.Importance();
  EXPECT_NEAR(u[20], 1.0f / n, 1e-7);
  EXPECT_NEAR(u[0], 7.0f / 13.0f / n, 1e-7);  // 6 of 13 taps are padding
}

TEST(ImportanceAccumulatorTest, UsesLayerFollowsNumLayersUsed) {
  ScoringOptions opts;
  ImportanceAccumulator all(4, 1, 1, 1, 8, 5, opts);
  for (int l = 0; l < 5; ++l) EXPECT_TRUE(all.UsesLayer(l)) << l;
  EXPECT_FALSE(all.UsesLayer(-1));
  EXPECT_FALSE(all.UsesLayer(5));
  opts.num_layers_used = 2;
  ImportanceAccumulator last2(4, 1, 1, 1, 8, 5, opts);
  EXPECT_FALSE(last2.UsesLayer(2));
  EXPECT_TRUE(last2.UsesLayer(3));
  EXPECT_TRUE(last2.UsesLayer(4));
}

TEST(ImportanceAccumulatorTest, LayerBookkeepingAndArgumentErrors) {
  const Problem p = MakeProblem(10, 1, 2, 1, 8, 3, 0, 0, 5);
  ScoringOptions opts;
  opts.num_layers_used = 2;
  ImportanceAccumulator acc(10, 1, 2, 1, 8, 3, opts);
  ASSERT_TRUE(acc.status().ok());
  EXPECT_EQ(acc.Importance(), std::vector<float>(10, 0.0f));
  // Unused layer: accepted, ignored.
  EXPECT_TRUE(acc.AddLayer(0, p.Queries(0), p.Keys(0), p.stride).ok());
  EXPECT_EQ(acc.layers_added(), 0);
  EXPECT_TRUE(acc.AddLayer(2, p.Queries(2), p.Keys(2), p.stride).ok());
  EXPECT_EQ(acc.layers_added(), 1);
  EXPECT_FALSE(acc.complete());
  absl::Status s = acc.AddLayer(2, p.Queries(2), p.Keys(2), p.stride);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("already added"));
  s = acc.AddLayer(3, p.Queries(1), p.Keys(1), p.stride);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("layer 3"));
  s = acc.AddLayer(1, nullptr, p.Keys(1), p.stride);
  EXPECT_THAT(s.message(), HasSubstr("queries"));
  s = acc.AddLayer(1, p.Queries(1), nullptr, p.stride);
  EXPECT_THAT(s.message(), HasSubstr("keys"));
  s = acc.AddLayer(1, p.Queries(1), p.Keys(1), 7);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("key_row_stride"));
  EXPECT_TRUE(acc.AddLayer(1, p.Queries(1), p.Keys(1), p.stride).ok());
  EXPECT_TRUE(acc.complete());
}

TEST(ImportanceAccumulatorTest, InvalidShapesAndOptionsAreReported) {
  ScoringOptions opts;
  const std::tuple<int, int, int, int, int, int, const char*> bad[] = {
      {0, 1, 4, 2, 8, 2, "prompt_len"},   {5, 0, 4, 2, 8, 2, "num_rows"},
      {5, 1, 0, 2, 8, 2, "num_heads"},    {5, 1, 4, 0, 8, 2, "num_kv_heads"},
      {5, 1, 4, 3, 8, 2, "num_kv_heads"}, {5, 1, 4, 2, 0, 2, "head_dim"},
      {5, 1, 4, 2, 8, 0, "num_layers"},
  };
  for (const auto& [n, rows, h, kv, d, l, field] : bad) {
    ImportanceAccumulator acc(n, rows, h, kv, d, l, opts);
    EXPECT_EQ(acc.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(acc.status().message(), HasSubstr(field));
    const float dummy[64] = {};
    EXPECT_EQ(acc.AddLayer(0, dummy, dummy, 64).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(acc.Importance().empty());
    EXPECT_FALSE(
        ImportanceAccumulator::Create(n, rows, h, kv, d, l, opts).ok());
  }
  opts.pool_kernel_size = 4;
  absl::StatusOr<ImportanceAccumulator> acc =
      ImportanceAccumulator::Create(5, 1, 4, 2, 8, 2, opts);
  ASSERT_FALSE(acc.ok());
  EXPECT_THAT(acc.status().message(), HasSubstr("pool_kernel_size"));
  EXPECT_TRUE(ImportanceAccumulator::Create(5, 1, 4, 2, 8, 2, {}).ok());
}

TEST(ValidateScoringOptionsTest, NamesTheField) {
  ScoringOptions opts;
  EXPECT_TRUE(ValidateScoringOptions(opts, 16).ok());
  opts.pool_kernel_size = 1;
  EXPECT_TRUE(ValidateScoringOptions(opts, 16).ok());
  for (int k : {0, -3, 2, 12}) {
    opts.pool_kernel_size = k;
    const absl::Status s = ValidateScoringOptions(opts, 16);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k;
    EXPECT_THAT(s.message(), HasSubstr("pool_kernel_size"));
  }
  opts = ScoringOptions{};
  opts.num_layers_used = 16;
  EXPECT_TRUE(ValidateScoringOptions(opts, 16).ok());
  for (int used : {-1, 17}) {
    opts.num_layers_used = used;
    const absl::Status s = ValidateScoringOptions(opts, 16);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << used;
    EXPECT_THAT(s.message(), HasSubstr("num_layers_used"));
  }
  opts = ScoringOptions{};
  opts.head_layer_aggregation = static_cast<Aggregation>(7);
  EXPECT_THAT(ValidateScoringOptions(opts, 16).message(),
              HasSubstr("head_layer_aggregation"));
}

}  // namespace
}  // namespace specserve
