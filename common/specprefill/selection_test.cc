#include "common/specprefill/selection.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace {

using ::testing::HasSubstr;

// Worked example (seeds/speculative_prefill_worked_example.md, section 3):
// importance of 6 tokens, chunks of 2, keep 50% -> ceil(3 * 0.5) = 2 chunks.
// Chunk means 0.2671, 0.2723, 0.16115 -> chunks {0, 1} = tokens 0..3, plus
// the always-kept last token 5.
TEST(SelectTokensTest, WorkedExampleSixTokens) {
  const std::vector<float> importance = {0.2321f, 0.3021f, 0.2894f,
                                         0.2552f, 0.2060f, 0.1163f};
  for (int keep_first : {0, 1}) {
    SelectionOptions opts;
    opts.keep_ratio = 0.5f;
    opts.chunk_size = 2;
    opts.keep_first = keep_first;
    opts.keep_last = 1;
    absl::StatusOr<Selection> sel = SelectTokens(importance, opts);
    ASSERT_TRUE(sel.ok()) << sel.status();
    EXPECT_EQ(sel->kept_chunks, (std::vector<int>{0, 1}));
    EXPECT_EQ(sel->kept_indices, (std::vector<int>{0, 1, 2, 3, 5}));
    EXPECT_EQ(sel->position_ids, sel->kept_indices);
    EXPECT_EQ(sel->next_position, 6);
    ASSERT_EQ(sel->chunk_scores.size(), 3u);
    EXPECT_NEAR(sel->chunk_scores[0], 0.2671, 1e-6);
    EXPECT_NEAR(sel->chunk_scores[1], 0.2723, 1e-6);
    EXPECT_NEAR(sel->chunk_scores[2], 0.16115, 1e-6);
  }
}

// The paper's position-restoration example (section 3.2.4): ten prompt
// tokens, kept [0, 1, 3, 6, 7], decoding continues at 10.
TEST(SelectTokensTest, PaperPositionRestorationExample) {
  std::vector<float> importance(10, 0.0f);
  for (int i : {0, 1, 3, 6, 7}) importance[i] = 1.0f + i;
  SelectionOptions opts;
  opts.keep_ratio = 0.5f;
  opts.chunk_size = 1;
  opts.keep_first = 0;
  opts.keep_last = 0;
  absl::StatusOr<Selection> sel = SelectTokens(importance, opts);
  ASSERT_TRUE(sel.ok()) << sel.status();
  EXPECT_EQ(sel->position_ids, (std::vector<int>{0, 1, 3, 6, 7}));
  EXPECT_EQ(sel->next_position, 10);
}

TEST(NumChunksToKeepTest, CeilWithFloatRatioGuard) {
  EXPECT_EQ(NumChunksToKeep(10, 0.3f), 3);  // 10 * 0.3f = 3.0000001
  EXPECT_EQ(NumChunksToKeep(100, 0.1f), 10);
  EXPECT_EQ(NumChunksToKeep(1000, 0.7f), 700);
  EXPECT_EQ(NumChunksToKeep(19, 0.5f), 10);  // 9.5 -> 10
  EXPECT_EQ(NumChunksToKeep(3, 0.5f), 2);
  EXPECT_EQ(NumChunksToKeep(3, 0.34f), 2);  // 1.02 -> 2
  EXPECT_EQ(NumChunksToKeep(7, 1.0f), 7);
  EXPECT_EQ(NumChunksToKeep(1, 0.1f), 1);
  EXPECT_EQ(NumChunksToKeep(5, 1e-6f), 1);  // never zero
  // Every decimal ratio 0.01 .. 1.00 against exact integer arithmetic.
  for (int pct = 1; pct <= 100; ++pct) {
    for (int chunks : {1, 3, 7, 10, 19, 64, 100, 257, 1024}) {
      const int expected = std::max(1, (chunks * pct + 99) / 100);
      EXPECT_EQ(NumChunksToKeep(chunks, pct / 100.0f), expected)
          << chunks << " chunks at " << pct << "%";
    }
  }
}

// ---------------------------------------------------------------------------
// Goldens: tests/data/golden/specprefill_case{1,2}.json (README there), made
// with NO forced keeps.
// ---------------------------------------------------------------------------
nlohmann::json LoadGolden(const std::string& name) {
  const std::string path = "tests/data/golden/" + name;
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str());
}

void CheckGolden(const std::string& name, int chunk_size, float keep) {
  SCOPED_TRACE(name);
  const nlohmann::json g = LoadGolden(name);
  const auto importance = g.at("importance").get<std::vector<float>>();
  const auto per_row =
      g.at("per_row_importance").get<std::vector<std::vector<double>>>();
  const int n = g.at("n_prompt").get<int>();
  ASSERT_EQ(importance.size(), static_cast<size_t>(n));
  ASSERT_EQ(per_row.size(), g.at("params").at("n_query_rows").get<size_t>());
  EXPECT_EQ(g.at("params").at("chunk_size").get<int>(), chunk_size);
  EXPECT_FLOAT_EQ(g.at("params").at("keep_fraction").get<float>(), keep);
  const int num_chunks = g.at("params").at("n_chunks").get<int>();
  EXPECT_EQ(num_chunks, (n + chunk_size - 1) / chunk_size);
  EXPECT_EQ(NumChunksToKeep(num_chunks, keep),
            g.at("params").at("n_kept_chunks").get<int>());

  // importance == mean over rows of per_row_importance.
  for (int j = 0; j < n; ++j) {
    double mean = 0.0;
    for (const auto& row : per_row) mean += row.at(j);
    mean /= per_row.size();
    ASSERT_NEAR(importance[j], mean, 1e-4) << "token " << j;
  }

  SelectionOptions opts;
  opts.keep_ratio = keep;
  opts.chunk_size = chunk_size;
  opts.keep_first = 0;
  opts.keep_last = 0;
  absl::StatusOr<Selection> sel = SelectTokens(importance, opts);
  ASSERT_TRUE(sel.ok()) << sel.status();
  EXPECT_EQ(sel->kept_indices,
            g.at("kept_token_indices").get<std::vector<int>>());
  EXPECT_EQ(sel->kept_chunks, g.at("kept_chunks").get<std::vector<int>>());
  EXPECT_EQ(sel->position_ids, sel->kept_indices);
  EXPECT_EQ(sel->next_position, n);
  const auto chunk_scores = g.at("chunk_scores").get<std::vector<double>>();
  ASSERT_EQ(sel->chunk_scores.size(), chunk_scores.size());
  for (size_t c = 0; c < chunk_scores.size(); ++c) {
    EXPECT_NEAR(sel->chunk_scores[c], chunk_scores[c], 1e-4) << "chunk " << c;
  }
}

TEST(SelectTokensGoldenTest, Case1LookAhead4Pool13Chunk32Keep03) {
  CheckGolden("specprefill_case1.json", 32, 0.3f);
}

TEST(SelectTokensGoldenTest, Case2NoLookAheadChunk16Keep05) {
  CheckGolden("specprefill_case2.json", 16, 0.5f);
}

// ---------------------------------------------------------------------------
// Properties on random inputs.
// ---------------------------------------------------------------------------
TEST(SelectTokensTest, PropertiesOnRandomInputs) {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int trial = 0; trial < 500; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 300);
    std::vector<float> importance(n);
    // Coarse values so ties happen.
    for (float& v : importance) v = std::floor(u(rng) * 8.0f) / 8.0f;
    SelectionOptions opts;
    opts.keep_ratio = 0.01f + 0.98f * u(rng);
    opts.chunk_size = 1 + static_cast<int>(rng() % 40);
    opts.keep_first = static_cast<int>(rng() % 4);
    opts.keep_last = static_cast<int>(rng() % 4);
    absl::StatusOr<Selection> sel = SelectTokens(importance, opts);
    ASSERT_TRUE(sel.ok()) << sel.status();
    const std::vector<int>& kept = sel->kept_indices;

    // Sorted, unique, in range.
    ASSERT_FALSE(kept.empty());
    EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()));
    EXPECT_EQ(std::adjacent_find(kept.begin(), kept.end()), kept.end());
    EXPECT_GE(kept.front(), 0);
    EXPECT_LT(kept.back(), n);
    EXPECT_EQ(sel->position_ids, kept);
    EXPECT_EQ(sel->next_position, n);

    // Chunk count follows the ceil rule; chosen chunks outrank the rest
    // (ties: lower index wins).
    const int num_chunks = (n + opts.chunk_size - 1) / opts.chunk_size;
    ASSERT_EQ(sel->chunk_scores.size(), static_cast<size_t>(num_chunks));
    const int k = NumChunksToKeep(num_chunks, opts.keep_ratio);
    EXPECT_EQ(
        k, std::max(1, static_cast<int>(std::ceil(
                           num_chunks * static_cast<double>(opts.keep_ratio) -
                           1e-4))));
    ASSERT_EQ(sel->kept_chunks.size(), static_cast<size_t>(k));
    EXPECT_TRUE(
        std::is_sorted(sel->kept_chunks.begin(), sel->kept_chunks.end()));
    const std::set<int> chosen(sel->kept_chunks.begin(),
                               sel->kept_chunks.end());
    for (int a : chosen) {
      for (int b = 0; b < num_chunks; ++b) {
        if (chosen.count(b)) continue;
        const float sa = sel->chunk_scores[a], sb = sel->chunk_scores[b];
        EXPECT_TRUE(sa > sb || (sa == sb && a < b))
            << "chunk " << a << " kept over " << b;
      }
    }
    // Chunk score = mean of its tokens.
    for (int c = 0; c < num_chunks; ++c) {
      const int end = std::min(n, (c + 1) * opts.chunk_size);
      double sum = 0.0;
      for (int i = c * opts.chunk_size; i < end; ++i) sum += importance[i];
      EXPECT_NEAR(sel->chunk_scores[c], sum / (end - c * opts.chunk_size),
                  1e-6);
    }

    // Kept set == tokens of chosen chunks U forced first/last.
    std::set<int> expected;
    for (int c : chosen) {
      for (int i = c * opts.chunk_size;
           i < std::min(n, (c + 1) * opts.chunk_size); ++i) {
        expected.insert(i);
      }
    }
    for (int i = 0; i < std::min(n, opts.keep_first); ++i) expected.insert(i);
    for (int i = std::max(0, n - opts.keep_last); i < n; ++i) {
      expected.insert(i);
    }
    EXPECT_EQ(kept, std::vector<int>(expected.begin(), expected.end()));
  }
}

TEST(SelectTokensTest, ChunkSizeOneIsTokenLevelTopK) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> importance(97);
  for (float& v : importance) v = u(rng);  // distinct almost surely
  SelectionOptions opts;
  opts.chunk_size = 1;
  opts.keep_ratio = 0.25f;
  opts.keep_first = 0;
  opts.keep_last = 0;
  absl::StatusOr<Selection> sel = SelectTokens(importance, opts);
  ASSERT_TRUE(sel.ok());
  std::vector<int> order(importance.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return importance[a] > importance[b]; });
  std::vector<int> top(order.begin(), order.begin() + 25);  // ceil(24.25)
  std::sort(top.begin(), top.end());
  EXPECT_EQ(sel->kept_indices, top);
  EXPECT_EQ(sel->kept_chunks, top);
}

TEST(SelectTokensTest, ChunkSizeBeyondThePromptIsOneChunk) {
  // Regression (libFuzzer, speculator request_fuzz_test): a chunk_size near
  // INT_MAX overflowed ceil(n / chunk_size) as n + chunk_size - 1.
  const std::vector<float> importance = {0.1f, 0.9f, 0.3f, 0.2f, 0.5f,
                                         0.4f, 0.7f, 0.6f, 0.8f};
  SelectionOptions opts;
  opts.chunk_size = std::numeric_limits<int>::max() - 4;
  opts.keep_ratio = 0.5f;
  absl::StatusOr<Selection> sel = SelectTokens(importance, opts);
  ASSERT_TRUE(sel.ok()) << sel.status();
  ASSERT_EQ(sel->chunk_scores.size(), 1u);
  EXPECT_NEAR(sel->chunk_scores[0], 0.5f, 1e-6);
  EXPECT_EQ(sel->kept_chunks, std::vector<int>({0}));
  EXPECT_EQ(sel->kept_indices.size(), importance.size());
}

TEST(SelectTokensTest, TiesPreferEarlierChunks) {
  const std::vector<float> importance(8, 0.5f);
  SelectionOptions opts;
  opts.chunk_size = 2;
  opts.keep_ratio = 0.5f;
  opts.keep_first = 0;
  opts.keep_last = 0;
  absl::StatusOr<Selection> sel = SelectTokens(importance, opts);
  ASSERT_TRUE(sel.ok());
  EXPECT_EQ(sel->kept_chunks, (std::vector<int>{0, 1}));
  EXPECT_EQ(sel->kept_indices, (std::vector<int>{0, 1, 2, 3}));
}

TEST(SelectTokensTest, ShortLastChunkUsesItsOwnMean) {
  // 5 tokens, chunks of 2: the last chunk is {4} alone with mean 0.9.
  const std::vector<float> importance = {0.5f, 0.5f, 1.0f, 0.0f, 0.9f};
  SelectionOptions opts;
  opts.chunk_size = 2;
  opts.keep_ratio = 0.3f;  // ceil(0.9) = 1 chunk
  opts.keep_first = 1;
  opts.keep_last = 0;
  absl::StatusOr<Selection> sel = SelectTokens(importance, opts);
  ASSERT_TRUE(sel.ok());
  EXPECT_EQ(sel->kept_chunks, (std::vector<int>{2}));
  EXPECT_EQ(sel->kept_indices, (std::vector<int>{0, 4}));
}

TEST(SelectTokensTest, KeepAllCases) {
  std::vector<float> importance(50);
  std::iota(importance.begin(), importance.end(), 0.0f);
  std::vector<int> all(50);
  std::iota(all.begin(), all.end(), 0);

  SelectionOptions opts;
  opts.keep_ratio = 1.0f;
  absl::StatusOr<Selection> sel = SelectTokens(importance, opts);
  ASSERT_TRUE(sel.ok());
  EXPECT_EQ(sel->kept_indices, all);
  EXPECT_EQ(sel->kept_chunks, (std::vector<int>{0, 1}));

  // Shorter than min_prompt_tokens: unpruned; at the threshold: pruned.
  opts.keep_ratio = 0.1f;
  opts.chunk_size = 5;
  opts.min_prompt_tokens = 51;
  sel = SelectTokens(importance, opts);
  ASSERT_TRUE(sel.ok());
  EXPECT_EQ(sel->kept_indices, all);
  EXPECT_EQ(sel->next_position, 50);
  opts.min_prompt_tokens = 50;
  sel = SelectTokens(importance, opts);
  ASSERT_TRUE(sel.ok());
  EXPECT_EQ(sel->kept_chunks, (std::vector<int>{9}));
  EXPECT_EQ(sel->kept_indices, (std::vector<int>{0, 45, 46, 47, 48, 49}));

  // Forced keeps longer than the prompt are clamped.
  opts.keep_first = 100;
  opts.keep_last = 100;
  sel = SelectTokens(importance, opts);
  ASSERT_TRUE(sel.ok());
  EXPECT_EQ(sel->kept_indices, all);
}

TEST(SelectTokensTest, RejectsInvalidInput) {
  const std::vector<float> importance = {0.1f, 0.2f};
  struct Bad {
    SelectionOptions opts;
    const char* field;
  };
  std::vector<Bad> bad;
  for (float r : {0.0f, -0.5f, 1.5f, std::numeric_limits<float>::quiet_NaN()}) {
    SelectionOptions o;
    o.keep_ratio = r;
    bad.push_back({o, "keep_ratio"});
  }
  {
    SelectionOptions o;
    o.chunk_size = 0;
    bad.push_back({o, "chunk_size"});
    o = SelectionOptions{};
    o.keep_first = -1;
    bad.push_back({o, "keep_first"});
    o = SelectionOptions{};
    o.keep_last = -2;
    bad.push_back({o, "keep_last"});
    o = SelectionOptions{};
    o.min_prompt_tokens = -1;
    bad.push_back({o, "min_prompt_tokens"});
    for (float m : {-0.1f, 1.01f, std::numeric_limits<float>::quiet_NaN()}) {
      o = SelectionOptions{};
      o.keep_mass = m;
      bad.push_back({o, "keep_mass"});
    }
  }
  for (const Bad& b : bad) {
    const absl::Status v = ValidateSelectionOptions(b.opts);
    EXPECT_EQ(v.code(), absl::StatusCode::kInvalidArgument) << b.field;
    EXPECT_THAT(v.message(), HasSubstr(b.field));
    const absl::StatusOr<Selection> sel = SelectTokens(importance, b.opts);
    EXPECT_EQ(sel.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(sel.status().message(), HasSubstr(b.field));
  }
  EXPECT_TRUE(ValidateSelectionOptions(SelectionOptions{}).ok());

  EXPECT_EQ(SelectTokens({}, SelectionOptions{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<float> with_nan = {
      0.1f, std::numeric_limits<float>::quiet_NaN(), 0.3f};
  const absl::StatusOr<Selection> sel =
      SelectTokens(with_nan, SelectionOptions{});
  EXPECT_EQ(sel.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(sel.status().message(), HasSubstr("importance[1]"));
}

}  // namespace
}  // namespace specserve

namespace specserve {
namespace {

// Keep by mass: the fewest top chunks whose summed importance reaches the
// fraction, checked against a brute-force count on random prompts.
TEST(SelectTokensTest, KeepMassKeepsFewestChunksReachingTheMass) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  int below_cap = 0;  // trials where the mass, not keep_ratio, set the count
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + static_cast<int>(u(rng) * 200);
    std::vector<float> importance(n);
    // Peaked or flat, so the kept count varies with the prompt.
    const float peak = u(rng) * 20.0f;
    for (float& x : importance) x = std::pow(u(rng), peak);
    SelectionOptions opts;
    opts.chunk_size = 1 + static_cast<int>(u(rng) * 16);
    opts.keep_first = 0;
    opts.keep_last = 0;
    opts.keep_ratio = trial % 3 == 0 ? 1.0f : 0.05f + 0.9f * u(rng);
    opts.keep_mass = 0.05f + 0.95f * u(rng);
    const absl::StatusOr<Selection> sel = SelectTokens(importance, opts);
    ASSERT_TRUE(sel.ok()) << sel.status();

    const int cs = opts.chunk_size;
    const int num_chunks = (n + cs - 1) / cs;
    std::vector<double> mass(num_chunks, 0.0);
    double total = 0.0;
    for (int i = 0; i < n; ++i) {
      mass[i / cs] += importance[i];
      total += importance[i];
    }
    double kept_mass = 0.0;
    for (int c : sel->kept_chunks) kept_mass += mass[c];
    const int cap = NumChunksToKeep(num_chunks, opts.keep_ratio);
    const int k = static_cast<int>(sel->kept_chunks.size());
    ASSERT_LE(k, cap);
    ASSERT_GE(k, 1);
    if (k < cap) {
      ++below_cap;
      // Reached the mass, and one chunk fewer of the same ranking would not.
      EXPECT_GE(kept_mass, opts.keep_mass * total * (1 - 1e-5));
      double min_kept = std::numeric_limits<double>::infinity();
      for (int c : sel->kept_chunks) {
        min_kept = std::min(min_kept, static_cast<double>(mass[c]));
      }
      // The last chunk added has the lowest mean score; drop the kept chunk
      // of lowest mean score and the mass must fall short.
      int last = sel->kept_chunks[0];
      for (int c : sel->kept_chunks) {
        if (sel->chunk_scores[c] < sel->chunk_scores[last] ||
            (sel->chunk_scores[c] == sel->chunk_scores[last] && c > last)) {
          last = c;
        }
      }
      EXPECT_LT(kept_mass - mass[last], opts.keep_mass * total * (1 + 1e-5));
    }
    // The kept chunks are a prefix of the keep_ratio ranking.
    SelectionOptions ratio_only = opts;
    ratio_only.keep_mass = 0.0f;
    const absl::StatusOr<Selection> by_ratio = SelectTokens(importance,
                                                            ratio_only);
    ASSERT_TRUE(by_ratio.ok());
    for (int c : sel->kept_chunks) {
      EXPECT_TRUE(std::find(by_ratio->kept_chunks.begin(),
                            by_ratio->kept_chunks.end(),
                            c) != by_ratio->kept_chunks.end());
    }
  }
  EXPECT_GT(below_cap, 50);  // the mass rule was really exercised
}

TEST(SelectTokensTest, KeepMassPeakedKeepsLessThanFlat) {
  SelectionOptions opts;
  opts.chunk_size = 4;
  opts.keep_first = 0;
  opts.keep_last = 0;
  opts.keep_ratio = 1.0f;
  opts.keep_mass = 0.8f;
  std::vector<float> flat(64, 1.0f);
  std::vector<float> peaked(64, 0.01f);
  for (int i = 8; i < 12; ++i) peaked[i] = 10.0f;
  const absl::StatusOr<Selection> f = SelectTokens(flat, opts);
  const absl::StatusOr<Selection> p = SelectTokens(peaked, opts);
  ASSERT_TRUE(f.ok() && p.ok());
  EXPECT_EQ(f->kept_chunks.size(), 13u);  // ceil(0.8 * 16)
  EXPECT_EQ(p->kept_chunks, std::vector<int>({2}));
  // All-zero importance keeps one chunk rather than none.
  const absl::StatusOr<Selection> z =
      SelectTokens(std::vector<float>(64, 0.0f), opts);
  ASSERT_TRUE(z.ok());
  EXPECT_EQ(z->kept_chunks.size(), 1u);
}

}  // namespace
}  // namespace specserve
