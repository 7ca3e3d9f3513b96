// cuda_kernels::SkinnyLinear (skinny_linear.cu):
// - argument checks (run everywhere: no CUDA call);
// - agreement with a float64 host reference of y = x W^T + beta y over
//   1..kSkinnyMaxRows rows, bf16 and fp16 operands, fp32 outputs with beta
//   0 and 1 and 16-bit outputs, widths that are and are not multiples of a
//   warp's 256-element stride, column counts that leave a block or a warp
//   partly empty; the elements after y's last are left as they were.
// GPU tests skip where no CUDA device is present.

#include "common/cuda/skinny_linear.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda/device.h"
#include "common/cuda/device_array_test_util.h"
#include "common/cuda/kernels.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

namespace ck = cuda_kernels;
using testing_cuda::DeviceArray;

TEST(SkinnyLinearArgsTest, SupportsOnlyWhatTheKernelTakes) {
  alignas(16) static char buf[64];
  ck::SkinnyLinearArgs a;
  a.x = buf;
  a.w = buf;
  a.y = buf;
  a.n = 1;
  a.in = 16;
  a.out = 3;
  EXPECT_TRUE(ck::SkinnyLinearSupported(a));
  auto with = [&](auto edit) {
    ck::SkinnyLinearArgs b = a;
    edit(b);
    return ck::SkinnyLinearSupported(b);
  };
  EXPECT_TRUE(with([](ck::SkinnyLinearArgs& b) { b.n = ck::kSkinnyMaxRows; }));
  EXPECT_FALSE(with([](ck::SkinnyLinearArgs& b) { b.n = 0; }));
  EXPECT_FALSE(
      with([](ck::SkinnyLinearArgs& b) { b.n = ck::kSkinnyMaxRows + 1; }));
  EXPECT_FALSE(with([](ck::SkinnyLinearArgs& b) { b.in = 12; }));
  EXPECT_FALSE(with([](ck::SkinnyLinearArgs& b) { b.in = 0; }));
  EXPECT_FALSE(with([](ck::SkinnyLinearArgs& b) { b.out = 0; }));
  EXPECT_FALSE(with([](ck::SkinnyLinearArgs& b) { b.x = buf + 2; }));
  EXPECT_FALSE(with([](ck::SkinnyLinearArgs& b) { b.w = buf + 8; }));
  EXPECT_FALSE(with([](ck::SkinnyLinearArgs& b) { b.y = nullptr; }));
  EXPECT_FALSE(
      with([](ck::SkinnyLinearArgs& b) { b.dtype = CudaDType::kF32; }));
  EXPECT_TRUE(with([](ck::SkinnyLinearArgs& b) { b.beta = 1.0f; }));
  EXPECT_FALSE(with([](ck::SkinnyLinearArgs& b) { b.beta = 0.5f; }));
  EXPECT_TRUE(
      with([](ck::SkinnyLinearArgs& b) { b.y_dtype = CudaDType::kBF16; }));
  // A 16-bit output has no residual add, and matches the operands.
  EXPECT_FALSE(with([](ck::SkinnyLinearArgs& b) {
    b.y_dtype = CudaDType::kBF16;
    b.beta = 1.0f;
  }));
  EXPECT_FALSE(
      with([](ck::SkinnyLinearArgs& b) { b.y_dtype = CudaDType::kFP16; }));
  // Unsupported arguments fail before any CUDA call.
  ck::SkinnyLinearArgs bad = a;
  bad.n = 0;
  EXPECT_EQ(ck::SkinnyLinear(bad, nullptr), cudaErrorInvalidValue);
}

// The 16-bit bits of v (round to nearest even) and their value.
uint16_t Round16(float v, CudaDType dt, float* back) {
  if (dt == CudaDType::kBF16) {
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    *back = __bfloat162float(h);
    uint16_t bits;
    std::memcpy(&bits, &h, 2);
    return bits;
  }
  const __half h = __float2half_rn(v);
  *back = __half2float(h);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

float From16(uint16_t bits, CudaDType dt) {
  if (dt == CudaDType::kBF16) {
    __nv_bfloat16 h;
    std::memcpy(&h, &bits, 2);
    return __bfloat162float(h);
  }
  __half h;
  std::memcpy(&h, &bits, 2);
  return __half2float(h);
}

struct Shape {
  int in, out;
};

class SkinnyLinearTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaAvailable()) {
      GTEST_SKIP() << "no CUDA device: " << CudaDeviceDescription();
    }
  }
};

TEST_F(SkinnyLinearTest, MatchesHostReference) {
  // in: one pack a lane (16), a partial stride (136), several strides of
  // 4 packs a lane (2056 = 8 x 257); out: partial blocks (8 columns a
  // block) and an odd count (a warp's second column past the end).
  const std::vector<Shape> shapes = {{16, 1}, {136, 37}, {2056, 19}};
  constexpr int kGuard = 64;
  constexpr float kSentinel = 12345.0f;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (CudaDType dt : {CudaDType::kBF16, CudaDType::kFP16}) {
    for (const Shape& s : shapes) {
      for (int n = 1; n <= ck::kSkinnyMaxRows; ++n) {
        // Operands rounded on the host exactly as the device holds them.
        std::vector<uint16_t> xb(static_cast<size_t>(n) * s.in),
            wb(static_cast<size_t>(s.out) * s.in);
        std::vector<double> xv(xb.size()), wv(wb.size());
        for (size_t i = 0; i < xb.size(); ++i) {
          float back;
          xb[i] = Round16(nd(rng), dt, &back);
          xv[i] = back;
        }
        for (size_t i = 0; i < wb.size(); ++i) {
          float back;
          wb[i] = Round16(0.05f * nd(rng), dt, &back);
          wv[i] = back;
        }
        // ref[r, o] and the scale of its terms (sum |x w|).
        std::vector<double> ref(static_cast<size_t>(n) * s.out),
            mag(ref.size());
        for (int r = 0; r < n; ++r) {
          for (int o = 0; o < s.out; ++o) {
            double acc = 0, m = 0;
            for (int k = 0; k < s.in; ++k) {
              const double t = xv[size_t(r) * s.in + k] *
                               wv[size_t(o) * s.in + k];
              acc += t;
              m += std::fabs(t);
            }
            ref[size_t(r) * s.out + o] = acc;
            mag[size_t(r) * s.out + o] = m;
          }
        }
        DeviceArray x(2 * xb.size()), w(2 * wb.size());
        ASSERT_CUDA_OK(x.Upload(xb));
        ASSERT_CUDA_OK(w.Upload(wb));
        for (int mode = 0; mode < 3; ++mode) {  // f32 b=0, f32 b=1, 16-bit
          SCOPED_TRACE(absl::StrCat(CudaDTypeName(dt), " n=", n, " in=",
                                    s.in, " out=", s.out, " mode=", mode));
          const bool f32 = mode < 2;
          const float beta = mode == 1 ? 1.0f : 0.0f;
          const size_t count = ref.size();
          std::vector<double> want = ref;
          DeviceArray y((f32 ? 4 : 2) * (count + kGuard));
          std::vector<float> y0;
          std::vector<uint16_t> y0h;
          if (f32) {
            // The residual for beta = 1; NaN for beta = 0, which must not
            // read it; the guard's sentinels after.
            y0.resize(count + kGuard, kSentinel);
            for (size_t i = 0; i < count; ++i) {
              y0[i] = mode == 1 ? nd(rng) : std::nanf("");
              if (mode == 1) want[i] += y0[i];
            }
            ASSERT_CUDA_OK(y.Upload(y0));
          } else {
            float back;
            y0h.assign(count + kGuard, Round16(kSentinel, dt, &back));
            ASSERT_CUDA_OK(y.Upload(y0h));
          }
          ck::SkinnyLinearArgs a;
          a.x = x.get();
          a.w = w.get();
          a.y = y.get();
          a.n = n;
          a.in = s.in;
          a.out = s.out;
          a.dtype = dt;
          a.y_dtype = f32 ? CudaDType::kF32 : dt;
          a.beta = beta;
          ASSERT_TRUE(ck::SkinnyLinearSupported(a));
          ASSERT_CUDA_OK(ck::SkinnyLinear(a, nullptr));
          ASSERT_CUDA_OK(cudaDeviceSynchronize());
          std::vector<double> got(count + kGuard);
          if (f32) {
            std::vector<float> g(count + kGuard);
            ASSERT_CUDA_OK(y.Download(&g));
            for (size_t i = 0; i < g.size(); ++i) got[i] = g[i];
          } else {
            std::vector<uint16_t> g(count + kGuard);
            ASSERT_CUDA_OK(y.Download(&g));
            for (size_t i = 0; i < g.size(); ++i) got[i] = From16(g[i], dt);
          }
          // fp32 sums in another order: 1e-5 of the terms' scale; a 16-bit
          // output adds its rounding (bf16: 2^-8 of the value).
          const double round = !f32 ? (dt == CudaDType::kBF16 ? 1.0 / 256
                                                              : 1.0 / 2048)
                                    : 0.0;
          int bad = 0;
          for (size_t i = 0; i < count && bad < 5; ++i) {
            const double tol = 1e-5 * (mag[i] + 1) + round * std::fabs(want[i]);
            if (!(std::fabs(got[i] - want[i]) <= tol)) {
              ADD_FAILURE() << "y[" << i / s.out << ", " << i % s.out
                            << "] = " << got[i] << ", want " << want[i];
              ++bad;
            }
          }
          float guard = kSentinel;  // as the guard holds it
          if (!f32) Round16(kSentinel, dt, &guard);
          for (size_t i = count; i < count + kGuard; ++i) {
            ASSERT_EQ(got[i], guard) << "wrote past y at " << i;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace specserve
