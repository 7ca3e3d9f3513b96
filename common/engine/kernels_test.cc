#include "common/engine/kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/engine/avx2_rerun.h"
#include "common/model/safetensors.h"
#include "gtest/gtest.h"

namespace specserve {
namespace kernels {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

TEST(KernelsTest, RmsNormMatchesNaive) {
  for (int dim : {7, 8, 48, 291}) {
    auto x = Random(3 * dim, 1), w = Random(dim, 2);
    std::vector<float> out(3 * dim);
    RmsNorm(x.data(), dim, w.data(), 1e-5f, 3, dim, out.data(), dim);
    for (int r = 0; r < 3; ++r) {
      double ss = 0;
      for (int i = 0; i < dim; ++i) ss += double(x[r * dim + i]) * x[r * dim + i];
      const double s = 1 / std::sqrt(ss / dim + 1e-5);
      for (int i = 0; i < dim; ++i) {
        ASSERT_NEAR(out[r * dim + i], x[r * dim + i] * s * w[i], 1e-5);
      }
    }
  }
}

TEST(KernelsTest, RopeRotatesHalvesByPositionAngle) {
  const int D = 8, heads = 2;
  auto x = Random(heads * D, 3);
  auto y = x;
  const int pos = 37;
  ApplyRope(y.data(), heads * D, 1, heads, D, &pos, 10000.0);
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < D / 2; ++i) {
      const double a = pos * std::pow(10000.0, -2.0 * i / D);
      const double x1 = x[h * D + i], x2 = x[h * D + i + D / 2];
      EXPECT_NEAR(y[h * D + i], x1 * std::cos(a) - x2 * std::sin(a), 1e-5);
      EXPECT_NEAR(y[h * D + i + D / 2], x2 * std::cos(a) + x1 * std::sin(a),
                  1e-5);
    }
  }
  // Position 0 is the identity.
  auto z = x;
  const int zero = 0;
  ApplyRope(z.data(), heads * D, 1, heads, D, &zero, 10000.0);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_FLOAT_EQ(z[i], x[i]);
}

TEST(KernelsTest, RopeWithFrequenciesAndAttentionFactor) {
  const int heads = 2, D = 8;
  std::vector<float> x(heads * D);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.1f * (i + 1);
  const double inv_freq[4] = {0.5, 0.25, 0.125, 0.0};
  const int pos = 3;
  auto y = x;
  ApplyRope(y.data(), heads * D, 1, heads, D, &pos, inv_freq, 1.5);
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < D / 2; ++i) {
      const double a = pos * inv_freq[i];
      const double x1 = x[h * D + i], x2 = x[h * D + i + D / 2];
      EXPECT_NEAR(y[h * D + i], 1.5 * (x1 * std::cos(a) - x2 * std::sin(a)),
                  1e-5);
      EXPECT_NEAR(y[h * D + i + D / 2],
                  1.5 * (x2 * std::cos(a) + x1 * std::sin(a)), 1e-5);
    }
  }
}

TEST(KernelsTest, AddBiasAddsToEveryRowWithinStride) {
  std::vector<float> x = {1, 2, 3, 9, 4, 5, 6, 9};
  const float b[3] = {10, 20, 30};
  AddBias(x.data(), 4, 2, 3, b);
  EXPECT_EQ(x, (std::vector<float>{11, 22, 33, 9, 14, 25, 36, 9}));
}

TEST(KernelsTest, SiluMulMatchesNaive) {
  const int ffn = 37;
  auto gu = Random(2 * 2 * ffn, 4, 4.f);
  std::vector<float> out(2 * ffn);
  SiluMul(gu.data(), 2, ffn, out.data());
  for (int r = 0; r < 2; ++r) {
    for (int i = 0; i < ffn; ++i) {
      const double g = gu[r * 2 * ffn + i], u = gu[r * 2 * ffn + ffn + i];
      EXPECT_NEAR(out[r * ffn + i], g / (1 + std::exp(-g)) * u,
                  1e-5 * (1 + std::abs(g * u)));
    }
  }
}

TEST(KernelsTest, ExpAndSoftmaxAccuracy) {
  std::vector<float> x;
  for (float v = -87.f; v <= 88.f; v += 0.173f) x.push_back(v);
  auto y = x;
  ExpInPlace(y.data(), y.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_NEAR(y[i] / std::exp(double(x[i])), 1.0, 2e-6) << x[i];
  }
  auto row = Random(45, 5, 3.f);
  row.resize(50, 123.f);  // masked tail must not matter
  auto ref = row;
  SoftmaxPrefix(row.data(), 45, 50);
  double m = *std::max_element(ref.begin(), ref.begin() + 45), s = 0;
  for (int i = 0; i < 45; ++i) s += std::exp(ref[i] - m);
  for (int i = 0; i < 45; ++i) {
    EXPECT_NEAR(row[i], std::exp(ref[i] - m) / s, 1e-6);
  }
  for (int i = 45; i < 50; ++i) EXPECT_EQ(row[i], 0.f);
}

// Masked scores (-inf, MaskScores) and scores more than 88 below the
// maximum get exactly 0, in the vector body and the scalar tail, and the
// rest is the softmax without them (no NaN, no -inf from the exponent
// bits).
TEST(KernelsTest, SoftmaxOfMaskedAndUnderflowingScores) {
  auto row = Random(37, 8, 2.f);
  const std::vector<int> masked = {0, 5, 8, 16, 33, 36};
  row[9] = row[0] - 200.f;  // underflows
  row[35] = -1e30f;
  auto ref = row;
  MaskScores(row.data(), masked.data(), static_cast<int>(masked.size()));
  SoftmaxPrefix(row.data(), 37, 37);
  std::vector<bool> hidden(37, false);
  for (int k : masked) hidden[k] = true;
  double m = -1e300, s = 0;
  for (int i = 0; i < 37; ++i) {
    if (!hidden[i]) m = std::max(m, double(ref[i]));
  }
  for (int i = 0; i < 37; ++i) {
    if (!hidden[i]) s += std::exp(ref[i] - m);
  }
  for (int i = 0; i < 37; ++i) {
    ASSERT_FALSE(std::isnan(row[i])) << i;
    const double want = hidden[i] ? 0.0 : std::exp(ref[i] - m) / s;
    EXPECT_NEAR(row[i], want, 1e-6) << i;
    if (hidden[i] || i == 9 || i == 35) {
      EXPECT_EQ(row[i], 0.f) << i;
    }
  }
}


// Every length from 1 to 70 (the AVX-512 path's masked tail and the AVX2
// path's scalar one), against a double softmax; the max agrees exactly.
TEST(KernelsTest, SoftmaxAtEveryLength) {
  for (int n = 1; n <= 70; ++n) {
    auto row = Random(n, 100 + n, 4.f);
    row.resize(n + 3, 7.f);
    const auto ref = row;
    const float m = *std::max_element(ref.begin(), ref.begin() + n);
    EXPECT_EQ(MaxOf(ref.data(), n), m) << n;
    SoftmaxPrefix(row.data(), n, n + 3);
    double s = 0;
    for (int i = 0; i < n; ++i) s += std::exp(double(ref[i]) - m);
    for (int i = 0; i < n; ++i) {
      ASSERT_NEAR(row[i], std::exp(double(ref[i]) - m) / s, 1e-6)
          << "n " << n << " i " << i;
    }
    for (int i = n; i < n + 3; ++i) EXPECT_EQ(row[i], 0.f);
  }
}

// The AVX2 softmax: the softmax tests again in a child process with
// SPECSERVE_DISABLE_AVX512 set (the dispatch is decided once per process).
TEST(KernelsTest, Avx2PathPassesTheSoftmaxTests) {
  if (testing_util::InAvx2Rerun()) {
    EXPECT_FALSE(UseAvx512());
    return;
  }
  EXPECT_EQ(testing_util::RerunWithoutAvx512(
                "KernelsTest.ExpAndSoftmaxAccuracy:KernelsTest."
                "SoftmaxOfMaskedAndUnderflowingScores:KernelsTest."
                "SoftmaxAtEveryLength:KernelsTest."
                "Avx2PathPassesTheSoftmaxTests"),
            0);
}

using PanelFn = void (*)(const float*, int, int, const float*, int, int,
                         float*, int, int, float);

class PanelGemmTest : public ::testing::TestWithParam<bool> {
 protected:
  // The dispatched kernel (AVX-512 where the CPU has it) or the AVX2 one.
  PanelFn Kernel() const { return GetParam() ? &PanelGemm : &PanelGemmAvx2; }
};

TEST_P(PanelGemmTest, MatchesNaive) {
  const PanelFn gemm = Kernel();
  // 300 rows: two passes (kernels.cc's kMaxPassRows is 256).
  for (int n : {1, 2, 3, 4, 5, 9, 12, 16, 37, 64, 300}) {
    for (int in : {5, 64, 77, 300}) {
      for (int out : {13, 32, 70}) {  // a partial, one whole, 3 panels
        auto x = Random(size_t(n) * in, 7), w = Random(size_t(out) * in, 8);
        std::vector<float> packed(PackedPanelFloats(out, in));
        PackPanels(w.data(), out, in, packed.data());
        auto y = Random(size_t(n) * out, 9);
        auto y0 = y;
        const int panels = (out + kPanelWidth - 1) / kPanelWidth;
        // Two calls over disjoint panel ranges, as the engine's threads do.
        gemm(x.data(), n, in, packed.data(), 0, panels / 2, y.data(), out,
             out, 1.f);
        gemm(x.data(), n, in, packed.data(), panels / 2, panels, y.data(),
             out, out, 1.f);
        for (int i = 0; i < n; ++i) {
          for (int o = 0; o < out; ++o) {
            double s = y0[i * out + o];
            for (int k = 0; k < in; ++k) {
              s += double(x[i * in + k]) * w[o * in + k];
            }
            ASSERT_NEAR(y[i * out + o], s, 1e-4) << n << " " << in << " " << out;
          }
        }
      }
    }
  }
}

TEST_P(PanelGemmTest, BetaZeroOverwritesAndRowsAreIndependent) {
  // Row i's result must not depend on which other rows share the call
  // (batched forward == per-sequence forward relies on it), and beta 0
  // ignores what y held (NaN included).
  const PanelFn gemm = Kernel();
  const int n = 11, in = 100, out = 40;
  auto x = Random(size_t(n) * in, 10), w = Random(size_t(out) * in, 11);
  std::vector<float> packed(PackedPanelFloats(out, in));
  PackPanels(w.data(), out, in, packed.data());
  const int panels = (out + kPanelWidth - 1) / kPanelWidth;
  std::vector<float> all(size_t(n) * out, std::nanf(""));
  gemm(x.data(), n, in, packed.data(), 0, panels, all.data(), out, out, 0.f);
  for (int i = 0; i < n; ++i) {
    std::vector<float> one(out, std::nanf(""));
    gemm(x.data() + size_t(i) * in, 1, in, packed.data(), 0, panels,
         one.data(), out, out, 0.f);
    for (int o = 0; o < out; ++o) ASSERT_EQ(all[i * out + o], one[o]);
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, PanelGemmTest, ::testing::Bool(),
                         [](const auto& info) {
                           return info.param ? "Dispatched" : "Avx2";
                         });

TEST(KernelsTest, AttentionRowsMatchesNaive) {
  // 16 slots in blocks of 3: logical block b lives in physical block
  // table[b] of a 6-block pool, out of order. Head sizes cover the vector
  // tails (12, 80) and one and two 64-float register chunks (64, 128); 13
  // cached keys + 3 rows cover the 8-key groups and their remainder.
  for (int D : {12, 64, 80, 128}) {
    SCOPED_TRACE(D);
    const int H = 4, KV = 2, first = 13, rows = 3, bs = 3;
    const int total = first + rows, qs = H * D + 3, kvs = KV * D + 1;
    const std::vector<int> table = {2, 0, 5, 3, 1, 4};
    auto q = Random(size_t(rows) * qs, 12);
    auto kp = Random(size_t(6 * bs) * kvs, 13);
    auto vp = Random(size_t(6 * bs) * kvs, 14);
    std::vector<float> k(size_t(total) * kvs), v(size_t(total) * kvs);
    for (int j = 0; j < total; ++j) {
      const size_t phys = size_t(table[j / bs]) * bs + j % bs;
      std::copy_n(&kp[phys * kvs], kvs, &k[size_t(j) * kvs]);
      std::copy_n(&vp[phys * kvs], kvs, &v[size_t(j) * kvs]);
    }
    const float scale = 1.f / std::sqrt(float(D));
    std::vector<float> scores(size_t(H) * total), out(size_t(rows) * H * D);
    AttentionRows(q.data(), qs, rows, first, H, KV, D, kp.data(), vp.data(),
                  kvs, table.data(), bs, scale, scores.data(), out.data(),
                  H * D);
    for (int i = 0; i < rows; ++i) {
      for (int h = 0; h < H; ++h) {
        const int g = h / (H / KV), nk = first + i + 1;
        std::vector<double> p(nk);
        double mx = -1e300, sum = 0;
        for (int j = 0; j < nk; ++j) {
          double dot = 0;
          for (int d = 0; d < D; ++d) {
            dot += double(q[i * qs + h * D + d]) * k[j * kvs + g * D + d];
          }
          p[j] = dot * scale;
          mx = std::max(mx, p[j]);
        }
        for (double& x : p) sum += (x = std::exp(x - mx));
        for (int d = 0; d < D; ++d) {
          double o = 0;
          for (int j = 0; j < nk; ++j) o += p[j] / sum * v[j * kvs + g * D + d];
          ASSERT_NEAR(out[(i * H + h) * D + d], o, 1e-5) << i << " " << h;
        }
      }
    }
  }
}


TEST(KernelsTest, Bf16RowsRoundToNearestEvenAsTheScalarConversion) {
  // Random magnitudes over many binades, then the cases rounding decides:
  // exact ties (even and odd kept bit), values that round up into the next
  // binade or to infinity, subnormals, signed zeros, infinities and NaN.
  std::vector<float> x = Random(1003, 21, 1e3f);
  for (uint32_t bits : {0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x3fffffffu,
                        0x7f7fffffu, 0x00000001u, 0x00018000u, 0x80000000u,
                        0x00000000u, 0x7f800000u, 0xff800000u, 0x7fc00001u,
                        0x7f800001u, 0xffffffffu}) {
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    x.push_back(f);
  }
  std::vector<uint16_t> b(x.size());
  FloatToBf16Row(x.data(), x.size(), b.data());
  std::vector<float> back(x.size());
  Bf16ToFloatRow(b.data(), b.size(), back.data());
  for (size_t i = 0; i < x.size(); ++i) {
    SCOPED_TRACE(i);
    if (std::isnan(x[i])) {
      EXPECT_TRUE(std::isnan(back[i]));
      continue;
    }
    EXPECT_EQ(b[i], FloatToBFloat16(x[i])) << x[i];
    EXPECT_EQ(back[i], BFloat16ToFloat(b[i]));
    if (std::isfinite(back[i]) && x[i] != 0.f) {
      // 8 significant bits: relative error <= 2^-8 (half an ulp).
      EXPECT_LE(std::abs(back[i] - x[i]), std::abs(x[i]) * 0x1p-8f + 1e-40f);
    }
  }
}

TEST(KernelsTest, AttentionRowsOverBf16EqualsF32OnRoundedCache) {
  // The bf16 overload widens the cache and then does the f32 arithmetic:
  // with the f32 overload given the same bf16 values widened, the outputs
  // are identical, causal and with a tree mask; and close to the f32
  // cache's (the rounding of K and V is the only difference).
  for (int D : {12, 64, 80, 128}) {
    SCOPED_TRACE(D);
    const int H = 8, KV = 2, first = 21, rows = 4, bs = 4, blocks = 7;
    const int qs = H * D + 5, kvs = KV * D + 3;
    const std::vector<int> table = {3, 6, 0, 5, 1, 2, 4};
    auto q = Random(size_t(rows) * qs, 31);
    auto k = Random(size_t(blocks * bs) * kvs, 32);
    auto v = Random(size_t(blocks * bs) * kvs, 33);
    std::vector<uint16_t> kb(k.size()), vb(v.size());
    FloatToBf16Row(k.data(), k.size(), kb.data());
    FloatToBf16Row(v.data(), v.size(), vb.data());
    std::vector<float> kr(k.size()), vr(v.size());
    Bf16ToFloatRow(kb.data(), kb.size(), kr.data());
    Bf16ToFloatRow(vb.data(), vb.size(), vr.data());
    // Row i (slot first + i) hides slots first + i - 1 and 2: a tree whose
    // branches do not see each other, and an arbitrary earlier key.
    const std::vector<int> offsets = {0, 1, 3, 5, 7};
    const std::vector<int> masked = {2, 2, first, 2, first + 1, 2, first + 2};
    const float scale = 1.f / std::sqrt(float(D));
    for (bool tree : {false, true}) {
      SCOPED_TRACE(tree);
      const int* mo = tree ? offsets.data() : nullptr;
      const int* mk = tree ? masked.data() : nullptr;
      std::vector<float> scores(size_t(H) * (first + rows));
      std::vector<float> out_b(size_t(rows) * H * D), out_r(out_b.size()),
          out_f(out_b.size());
      AttentionRows(q.data(), qs, rows, first, H, KV, D, kb.data(), vb.data(),
                    kvs, table.data(), bs, scale, scores.data(), out_b.data(),
                    H * D, mo, mk);
      AttentionRows(q.data(), qs, rows, first, H, KV, D, kr.data(), vr.data(),
                    kvs, table.data(), bs, scale, scores.data(), out_r.data(),
                    H * D, mo, mk);
      AttentionRows(q.data(), qs, rows, first, H, KV, D, k.data(), v.data(),
                    kvs, table.data(), bs, scale, scores.data(), out_f.data(),
                    H * D, mo, mk);
      double max_diff = 0;
      for (size_t i = 0; i < out_b.size(); ++i) {
        ASSERT_EQ(out_b[i], out_r[i]) << i;
        max_diff = std::max(max_diff, double(std::abs(out_b[i] - out_f[i])));
      }
      // Unit-variance K, V and q: a relative error of 2^-8 per element
      // moves the outputs by ~1e-2 at most.
      EXPECT_LT(max_diff, 2e-2);
      EXPECT_GT(max_diff, 0.0);  // the rounding did happen
    }
  }
}

}  // namespace
}  // namespace kernels
}  // namespace specserve
