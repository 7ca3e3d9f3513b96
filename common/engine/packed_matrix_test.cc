#include "common/engine/packed_matrix.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "common/engine/avx2_rerun.h"
#include "common/engine/thread_pool.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

constexpr WeightDType kAll[] = {WeightDType::kF32, WeightDType::kBF16,
                                WeightDType::kInt8};

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<float> Dequantized(const PackedMatrix& m) {
  std::vector<float> w(size_t(m.out()) * m.in());
  for (int o = 0; o < m.out(); ++o) m.DequantizeRow(o, &w[size_t(o) * m.in()]);
  return w;
}

// Error bound of one output of a product with the stored weights `wd`:
// the input's rounding to the kernel's precision (bf16: 2^-8 relative;
// int8: half a step of amax / 127 per 32-block) plus f32 accumulation.
double Bound(WeightDType t, const float* x, const float* wd, int in) {
  double abs_sum = 0, bound = 0;
  for (int k = 0; k < in; ++k) abs_sum += std::fabs(double(x[k]) * wd[k]);
  if (t == WeightDType::kBF16) bound = abs_sum / 256;
  if (t == WeightDType::kInt8) {
    for (int b = 0; b * 32 < in; ++b) {
      double amax = 0, wsum = 0;
      for (int k = b * 32; k < std::min(in, b * 32 + 32); ++k) {
        amax = std::max(amax, std::fabs(double(x[k])));
        wsum += std::fabs(double(wd[k]));
      }
      bound += amax / 127 / 2 * wsum;
    }
  }
  return bound * 1.01 + 1e-5 * abs_sum + 1e-6;
}

TEST(PackedMatrixTest, ParseWeightDType) {
  EXPECT_FALSE(ParseWeightDType("auto")->has_value());
  EXPECT_FALSE(ParseWeightDType("")->has_value());
  EXPECT_EQ(**ParseWeightDType("f32"), WeightDType::kF32);
  EXPECT_EQ(**ParseWeightDType("BF16"), WeightDType::kBF16);
  EXPECT_EQ(**ParseWeightDType("q8_0"), WeightDType::kInt8);
  auto bad = ParseWeightDType("int4");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("int4"), std::string::npos);
}

TEST(PackedMatrixTest, DequantizedWeightsWithinFormatPrecision) {
  const int out = 37, in = 70;
  const auto w = Random(size_t(out) * in, 1);
  for (WeightDType t : kAll) {
    const PackedMatrix m = PackedMatrix::Pack(w.data(), out, in, t);
    const auto d = Dequantized(m);
    for (int o = 0; o < out; ++o) {
      for (int b = 0; b * 32 < in; ++b) {
        float amax = 0;
        for (int k = b * 32; k < std::min(in, b * 32 + 32); ++k) {
          amax = std::max(amax, std::fabs(w[o * in + k]));
        }
        for (int k = b * 32; k < std::min(in, b * 32 + 32); ++k) {
          const float v = w[o * in + k], got = d[o * in + k];
          if (t == WeightDType::kF32) {
            ASSERT_EQ(got, v);
          } else if (t == WeightDType::kBF16) {
            ASSERT_LE(std::fabs(got - v), std::fabs(v) / 256) << o << "," << k;
          } else {
            // Half a quantization step (the f16 scale rounds by 2^-11).
            ASSERT_LE(std::fabs(got - v), amax / 127 * 0.5f * 1.002f + 1e-7f)
                << o << "," << k;
          }
        }
      }
    }
  }
  // Byte counts: f32 4, bf16 2 (in rounded up to even), int8 1 + 2/32 per
  // weight (in rounded up to 32), over 32-row panels.
  EXPECT_EQ(PackedMatrix::Pack(w.data(), out, in, WeightDType::kF32).bytes(),
            64u * 70 * 4);
  EXPECT_EQ(PackedMatrix::Pack(w.data(), out, in, WeightDType::kBF16).bytes(),
            64u * 70 * 2);
  EXPECT_EQ(PackedMatrix::Pack(w.data(), out, in, WeightDType::kInt8).bytes(),
            64u * 96 + 64u * 3 * 2);
}

TEST(PackedMatrixTest, GemmMatchesNaiveWithinBound) {
  for (WeightDType t : kAll) {
    for (auto [out, in] : {std::pair{1, 1}, {33, 70}, {64, 96}, {100, 301}}) {
      for (int n : {1, 2, 5, 9, 16}) {
        const auto w = Random(size_t(out) * in, out + in);
        const auto x = Random(size_t(n) * in, n, 2.f);
        const PackedMatrix m = PackedMatrix::Pack(w.data(), out, in, t);
        const auto wd = Dequantized(m);
        PackedMatrix::Input input;
        m.PrepareInput(x.data(), n, &input);
        const int stride = out + 3;
        std::vector<float> y(size_t(n) * stride, 0.5f);
        m.Gemm(input, 0, m.panels(), y.data(), stride, 1.f);
        for (int r = 0; r < n; ++r) {
          for (int o = 0; o < out; ++o) {
            double ref = 0.5;
            for (int k = 0; k < in; ++k) {
              ref += double(x[r * in + k]) * wd[size_t(o) * in + k];
            }
            ASSERT_NEAR(y[r * stride + o], ref,
                        Bound(t, &x[r * in], &wd[size_t(o) * in], in))
                << WeightDTypeName(t) << " " << out << "x" << in << " n=" << n
                << " r=" << r << " o=" << o;
          }
          for (int o = out; o < stride; ++o) ASSERT_EQ(y[r * stride + o], 0.5f);
        }
        // Each row's result is bit-for-bit the same computed alone
        // (batching must not change a sequence's logits).
        for (int r = 0; r < n; ++r) {
          PackedMatrix::Input one;
          m.PrepareInput(&x[r * in], 1, &one);
          std::vector<float> y1(out);
          m.Gemm(one, 0, m.panels(), y1.data(), out, 0.f);
          std::vector<float> yb(size_t(n) * out);
          m.Gemm(input, 0, m.panels(), yb.data(), out, 0.f);
          for (int o = 0; o < out; ++o) ASSERT_EQ(y1[o], yb[r * out + o]);
        }
      }
    }
  }
}

TEST(PackedMatrixTest, UnpackPanelsIsTransposedDequantizedRows) {
  const int out = 70, in = 45;
  const auto w = Random(size_t(out) * in, 7);
  for (WeightDType t : kAll) {
    const PackedMatrix m = PackedMatrix::Pack(w.data(), out, in, t);
    const auto wd = Dequantized(m);
    const size_t ld = 3 * 32 + 5;
    std::vector<float> tile(size_t(in) * ld, -1.f);
    m.UnpackPanels(0, 3, tile.data(), ld);
    for (int k = 0; k < in; ++k) {
      for (int j = 0; j < 96; ++j) {
        ASSERT_EQ(tile[k * ld + j], j < out ? wd[size_t(j) * in + k] : 0.f)
            << WeightDTypeName(t) << " k=" << k << " j=" << j;
      }
      for (size_t j = 96; j < ld; ++j) ASSERT_EQ(tile[k * ld + j], -1.f);
    }
  }
}

TEST(PackedMatrixTest, PackedLinearGemvAndPrefillPaths) {
  const int out = 200, in = 160;
  const auto w = Random(size_t(out) * in, 11);
  for (WeightDType t : kAll) {
    const PackedMatrix m = PackedMatrix::Pack(w.data(), out, in, t);
    const auto wd = Dequantized(m);
    for (int n : {3, 80}) {
      const auto x = Random(size_t(n) * in, 12 + n);
      std::vector<float> y(size_t(n) * out, 1.f);
      PackedMatrix::Input input;
      PackedLinear(m, x.data(), n, y.data(), 1.f, 64, &input);
      for (int r = 0; r < n; ++r) {
        for (int o = 0; o < out; ++o) {
          double ref = 1;
          for (int k = 0; k < in; ++k)
            ref += double(x[r * in + k]) * wd[o * in + k];
          // Prefill (n > 64) multiplies the dequantized weights in f32,
          // unless the dtype has its own instructions (then as decode).
          const bool sgemm = n > 64 && !m.HasNativeKernel();
          const double tol = sgemm ? 1e-4 * (1 + std::fabs(ref))
                                   : Bound(t, &x[r * in], &wd[o * in], in);
          ASSERT_NEAR(y[r * out + o], ref, tol)
              << WeightDTypeName(t) << " n=" << n << " r=" << r << " o=" << o;
        }
      }
    }
  }
}

TEST(PackedMatrixTest, ZeroWeightsAndInputsGiveZeros) {
  const int out = 40, in = 64;
  std::vector<float> w(size_t(out) * in, 0.f), x(2 * in, 0.f);
  for (int k = 0; k < in; ++k) x[in + k] = 1.f;
  for (WeightDType t : kAll) {
    const PackedMatrix m = PackedMatrix::Pack(w.data(), out, in, t);
    PackedMatrix::Input input;
    m.PrepareInput(x.data(), 2, &input);
    std::vector<float> y(2 * out, 3.f);
    m.Gemm(input, 0, m.panels(), y.data(), out, 0.f);
    for (float v : y) ASSERT_EQ(v, 0.f) << WeightDTypeName(t);
  }
}

TEST(PackedMatrixTest, NativeKernelIsTheLowPrecisionInstructionPath) {
  const std::vector<float> w(64 * 32, 0.5f);
  for (WeightDType t : kAll) {
    const PackedMatrix m = PackedMatrix::Pack(w.data(), 64, 32, t);
    const std::string k = PackedKernelName(t);
    EXPECT_EQ(m.HasNativeKernel(), k == "avx512bf16" || k == "avx512vnni")
        << WeightDTypeName(t) << " " << k;
  }
}

// The AVX2 fallbacks: the same tests in a child process with
// SPECSERVE_DISABLE_AVX512 set (the dispatch is decided once per process).
TEST(PackedMatrixTest, Avx2FallbacksPassTheSameTests) {
  if (testing_util::InAvx2Rerun()) {
    for (WeightDType t : kAll) EXPECT_EQ(PackedKernelName(t), "avx2");
    return;
  }
  for (WeightDType t : kAll) {
    std::printf("%s kernel: %s\n", WeightDTypeName(t).c_str(),
                PackedKernelName(t).c_str());
  }
  EXPECT_EQ(testing_util::RerunWithoutAvx512("PackedMatrixTest.*"), 0);
}

}  // namespace
}  // namespace specserve
