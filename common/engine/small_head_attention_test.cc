#include "common/engine/small_head_attention.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "common/engine/kernels.h"
#include "gtest/gtest.h"

namespace specserve {
namespace kernels {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> x(n);
  for (float& e : x) e = u(rng);
  return x;
}

// Row i of a random tree over the new rows (parent of row j in [-1, j)):
// the new rows that are not its ancestors, as slots, like TreeMask.
void RandomTreeMask(int rows, int first, std::mt19937* rng,
                    std::vector<int>* offsets, std::vector<int>* keys) {
  std::vector<int> parent(rows, -1);
  for (int j = 1; j < rows; ++j) {
    parent[j] = static_cast<int>((*rng)() % (j + 1)) - 1;
  }
  offsets->assign(1, 0);
  keys->clear();
  for (int i = 0; i < rows; ++i) {
    std::vector<bool> ancestor(rows, false);
    for (int a = i; a >= 0; a = parent[a]) ancestor[a] = true;
    for (int j = 0; j < i; ++j) {
      if (!ancestor[j]) keys->push_back(first + j);
    }
    offsets->push_back(static_cast<int>(keys->size()));
  }
}

// Against a float64 softmax attention and against AttentionRows, over
// shuffled blocks (block sizes below, at and above the 16-key chunk),
// context lengths around chunk edges, GQA groups 1-3, decode (1 row),
// verify (5, 17 rows), a 64-row prefill chunk and tree masks.
TEST(SmallHeadAttentionTest, MatchesReferenceAndAttentionRows) {
  if (!HasSmallHeadAttention(8)) GTEST_SKIP() << "no AVX-512";
  EXPECT_FALSE(HasSmallHeadAttention(12));
  EXPECT_FALSE(HasSmallHeadAttention(64));
  std::mt19937 rng(5);
  int cases = 0;
  for (int D : {8, 16}) {
    for (int bs : {3, 16, 32}) {
      for (auto [H, KV] : {std::pair{4, 4}, std::pair{8, 4}, std::pair{6, 2}}) {
        for (int first : {0, 1, 15, 16, 47, 130}) {
          for (int rows : {1, 5, 17, 64}) {
            for (bool tree : {false, true}) {
              if (tree && rows == 1) continue;
              SCOPED_TRACE(::testing::Message()
                           << "D " << D << " bs " << bs << " H " << H << " KV "
                           << KV << " first " << first << " rows " << rows
                           << " tree " << tree);
              const int total = first + rows;
              const int nb = (total + bs - 1) / bs + 2;
              std::vector<int> table(nb);
              std::iota(table.begin(), table.end(), 0);
              std::shuffle(table.begin(), table.end(), rng);
              const int qs = H * D + 5, kvs = KV * D + 3;
              auto q = Random(size_t(rows) * qs, rng(), 2.f);
              auto kp = Random(size_t(nb) * bs * kvs, rng());
              auto vp = Random(size_t(nb) * bs * kvs, rng());
              std::vector<int> mo, mk;
              if (tree) RandomTreeMask(rows, first, &rng, &mo, &mk);
              const int* mo_p = tree ? mo.data() : nullptr;
              const int* mk_p = tree ? mk.data() : nullptr;
              const float scale = 1.f / std::sqrt(float(D));
              std::vector<float> scratch;
              std::vector<float> got(size_t(rows) * H * D, -7.f);
              AttentionRowsSmallHead(q.data(), qs, rows, first, H, KV, D,
                                     kp.data(), vp.data(), kvs, table.data(),
                                     bs, scale, &scratch, got.data(), H * D,
                                     mo_p, mk_p);
              std::vector<float> scores(size_t(H) * total);
              std::vector<float> want(size_t(rows) * H * D);
              AttentionRows(q.data(), qs, rows, first, H, KV, D, kp.data(),
                            vp.data(), kvs, table.data(), bs, scale,
                            scores.data(), want.data(), H * D, mo_p, mk_p);
              for (int i = 0; i < rows; ++i) {
                std::vector<bool> hidden(total, false);
                if (tree) {
                  for (int e = mo[i]; e < mo[i + 1]; ++e) hidden[mk[e]] = true;
                }
                for (int h = 0; h < H; ++h) {
                  const int g = h / (H / KV), nk = first + i + 1;
                  std::vector<double> p(nk, 0.0);
                  double m = -1e300, s = 0;
                  for (int j = 0; j < nk; ++j) {
                    if (hidden[j]) continue;
                    const size_t phys = size_t(table[j / bs]) * bs + j % bs;
                    double dot = 0;
                    for (int d = 0; d < D; ++d) {
                      dot += double(q[i * qs + h * D + d]) *
                             kp[phys * kvs + g * D + d];
                    }
                    p[j] = dot * scale;
                    m = std::max(m, p[j]);
                  }
                  for (int j = 0; j < nk; ++j) {
                    p[j] = hidden[j] ? 0.0 : std::exp(p[j] - m);
                    s += p[j];
                  }
                  for (int d = 0; d < D; ++d) {
                    double o = 0;
                    for (int j = 0; j < nk; ++j) {
                      const size_t phys = size_t(table[j / bs]) * bs + j % bs;
                      o += p[j] / s * vp[phys * kvs + g * D + d];
                    }
                    const size_t at = size_t(i) * H * D + h * D + d;
                    ASSERT_NEAR(got[at], o, 2e-5) << "row " << i << " head "
                                                  << h << " dim " << d;
                    ASSERT_NEAR(got[at], want[at], 2e-5);
                  }
                }
              }
              ++cases;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 300);
}

// A row's result does not depend on the other rows of the call (the
// batched engine's rows must not change with their batch).
TEST(SmallHeadAttentionTest, RowsAreIndependentOfTheirCall) {
  if (!HasSmallHeadAttention(8)) GTEST_SKIP() << "no AVX-512";
  const int H = 8, KV = 4, D = 8, bs = 16, first = 40, rows = 6;
  const int qs = H * D, kvs = KV * D;
  const std::vector<int> table = {3, 1, 0, 2};
  auto q = Random(size_t(rows) * qs, 1);
  auto kp = Random(size_t(4) * bs * kvs, 2);
  auto vp = Random(size_t(4) * bs * kvs, 3);
  std::vector<float> scratch, all(size_t(rows) * H * D);
  AttentionRowsSmallHead(q.data(), qs, rows, first, H, KV, D, kp.data(),
                         vp.data(), kvs, table.data(), bs, 0.3f, &scratch,
                         all.data(), H * D);
  for (int i = 0; i < rows; ++i) {
    std::vector<float> one(size_t(H) * D);
    AttentionRowsSmallHead(q.data() + i * qs, qs, 1, first + i, H, KV, D,
                           kp.data(), vp.data(), kvs, table.data(), bs, 0.3f,
                           &scratch, one.data(), H * D);
    for (int e = 0; e < H * D; ++e) {
      ASSERT_EQ(one[e], all[size_t(i) * H * D + e]) << "row " << i;
    }
  }
}

// The chunk-major planes (the runner's layout for small heads) give the
// row-major kernel's results bit for bit: the same values reach the same
// lanes; stale slots past the sequence only ever get weight 0.
TEST(SmallHeadAttentionTest, ChunkMajorEqualsRowMajor) {
  if (!HasSmallHeadAttention(8)) GTEST_SKIP() << "no AVX-512";
  EXPECT_FALSE(UsesChunkMajorKv(8, 8));
  EXPECT_FALSE(UsesChunkMajorKv(32, 16));
  std::mt19937 rng(9);
  int cases = 0;
  for (int D : {8, 16}) {
    for (int bs : {16, 32}) {
      for (auto [H, KV] : {std::pair{8, 4}, std::pair{6, 2}}) {
        for (int first : {0, 15, 16, 130}) {
          for (int rows : {1, 5, 17}) {
            for (bool tree : {false, true}) {
              if (tree && rows == 1) continue;
              SCOPED_TRACE(::testing::Message()
                           << "D " << D << " bs " << bs << " H " << H
                           << " first " << first << " rows " << rows);
              ASSERT_TRUE(UsesChunkMajorKv(D, bs));
              const int total = first + rows;
              const int nb = (total + bs - 1) / bs + 2;
              std::vector<int> table(nb);
              std::iota(table.begin(), table.end(), 0);
              std::shuffle(table.begin(), table.end(), rng);
              const int qs = H * D, kvs = KV * D;
              auto q = Random(size_t(rows) * qs, rng(), 2.f);
              auto kp = Random(size_t(nb) * bs * kvs, rng());
              auto vp = Random(size_t(nb) * bs * kvs, rng());
              // Slots past `total` hold whatever an earlier owner left.
              std::vector<float> kc(kp.size()), vc(vp.size());
              for (size_t slot = 0; slot < size_t(nb) * bs; ++slot) {
                for (int g = 0; g < KV; ++g) {
                  for (int d = 0; d < D; ++d) {
                    const size_t at = ChunkMajorKvOffset(slot, g, d, KV, D, bs);
                    kc[at] = kp[slot * kvs + g * D + d];
                    vc[at] = vp[slot * kvs + g * D + d];
                  }
                }
              }
              std::vector<int> mo, mk;
              if (tree) RandomTreeMask(rows, first, &rng, &mo, &mk);
              const int* mo_p = tree ? mo.data() : nullptr;
              const int* mk_p = tree ? mk.data() : nullptr;
              std::vector<float> scratch;
              std::vector<float> want(size_t(rows) * H * D, -7.f);
              std::vector<float> got(size_t(rows) * H * D, -9.f);
              AttentionRowsSmallHead(q.data(), qs, rows, first, H, KV, D,
                                     kp.data(), vp.data(), kvs, table.data(),
                                     bs, 0.35f, &scratch, want.data(), H * D,
                                     mo_p, mk_p);
              AttentionRowsSmallHeadChunkMajor(
                  q.data(), qs, rows, first, H, KV, D, kc.data(), vc.data(),
                  table.data(), bs, 0.35f, &scratch, got.data(), H * D, mo_p,
                  mk_p);
              ASSERT_EQ(got, want);
              ++cases;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 160);
}

}  // namespace
}  // namespace kernels
}  // namespace specserve
