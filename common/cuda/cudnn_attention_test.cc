// CudnnAttention (cudnn_attention.h):
// - shape validation and, where libcudnn loads (it does on the build
//   machines, without a GPU), every tensor and operation descriptor of the
//   SDPA graph finalizing against the real library;
// - on a GPU: agreement with the float64 host reference over the shared
//   prefill cases (prefill_attention_test_util.h), K / V gathered out of a
//   shuffled paged pool by GatherKvRows as the runner does it; agreement
//   with the WMMA FlashAttention; the plan cache; a timing report next to
//   the two kernels of ours (prints only).
// GPU tests skip where no CUDA device is present or libcudnn is missing.

#include "common/cuda/cudnn_attention.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "common/cuda/device.h"
#include "common/cuda/device_array_test_util.h"
#include "common/cuda/flash_mma.h"
#include "common/cuda/kernels.h"
#include "common/cuda/prefill_attention_test_util.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

namespace ck = cuda_kernels;
using attention_test::Case;
using attention_test::CaseName;
using attention_test::ExpectClose;
using attention_test::FromBits;
using attention_test::MakeProblem;
using attention_test::Problem;
using attention_test::Reference;
using attention_test::RunKernel;
using attention_test::Scale;
using attention_test::ToBf16;
using testing_cuda::DeviceArray;

CudnnSdpaShape ShapeOf(const Case& c) {
  return CudnnSdpaShape{c.n,           c.first + c.n, c.num_heads,
                        c.num_kv_heads, c.head_dim,    c.dtype};
}

// ---------------------------------------------------------------------------
// Host-only.
// ---------------------------------------------------------------------------
TEST(CudnnHostTest, ValidatesShapes) {
  const CudnnSdpaShape good{100, 300, 32, 8, 128, CudaDType::kBF16};
  EXPECT_TRUE(ValidateCudnnSdpaShape(good).ok());
  struct Bad {
    CudnnSdpaShape shape;
    const char* field;
  };
  const Bad bad[] = {
      {{0, 300, 32, 8, 128, CudaDType::kBF16}, "s_q"},
      {{100, 99, 32, 8, 128, CudaDType::kBF16}, "s_kv"},
      {{100, 300, 30, 8, 128, CudaDType::kBF16}, "num_heads"},
      {{100, 300, 32, 0, 128, CudaDType::kBF16}, "num_kv_heads"},
      {{100, 300, 4, 8, 128, CudaDType::kBF16}, "num_heads"},
      {{100, 300, 32, 8, 96, CudaDType::kBF16}, "head_dim"},
      {{100, 300, 32, 8, 128, CudaDType::kF32}, "dtype"},
  };
  for (const Bad& b : bad) {
    const absl::Status s = ValidateCudnnSdpaShape(b.shape);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.field;
    EXPECT_NE(s.message().find(b.field), std::string::npos) << s;
    EXPECT_EQ(CheckCudnnSdpaOperations(b.shape).status().code(),
              absl::StatusCode::kInvalidArgument)
        << b.field;
  }
}

// The graph as cuDNN's frontend lowers it: 14 operations with the causal
// mask aligned top-left (s_q == s_kv), 16 with the bottom-right shift (two
// more integer pointwise ops). Finalizing each descriptor checks attribute
// types, dimensions and strides against the library itself.
TEST(CudnnHostTest, OperationsFinalizeAgainstTheLibrary) {
  if (!CudnnLibraryLoads()) {
    GTEST_SKIP() << "libcudnn.so.9 does not load here";
  }
  std::printf("cuDNN %zu\n", CudnnAttention::LibraryVersion());
  for (CudaDType dt : {CudaDType::kBF16, CudaDType::kFP16}) {
    for (int d : {64, 128}) {
      for (const auto& [s_q, s_kv, h, kv, ops] :
           {std::tuple<int, int, int, int, int>{2048, 2048, 32, 8, 14},
            {100, 100, 16, 8, 14},
            {2048, 6144, 32, 8, 16},
            {33, 1000, 8, 8, 16}}) {
        const CudnnSdpaShape shape{s_q, s_kv, h, kv, d, dt};
        absl::StatusOr<int> n = CheckCudnnSdpaOperations(shape);
        ASSERT_TRUE(n.ok()) << n.status();
        EXPECT_EQ(*n, ops) << "s_q " << s_q << " s_kv " << s_kv;
      }
    }
  }
}

TEST(CudnnHostTest, CreateFailsCleanlyWithoutAGpu) {
  if (CudaAvailable()) GTEST_SKIP() << "a CUDA device is present";
  absl::StatusOr<std::unique_ptr<CudnnAttention>> a =
      CudnnAttention::Create(nullptr);
  EXPECT_FALSE(a.ok());
  EXPECT_TRUE(a.status().code() == absl::StatusCode::kUnavailable ||
              a.status().code() == absl::StatusCode::kInternal)
      << a.status();
}

// ---------------------------------------------------------------------------
// On a GPU.
// ---------------------------------------------------------------------------
class CudnnGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaAvailable()) {
      GTEST_SKIP() << "no CUDA device: " << CudaDeviceDescription();
    }
    if (!CudnnLibraryLoads()) {
      GTEST_SKIP() << "libcudnn.so.9 not found: tools/gpu/gpu_env.sh puts "
                      "the PyTorch wheel's on LD_LIBRARY_PATH";
    }
    absl::StatusOr<std::unique_ptr<CudnnAttention>> a =
        CudnnAttention::Create(nullptr);
    ASSERT_TRUE(a.ok()) << a.status();
    attn_ = *std::move(a);
  }

  // Runs the problem as the runner does: K and V gathered out of the paged
  // pool into dense rows, then one cuDNN call. *out gets the decoded output
  // (poisoned with NaN bits first). Returns Run's status.
  absl::Status RunCudnn(const Problem& p, std::vector<float>* out) {
    const Case& c = p.c;
    const int total = c.first + c.n;
    const int width = c.num_kv_heads * c.head_dim;
    DeviceArray d_q(p.q.size() * 2), d_k(p.pool_k.size() * 2),
        d_v(p.pool_v.size() * 2), d_out(p.q.size() * 2),
        dense_k(static_cast<size_t>(total) * width * 2),
        dense_v(static_cast<size_t>(total) * width * 2);
    EXPECT_EQ(d_q.Upload(p.q), cudaSuccess);
    EXPECT_EQ(d_k.Upload(p.pool_k), cudaSuccess);
    EXPECT_EQ(d_v.Upload(p.pool_v), cudaSuccess);
    std::vector<int> table = p.block_table;
    int block_size = c.block_size;
    if (table.empty()) {  // contiguous: the identity table of 1-row blocks
      table.resize(total);
      std::iota(table.begin(), table.end(), 0);
      block_size = 1;
    }
    DeviceArray d_ident(table.size() * sizeof(int));
    EXPECT_EQ(d_ident.Upload(table), cudaSuccess);
    std::vector<uint16_t> out_bits(p.q.size(), 0xFFFF);
    EXPECT_EQ(d_out.Upload(out_bits), cudaSuccess);
    const int* t = static_cast<const int*>(d_ident.get());
    EXPECT_EQ(ck::GatherKvRows(d_k.get(), c.dtype, t, block_size, total,
                               width, dense_k.get(), nullptr),
              cudaSuccess);
    EXPECT_EQ(ck::GatherKvRows(d_v.get(), c.dtype, t, block_size, total,
                               width, dense_v.get(), nullptr),
              cudaSuccess);
    const absl::Status s = attn_->Run(ShapeOf(c), d_q.get(), dense_k.get(),
                                      dense_v.get(), d_out.get(), Scale(c));
    if (!s.ok()) return s;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(d_out.Download(&out_bits), cudaSuccess);
    out->resize(out_bits.size());
    for (size_t i = 0; i < out_bits.size(); ++i) {
      (*out)[i] = FromBits(out_bits[i], c.dtype);
    }
    return absl::OkStatus();
  }

  std::unique_ptr<CudnnAttention> attn_;
};

class CudnnCaseTest : public CudnnGpuTest,
                      public ::testing::WithParamInterface<Case> {};

// The runner sends cuDNN chunks of >= 32 rows (kFlashMinRows): for those a
// missing plan is a failure; shorter ones may be unsupported, but must be
// right when they run.
TEST_P(CudnnCaseTest, MatchesHostReference) {
  const Case& c = GetParam();
  const Problem p = MakeProblem(c, 4321 + c.n * 5 + c.first);
  std::vector<float> got;
  const absl::Status s = RunCudnn(p, &got);
  if (c.n < 32 && absl::IsUnimplemented(s)) {
    GTEST_SKIP() << CaseName(c) << ": " << s;
  }
  ASSERT_TRUE(s.ok()) << CaseName(c) << ": " << s;
  ExpectClose(c, got, Reference(p), 1e-2, "cuDNN SDPA");
}

TEST_P(CudnnCaseTest, AgreesWithFlashAttention) {
  const Case& c = GetParam();
  const Problem p = MakeProblem(c, 77 + c.n * 3 + c.first);
  std::vector<float> cudnn, wmma;
  const absl::Status s = RunCudnn(p, &cudnn);
  if (c.n < 32 && absl::IsUnimplemented(s)) GTEST_SKIP() << s;
  ASSERT_TRUE(s.ok()) << s;
  RunKernel(p, &ck::FlashAttention, &wmma);
  if (HasFatalFailure()) return;
  ExpectClose(c, cudnn, std::vector<double>(wmma.begin(), wmma.end()), 2e-2,
              "cuDNN SDPA vs FlashAttention");
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudnnCaseTest,
                         ::testing::ValuesIn(attention_test::Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return CaseName(info.param);
                         });

// One plan per shape: a second call with the shape builds nothing; a new
// shape builds one more; bad arguments fail before any plan is built.
TEST_F(CudnnGpuTest, PlansAreCachedPerShape) {
  Case c;
  c.num_heads = 16;
  c.num_kv_heads = 8;
  c.n = 96;
  c.first = 160;
  const Problem p = MakeProblem(c, 5);
  std::vector<float> out;
  ASSERT_TRUE(RunCudnn(p, &out).ok());
  const int built = attn_->plans_built();
  EXPECT_GE(built, 1);
  ASSERT_TRUE(RunCudnn(p, &out).ok());
  EXPECT_EQ(attn_->plans_built(), built);
  c.first = 161;
  ASSERT_TRUE(RunCudnn(MakeProblem(c, 6), &out).ok());
  EXPECT_EQ(attn_->plans_built(), built + 1);
  std::printf("%d plans built in %.3f s\n", attn_->plans_built(),
              attn_->plan_build_seconds());
  EXPECT_EQ(attn_->Run(ShapeOf(c), nullptr, nullptr, nullptr, nullptr, 1.0f)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(attn_->plans_built(), built + 1);
}

// Timing (prints only): causal prefill at n = 4096 and 16384, H = 32,
// KV = 8, D = 128, bf16, next to FlashMmaAttention and the WMMA kernel on
// the same paged inputs (cuDNN's time includes the K / V gather).
TEST_F(CudnnGpuTest, ReportsTflops) {
  std::printf("device: %s, cuDNN %zu\n", CudaDeviceDescription().c_str(),
              CudnnAttention::LibraryVersion());
  constexpr int kH = 32, kKV = 8, kD = 128, kBs = 16;
  for (int n : {4096, 16384}) {
    std::mt19937 rng(n);
    auto fill = [&rng](std::vector<uint16_t>* v) {
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      for (auto& x : *v) x = ToBf16(u(rng));
    };
    const int blocks = (n + kBs - 1) / kBs;
    const size_t width = static_cast<size_t>(kKV) * kD;
    std::vector<uint16_t> q(static_cast<size_t>(n) * kH * kD);
    std::vector<uint16_t> kv(static_cast<size_t>(blocks) * kBs * width);
    fill(&q);
    fill(&kv);
    std::vector<int> table(blocks);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    DeviceArray d_q(q.size() * 2), d_k(kv.size() * 2), d_v(kv.size() * 2),
        d_out(q.size() * 2), d_table(table.size() * sizeof(int)),
        dense_k(n * width * 2), dense_v(n * width * 2);
    ASSERT_CUDA_OK(d_q.Upload(q));
    ASSERT_CUDA_OK(d_k.Upload(kv));
    ASSERT_CUDA_OK(d_v.Upload(kv));
    ASSERT_CUDA_OK(d_table.Upload(table));
    ck::AttentionArgs a;
    a.q = d_q.get();
    a.k_cache = d_k.get();
    a.v_cache = d_v.get();
    a.out = d_out.get();
    a.dtype = CudaDType::kBF16;
    a.n = n;
    a.num_heads = kH;
    a.num_kv_heads = kKV;
    a.head_dim = kD;
    a.scale = 1.0f / std::sqrt(float(kD));
    a.block_table = static_cast<const int*>(d_table.get());
    a.block_size = kBs;
    const CudnnSdpaShape shape{n, n, kH, kKV, kD, CudaDType::kBF16};
    const double build0 = attn_->plan_build_seconds();
    ASSERT_TRUE(attn_->Prepare(shape).ok()) << attn_->Prepare(shape);
    std::printf("cuDNN plan for n=%d built in %.3f s\n", n,
                attn_->plan_build_seconds() - build0);
    auto cudnn = [&]() -> cudaError_t {
      cudaError_t e = ck::GatherKvRows(d_k.get(), a.dtype, a.block_table, kBs,
                                       n, width, dense_k.get(), nullptr);
      if (e != cudaSuccess) return e;
      e = ck::GatherKvRows(d_v.get(), a.dtype, a.block_table, kBs, n, width,
                           dense_v.get(), nullptr);
      if (e != cudaSuccess) return e;
      return attn_->Run(shape, a.q, dense_k.get(), dense_v.get(), a.out,
                        a.scale)
                     .ok()
                 ? cudaSuccess
                 : cudaErrorUnknown;
    };
    const double flops = 4.0 * kD * kH * (double(n) * (n + 1) / 2);
    cudaEvent_t start, stop;
    ASSERT_CUDA_OK(cudaEventCreate(&start));
    ASSERT_CUDA_OK(cudaEventCreate(&stop));
    for (int k = 0; k < 3; ++k) {
      const char* name = k == 0   ? "cuDNN SDPA (+gather)"
                         : k == 1 ? "FlashMmaAttention"
                                  : "FlashAttention (WMMA)";
      auto launch = [&]() -> cudaError_t {
        if (k == 0) return cudnn();
        return k == 1 ? ck::FlashMmaAttention(a, nullptr)
                      : ck::FlashAttention(a, nullptr);
      };
      ASSERT_CUDA_OK(launch());  // warm-up
      ASSERT_CUDA_OK(cudaDeviceSynchronize());
      constexpr int kReps = 5;
      ASSERT_CUDA_OK(cudaEventRecord(start, nullptr));
      for (int r = 0; r < kReps; ++r) ASSERT_CUDA_OK(launch());
      ASSERT_CUDA_OK(cudaEventRecord(stop, nullptr));
      ASSERT_CUDA_OK(cudaEventSynchronize(stop));
      float ms = 0.0f;
      ASSERT_CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
      ms /= kReps;
      std::printf("%-22s n=%-6d H=%d KV=%d D=%d causal: %8.3f ms  %6.1f "
                  "TFLOP/s\n",
                  name, n, kH, kKV, kD, ms, flops / (ms * 1e-3) / 1e12);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
}

}  // namespace
}  // namespace specserve
