#include "common/engine/kernels.h"

#include <cmath>
#include <random>
#include <vector>

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

}  // namespace
}  // namespace kernels
}  // namespace specserve

namespace specserve {
namespace kernels {
namespace {

TEST(KernelsTest, BatchedGemvMatchesNaive) {
  for (int n : {1, 3, 4, 9}) {
    for (int in : {5, 64, 77}) {
      const int out = 13;
      auto x = Random(size_t(n) * in, 7), w = Random(size_t(out) * in, 8);
      auto y = Random(size_t(n) * out, 9);
      auto y0 = y;
      BatchedGemv(x.data(), n, in, w.data(), 0, 6, y.data(), out, 1.f);
      BatchedGemv(x.data(), n, in, w.data(), 6, out, y.data(), out, 1.f);
      for (int i = 0; i < n; ++i) {
        for (int o = 0; o < out; ++o) {
          double s = y0[i * out + o];
          for (int k = 0; k < in; ++k) s += double(x[i * in + k]) * w[o * in + k];
          ASSERT_NEAR(y[i * out + o], s, 1e-4) << n << " " << in;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kernels
}  // namespace specserve
