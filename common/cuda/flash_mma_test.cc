// cuda_kernels::FlashMmaAttention (flash_mma.cu):
// - argument checks (run everywhere: they precede any CUDA call);
// - agreement with a float64 host reference of paged causal grouped-query
//   attention (inputs rounded to bf16 / fp16 on the host exactly as the
//   device stores them; K and V scattered into a paged pool through a
//   shuffled block table whose unused rows hold NaN, so a read of a wrong
//   row shows), over full prefills (first = 0), chunks after cached keys,
//   GQA groups of 4, 2 and 1, head_dim 64 and 128, bf16 and fp16, lengths
//   that are not tile multiples, block sizes 16 and 1 and a contiguous
//   cache;
// - agreement with the WMMA kernel cuda_kernels::FlashAttention on the same
//   inputs;
// - a timing report of both kernels at n = 4096 and 16384 (prints only).
// GPU tests skip where no CUDA device is present.

#include "common/cuda/flash_mma.h"

#include <cuda_runtime_api.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/cuda/device.h"
#include "common/cuda/device_array_test_util.h"
#include "common/cuda/kernels.h"
#include "common/cuda/prefill_attention_test_util.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

namespace ck = cuda_kernels;

using attention_test::Case;
using attention_test::CaseName;
using attention_test::ExpectClose;
using attention_test::MakeProblem;
using attention_test::Problem;
using attention_test::Reference;
using attention_test::RunKernel;

class FlashMmaTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!CudaAvailable()) {
      GTEST_SKIP() << "no CUDA device: " << CudaDeviceDescription();
    }
  }
};

TEST_P(FlashMmaTest, MatchesHostReference) {
  const Case& c = GetParam();
  const Problem p = MakeProblem(c, 1234 + c.n * 7 + c.first);
  std::vector<float> got;
  RunKernel(p, &ck::FlashMmaAttention, &got);
  if (HasFatalFailure()) return;
  ExpectClose(c, got, Reference(p), 1e-2, "FlashMmaAttention");
}

TEST_P(FlashMmaTest, AgreesWithFlashAttention) {
  const Case& c = GetParam();
  const Problem p = MakeProblem(c, 99 + c.n * 3 + c.first);
  std::vector<float> mma, wmma;
  RunKernel(p, &ck::FlashMmaAttention, &mma);
  if (HasFatalFailure()) return;
  RunKernel(p, &ck::FlashAttention, &wmma);
  if (HasFatalFailure()) return;
  const std::vector<double> ref = Reference(p);
  ExpectClose(c, wmma, ref, 1e-2, "FlashAttention");
  ExpectClose(c, mma, std::vector<double>(wmma.begin(), wmma.end()), 2e-2,
              "FlashMmaAttention vs FlashAttention");
}

INSTANTIATE_TEST_SUITE_P(Shapes, FlashMmaTest, ::testing::ValuesIn(attention_test::Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return CaseName(info.param);
                         });

// ---------------------------------------------------------------------------
// Argument checks: host-only, no CUDA call (fake device pointers are never
// dereferenced because every call here is rejected or has n == 0).
// ---------------------------------------------------------------------------
ck::AttentionArgs ValidLookingArgs() {
  ck::AttentionArgs a;
  a.q = reinterpret_cast<const void*>(uintptr_t{0x10000});
  a.k_cache = reinterpret_cast<const void*>(uintptr_t{0x20000});
  a.v_cache = reinterpret_cast<const void*>(uintptr_t{0x30000});
  a.out = reinterpret_cast<void*>(uintptr_t{0x40000});
  a.dtype = CudaDType::kBF16;
  a.n = 5;
  a.first = 3;
  a.num_heads = 8;
  a.num_kv_heads = 2;
  a.head_dim = 128;
  a.scale = 0.125f;
  return a;
}

TEST(FlashMmaArgsTest, Supported) {
  EXPECT_TRUE(ck::FlashMmaSupported(64, CudaDType::kBF16));
  EXPECT_TRUE(ck::FlashMmaSupported(128, CudaDType::kBF16));
  EXPECT_TRUE(ck::FlashMmaSupported(64, CudaDType::kFP16));
  EXPECT_TRUE(ck::FlashMmaSupported(128, CudaDType::kFP16));
  EXPECT_FALSE(ck::FlashMmaSupported(128, CudaDType::kF32));
  for (int d : {0, 16, 32, 80, 96, 256}) {
    EXPECT_FALSE(ck::FlashMmaSupported(d, CudaDType::kBF16)) << d;
  }
}

TEST(FlashMmaArgsTest, RejectsBadArgumentsBeforeAnyCudaCall) {
  struct Bad {
    const char* what;
    void (*mutate)(ck::AttentionArgs*);
  };
  static int table[4];
  static unsigned long long mask[4];
  const Bad bad[] = {
      {"head_dim 32", [](ck::AttentionArgs* a) { a->head_dim = 32; }},
      {"head_dim 256", [](ck::AttentionArgs* a) { a->head_dim = 256; }},
      {"f32", [](ck::AttentionArgs* a) { a->dtype = CudaDType::kF32; }},
      {"tree_start", [](ck::AttentionArgs* a) { a->tree_start = table; }},
      {"tree_mask", [](ck::AttentionArgs* a) { a->tree_mask = mask; }},
      {"n < 0", [](ck::AttentionArgs* a) { a->n = -1; }},
      {"first < 0", [](ck::AttentionArgs* a) { a->first = -1; }},
      {"no kv heads", [](ck::AttentionArgs* a) { a->num_kv_heads = 0; }},
      {"H % KV", [](ck::AttentionArgs* a) { a->num_heads = 7; }},
      {"H < KV", [](ck::AttentionArgs* a) { a->num_heads = 1; }},
      {"no heads", [](ck::AttentionArgs* a) { a->num_heads = 0; }},
      {"first + n overflows",
       [](ck::AttentionArgs* a) { a->first = INT_MAX - 2; }},
      {"a row block past first + n overflows",
       [](ck::AttentionArgs* a) { a->first = INT_MAX - 100; }},
      {"too many rows", [](ck::AttentionArgs* a) { a->n = 64 * 65535 + 1; }},
      {"block_size 0",
       [](ck::AttentionArgs* a) {
         a->block_table = table;
         a->block_size = 0;
       }},
      {"null q", [](ck::AttentionArgs* a) { a->q = nullptr; }},
      {"null k", [](ck::AttentionArgs* a) { a->k_cache = nullptr; }},
      {"null v", [](ck::AttentionArgs* a) { a->v_cache = nullptr; }},
      {"null out", [](ck::AttentionArgs* a) { a->out = nullptr; }},
      {"misaligned q",
       [](ck::AttentionArgs* a) {
         a->q = reinterpret_cast<const void*>(uintptr_t{0x10008});
       }},
      {"misaligned k",
       [](ck::AttentionArgs* a) {
         a->k_cache = reinterpret_cast<const void*>(uintptr_t{0x20002});
       }},
      {"misaligned v",
       [](ck::AttentionArgs* a) {
         a->v_cache = reinterpret_cast<const void*>(uintptr_t{0x30004});
       }},
      {"misaligned out",
       [](ck::AttentionArgs* a) {
         a->out = reinterpret_cast<void*>(uintptr_t{0x40002});
       }},
  };
  for (const Bad& b : bad) {
    ck::AttentionArgs a = ValidLookingArgs();
    b.mutate(&a);
    EXPECT_EQ(ck::FlashMmaAttention(a, nullptr), cudaErrorInvalidValue)
        << b.what;
  }
}

TEST(FlashMmaArgsTest, ZeroRowsIsANoOp) {
  ck::AttentionArgs a = ValidLookingArgs();
  a.n = 0;
  EXPECT_EQ(ck::FlashMmaAttention(a, nullptr), cudaSuccess);
  a.q = nullptr;
  a.out = nullptr;
  EXPECT_EQ(ck::FlashMmaAttention(a, nullptr), cudaSuccess);
  a.tree_start = reinterpret_cast<const int*>(uintptr_t{0x50000});
  EXPECT_EQ(ck::FlashMmaAttention(a, nullptr), cudaErrorInvalidValue);
}

// ---------------------------------------------------------------------------
// Timing (prints only): causal prefill, H = 32, KV = 8, D = 128, bf16,
// block size 16 through a shuffled table.
// ---------------------------------------------------------------------------
TEST(FlashMmaTimingTest, ReportsTflops) {
  if (!CudaAvailable()) {
    GTEST_SKIP() << "no CUDA device: " << CudaDeviceDescription();
  }
  std::printf("device: %s\n", CudaDeviceDescription().c_str());
  for (int n : {4096, 16384}) {
    const attention_test::TimingProblem p(n);
    attention_test::TimeAndReport("FlashMmaAttention", p, [&] {
      return ck::FlashMmaAttention(p.args, nullptr);
    });
    attention_test::TimeAndReport("FlashAttention (WMMA)", p, [&] {
      return ck::FlashAttention(p.args, nullptr);
    });
  }
}

}  // namespace
}  // namespace specserve
