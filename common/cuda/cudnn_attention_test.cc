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
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <tuple>
#include <utility>
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

// Buckets: powers of two up to 256, then multiples of 256; s_kv grows by
// the same rows, so the causal diagonal's offset s_kv - s_q is kept.
TEST(CudnnHostTest, PaddedShapesKeepTheDiagonal) {
  const std::pair<int, int> buckets[] = {
      {1, 1},     {2, 2},     {3, 4},     {32, 32},    {33, 64},
      {100, 128}, {256, 256}, {257, 512}, {2000, 2048}, {2048, 2048},
      {2049, 2304}};
  for (const auto& [s_q, want] : buckets) {
    for (int first : {0, 5, 2048}) {
      const CudnnSdpaShape shape{s_q, s_q + first, 32, 8, 128,
                                 CudaDType::kBF16};
      const CudnnSdpaShape p = PaddedCudnnSdpaShape(shape);
      EXPECT_EQ(p.s_q, want) << s_q;
      EXPECT_EQ(p.s_kv - p.s_q, first) << s_q;
      EXPECT_EQ(p.num_heads, 32);
      EXPECT_EQ(p.num_kv_heads, 8);
      EXPECT_EQ(p.head_dim, 128);
      EXPECT_EQ(p.dtype, CudaDType::kBF16);
    }
  }
}

// Llama 3.1 8B (32 heads of 128, 32 layers) and 3.2 1B (32 of 64, 16
// layers): full 2048-row chunks always plan; other chunks plan only with
// ~1e13 FLOPs of attention over the model's layers.
TEST(CudnnHostTest, PlansPayOffForFullChunksAndLongTails) {
  const auto big = [](int s_q, int s_kv) {
    return CudnnSdpaShape{s_q, s_kv, 32, 8, 128, CudaDType::kBF16};
  };
  const auto small = [](int s_q, int s_kv) {
    return CudnnSdpaShape{s_q, s_kv, 32, 8, 64, CudaDType::kBF16};
  };
  EXPECT_TRUE(CudnnPlanPaysOff(big(2048, 2048), 32));
  EXPECT_TRUE(CudnnPlanPaysOff(small(2048, 2048), 16));
  EXPECT_TRUE(CudnnPlanPaysOff(small(2048, 32768), 16));
  // A 1500-row tail after 28.5K keys: 4 * 4096 * 1500 * 29250 * 32 = 2.3e13.
  EXPECT_TRUE(CudnnPlanPaysOff(big(1500, 30000), 32));
  // After 1.5K keys: 1.8e12, under a plan's build time on FlashMma.
  EXPECT_FALSE(CudnnPlanPaysOff(big(1500, 3000), 32));
  // A 256-token prompt split by the step's token budget; a pruned 32K
  // prompt's kept tail (keep 0.1) on the speculator's shape.
  EXPECT_FALSE(CudnnPlanPaysOff(big(213, 213), 32));
  EXPECT_FALSE(CudnnPlanPaysOff(big(43, 256), 32));
  EXPECT_FALSE(CudnnPlanPaysOff(small(1249, 3297), 16));
  // The work grows with the layers.
  EXPECT_FALSE(CudnnPlanPaysOff(big(1024, 24576), 1));
  EXPECT_TRUE(CudnnPlanPaysOff(big(1024, 24576), 32));
}

// Ski rental: a recurring shape runs on FlashMma until the work it has run
// there reaches a plan's worth, then plans; full chunks plan at once;
// nearby lengths share a padded shape and its count; counts restart when
// the table is full.
TEST(CudnnHostTest, PlanPolicyPlansAShapeOnceItsUsesPaidForThePlan) {
  const auto big = [](int s_q, int s_kv) {
    return CudnnSdpaShape{s_q, s_kv, 32, 8, 128, CudaDType::kBF16};
  };
  CudnnPlanPolicy policy;
  EXPECT_TRUE(policy.ShouldPlan(big(2048, 4096), 32));
  // The 8B's kept tail of a 32K prompt at keep 0.3: 7.7e12 FLOPs a use.
  EXPECT_FALSE(policy.ShouldPlan(big(1638, 9830), 32));
  EXPECT_TRUE(policy.ShouldPlan(big(1638, 9830), 32));
  // At keep 0.1: 1.7e12 a use, so the sixth use plans; 1229 and 1230 rows
  // both pad to 1280 (s_kv 3328).
  for (int i = 0; i < 5; ++i) {
    EXPECT_FALSE(policy.ShouldPlan(i % 2 ? big(1230, 3278) : big(1229, 3277),
                                   32))
        << i;
  }
  EXPECT_TRUE(policy.ShouldPlan(big(1230, 3278), 32));
  // Five uses counted, then a full table forgets them.
  for (int i = 0; i < 5; ++i) policy.ShouldPlan(big(1229, 3277), 32);
  for (int s_kv = 1; s_kv <= static_cast<int>(CudnnPlanPolicy::kMaxShapes);
       ++s_kv) {
    EXPECT_FALSE(policy.ShouldPlan(big(1, s_kv), 32));
  }
  EXPECT_FALSE(policy.ShouldPlan(big(1229, 3277), 32));
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

// An H100 SXM5 80GB as cuDNN describes a device (CUDNN_ATTR_DEVICEPROP_
// JSON_REPRESENTATION), written from NVIDIA's published figures:
// compute capability 9.0, 132 SMs, 227 KiB of opt-in shared memory per
// block, 50 MiB of L2, PCI device id 0x2330. CudnnGpuTest.DevicePropertiesJson
// prints the JSON of the GPU it runs on, to replace this one.
constexpr char kH100Json[] = R"({
  "maxGridSize": [2147483647, 65535, 65535], "maxBlockSize": [1024, 1024, 64],
  "regsPerBlock": 65536, "multiProcessorCount": 132, "warpSize": 32,
  "maxSharedMemoryPerBlock": 49152, "maxSharedMemoryPerBlockOptin": 232448,
  "reservedSharedMemoryPerBlock": 1024, "maxRegistersPerSM": 65536,
  "maxCtasPerSM": 32, "maxThreadsPerBlock": 1024, "maxThreadsPerSM": 2048,
  "pciDeviceId": 9008, "isTccDriver": 0, "supportCoopLaunch": 1,
  "smClockRateKHz": 1980000, "memClockRateKHz": 2619000,
  "l2CacheSize": 52428800, "deviceName": "NVIDIA H100 80GB HBM3",
  "totalGlobalMem": 85031714816, "cudaDeviceId": 0, "deviceVer": 900,
  "driverVer": 13000})";

// cuDNN's fused SDPA engines for Hopper are runtime-compiled: planning
// generates the kernel, compiles it with NVRTC and loads it through the
// driver. Without a GPU the driver is missing and the engines are not even
// tried; the toolkit's stub libcuda (every call fails) lets them get as far
// as the load. Loaded only where no driver is: on a GPU machine the real
// one is used. True when some libcuda is loaded.
bool LoadDriverOrStub() {
  if (dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL) != nullptr) return true;
  // The stub's SONAME is libcuda.so.1, so cuDNN's later dlopen finds it.
  return dlopen("/usr/local/cuda/lib64/stubs/libcuda.so",
                RTLD_NOW | RTLD_GLOBAL) != nullptr;
}

// cuDNN's own heuristics and plan finalization, run for an H100 without
// one (deviceless ahead-of-time planning, cuDNN 9.8+), for full prefills
// and chunks after cached keys, padded as the runner pads them, both dtypes
// and head dims, GQA 4 and 2: the heuristics offer engine configs for the
// graph, and the first one's kernel is generated and compiled by NVRTC.
// With the stub driver the plan then fails at the module load, the one
// step that needs a GPU (the message names cuLibraryLoadData); with a real
// driver it finalizes. Host-only: where a CUDA device is present, planning
// goes further and may refuse a form (cuDNN 9.14 on an H200 refused the
// dynamic-shape one, "does not support dynamic shape", and took the fixed
// shape), so the test skips there; CudnnGpuTest plans and runs on the
// device itself.
TEST(CudnnHostTest, EnginesTakeTheGraphOnAnH100) {
  if (CudaAvailable()) {
    GTEST_SKIP() << "a CUDA device is present: this host-only check expects "
                    "deviceless planning to stop at the module load; "
                    "CudnnGpuTest plans and runs on the device";
  }
  if (!CudnnLibraryLoads() || CudnnAttention::LibraryVersion() < 90800) {
    GTEST_SKIP() << "libcudnn.so.9 >= 9.8 does not load here";
  }
  if (!LoadDriverOrStub()) {
    GTEST_SKIP() << "neither libcuda.so.1 nor the toolkit's stub loads";
  }
  if (dlopen("libnvrtc.so.13", RTLD_NOW) == nullptr &&
      dlopen("/usr/local/cuda/lib64/libnvrtc.so.13", RTLD_NOW) == nullptr) {
    GTEST_SKIP() << "no NVRTC 13: cuDNN cannot compile its kernels here";
  }
  for (CudaDType dt : {CudaDType::kBF16, CudaDType::kFP16}) {
    for (int d : {64, 128}) {
      for (const auto& [s_q, s_kv, h] :
           {std::tuple<int, int, int>{2048, 2048, 32},
            {2048, 8192, 32},
            {100, 100, 16},
            {33, 1000, 16}}) {
        const CudnnSdpaShape shape =
            PaddedCudnnSdpaShape({s_q, s_kv, h, 8, d, dt});
        absl::StatusOr<CudnnAttention::PlanCheck> check =
            CudnnAttention::CheckPlanForDevice(shape, kH100Json,
                                               /*first_form_only=*/true);
        if (!check.ok()) {
          // Compiled, then refused by the stub driver: as far as a host
          // without a GPU can go.
          const std::string why(check.status().message());
          EXPECT_NE(why.find("cuLibraryLoadData"), std::string::npos)
              << CudaDTypeName(dt) << " D=" << d << " s_q=" << shape.s_q
              << " s_kv=" << shape.s_kv << ": " << why;
          continue;
        }
        std::printf("%s D=%d H=%d s_q=%d s_kv=%d: %s, config %d of %d, "
                    "workspace %lld B\n",
                    CudaDTypeName(dt), d, h, shape.s_q, shape.s_kv,
                    check->form.c_str(), check->chosen_config,
                    check->engine_configs,
                    static_cast<long long>(check->workspace_bytes));
      }
    }
  }
  // Both forms in turn for one shape: the fixed-shape form compiles too.
  absl::StatusOr<CudnnAttention::PlanCheck> all = CudnnAttention::CheckPlanForDevice(
      {2048, 4096, 32, 8, 128, CudaDType::kBF16}, kH100Json);
  if (!all.ok()) {
    const std::string why(all.status().message());
    const size_t fixed = why.find("; fixed shape: ");
    ASSERT_NE(fixed, std::string::npos) << why;
    EXPECT_NE(why.find("cuLibraryLoadData", fixed), std::string::npos) << why;
  }
  EXPECT_EQ(CudnnAttention::CheckPlanForDevice(
                {64, 64, 32, 8, 128, CudaDType::kBF16}, "{}")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
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
    const int padded_total = PaddedCudnnSdpaShape(ShapeOf(c)).s_kv;
    const int width = c.num_kv_heads * c.head_dim;
    DeviceArray d_q(p.q.size() * 2), d_k(p.pool_k.size() * 2),
        d_v(p.pool_v.size() * 2), d_out(p.q.size() * 2),
        dense_k(static_cast<size_t>(padded_total) * width * 2),
        dense_v(static_cast<size_t>(padded_total) * width * 2);
    // NaN in the padding rows: Run must overwrite them (a NaN value row
    // times a zero probability is NaN).
    EXPECT_EQ(dense_k.Upload(std::vector<uint16_t>(
                  static_cast<size_t>(padded_total) * width, 0xFFFF)),
              cudaSuccess);
    EXPECT_EQ(dense_v.Upload(std::vector<uint16_t>(
                  static_cast<size_t>(padded_total) * width, 0xFFFF)),
              cudaSuccess);
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

  // One chunk of each (n, first, head_dim) on this one instance, in turn,
  // as a runner plans them: each against the host reference (32 heads over
  // 8 kv heads), printing the plans it built.
  void RunChunksOnOneInstance(
      const std::vector<std::tuple<int, int, int>>& chunks, int seed,
      const char* what) {
    for (const auto& [n, first, d] : chunks) {
      Case c;
      c.head_dim = d;
      c.num_heads = 32;
      c.num_kv_heads = 8;
      c.n = n;
      c.first = first;
      const Problem p = MakeProblem(c, seed++);
      const int before = attn_->plans_built();
      const double seconds = attn_->plan_build_seconds();
      std::vector<float> out;
      const absl::Status s = RunCudnn(p, &out);
      EXPECT_TRUE(s.ok()) << CaseName(c) << ": " << s;
      if (!s.ok()) break;
      const CudnnSdpaShape padded = PaddedCudnnSdpaShape(ShapeOf(c));
      std::printf("%s -> s_q=%d s_kv=%d: %d plan(s) in %.3f s (%s)\n",
                  CaseName(c).c_str(), padded.s_q, padded.s_kv,
                  attn_->plans_built() - before,
                  attn_->plan_build_seconds() - seconds,
                  attn_->last_plan_form().c_str());
      ExpectClose(c, out, Reference(p), 1e-2, what);
    }
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

// The JSON cuDNN gives for this GPU (to check kH100Json against), and
// the same planning from it.
TEST_F(CudnnGpuTest, DevicePropertiesJson) {
  absl::StatusOr<std::string> json = CudnnAttention::DevicePropertiesJson(0);
  ASSERT_TRUE(json.ok()) << json.status();
  std::printf("cuDNN device properties: %s\n", json->c_str());
  const CudnnSdpaShape shape{2048, 4096, 32, 8, 128, CudaDType::kBF16};
  absl::StatusOr<CudnnAttention::PlanCheck> mine =
      CudnnAttention::CheckPlanForDevice(shape, *json);
  ASSERT_TRUE(mine.ok()) << mine.status();
  std::printf("planned from this GPU's JSON: %s, config %d of %d\n",
              mine->form.c_str(), mine->chosen_config,
              mine->engine_configs);
}

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
  c.n = 100;  // the same padded shape (128 rows after 160 keys)
  const Problem p100 = MakeProblem(c, 7);
  ASSERT_TRUE(RunCudnn(p100, &out).ok());
  EXPECT_EQ(attn_->plans_built(), built);
  ExpectClose(c, out, Reference(p100), 1e-2, "cuDNN SDPA, padded shape");
  c.first = 161;
  const Problem p161 = MakeProblem(c, 6);
  ASSERT_TRUE(RunCudnn(p161, &out).ok());
  EXPECT_EQ(attn_->plans_built(), built + 1);
  // A plan whose kernel may come from the cache the first shape filled.
  ExpectClose(c, out, Reference(p161), 1e-2, "cuDNN SDPA, second plan");
  std::printf("%d plans built in %.3f s, the last: %s\n",
              attn_->plans_built(), attn_->plan_build_seconds(),
              attn_->last_plan_form().c_str());
  EXPECT_EQ(attn_->Run(ShapeOf(c), nullptr, nullptr, nullptr, nullptr, 1.0f)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(attn_->plans_built(), built + 1);
}

// The serving path: one instance (as one runner holds) plans shape after
// shape, so every plan after a pattern's first may run a kernel compiled
// for another shape (dynamic shapes, a kernel cache per pattern). Each must
// still give the reference's values, top-left and bottom-right alike.
TEST_F(CudnnGpuTest, OneInstanceServesManyShapes) {
  RunChunksOnOneInstance({{256, 0, 128},
                          {100, 0, 128},
                          {64, 300, 128},
                          {200, 57, 128},
                          {96, 1000, 128},
                          {300, 0, 128},
                          {33, 2, 128}},
                         900, "cuDNN SDPA, shared instance");
}

// What planning costs a request whose prompt length is new (prints only):
// the tail chunk of eight prompt lengths after 2048-row chunks, on an
// instance warmed as the runner warms one (a chunk of 2048 rows after 0
// and after 2048 keys). Then a 2048-row chunk after 28,000 cached keys,
// 8B-shaped, run.
TEST_F(CudnnGpuTest, ReportsPlanCostPerNewPromptLength) {
  const int H = 32, KV = 8, D = 128;
  const CudnnSdpaShape long_chunk{2048, 30048, H, KV, D, CudaDType::kBF16};
  const size_t kv_bytes = static_cast<size_t>(2) * KV * D *
                          PaddedCudnnSdpaShape(long_chunk).s_kv;
  const size_t q_bytes = size_t{2} * 2048 * H * D;
  DeviceArray q(q_bytes), out(q_bytes), k(kv_bytes), v(kv_bytes);
  for (DeviceArray* a : {&q, &out}) {
    ASSERT_EQ(cudaMemset(a->get(), 0, q_bytes), cudaSuccess);
  }
  for (DeviceArray* a : {&k, &v}) {
    ASSERT_EQ(cudaMemset(a->get(), 0, kv_bytes), cudaSuccess);
  }
  for (int s_kv : {2048, 4096}) {
    ASSERT_TRUE(attn_->Prepare({2048, s_kv, H, KV, D, CudaDType::kBF16}).ok());
  }
  const int warm_plans = attn_->plans_built();
  const double warm_s = attn_->plan_build_seconds();
  double worst = 0;
  for (int len : {4100, 4500, 5000, 6001, 7300, 9001, 12000, 16383}) {
    const int tail = len % 2048 == 0 ? 2048 : len % 2048;
    const double before = attn_->plan_build_seconds();
    const absl::Status s =
        attn_->Prepare({tail, len, H, KV, D, CudaDType::kBF16});
    ASSERT_TRUE(s.ok()) << len << ": " << s;
    worst = std::max(worst, attn_->plan_build_seconds() - before);
  }
  std::printf(
      "cudnn plan cost: warm-up %d plan(s) in %.3f s; 8 new prompt lengths "
      "built %d plan(s) in %.3f s (worst %.4f s, %s)\n",
      warm_plans, warm_s, attn_->plans_built() - warm_plans,
      attn_->plan_build_seconds() - warm_s, worst,
      attn_->last_plan_form().c_str());

  auto run = [&] {
    return attn_->Run(long_chunk, q.get(), k.get(), v.get(), out.get(),
                      0.088f);
  };
  ASSERT_TRUE(run().ok());  // plans, and loads the kernel
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaEvent_t start, stop;
  ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&stop), cudaSuccess);
  const int reps = 5;
  cudaEventRecord(start, nullptr);
  for (int r = 0; r < reps; ++r) ASSERT_TRUE(run().ok());
  cudaEventRecord(stop, nullptr);
  float ms = 0;
  ASSERT_EQ(cudaEventSynchronize(stop), cudaSuccess);
  ASSERT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::printf("cudnn plan cost: s_q=2048 after 28000 keys runs as s_kv=%d: "
              "%.3f ms\n",
              PaddedCudnnSdpaShape(long_chunk).s_kv, ms / reps);
}

// Timing (prints only): attention_test::TimingProblem at n = 4096 and
// 16384, cuDNN (its time includes the K / V gather) next to
// FlashMmaAttention and the WMMA kernel on the same paged inputs.
TEST_F(CudnnGpuTest, ReportsTflops) {
  using attention_test::TimingProblem;
  std::printf("device: %s, cuDNN %zu\n", CudaDeviceDescription().c_str(),
              CudnnAttention::LibraryVersion());
  for (int n : {4096, 16384}) {
    const TimingProblem p(n);
    const int width = TimingProblem::kKV * TimingProblem::kD;
    DeviceArray dense_k(static_cast<size_t>(n) * width * 2),
        dense_v(static_cast<size_t>(n) * width * 2);
    const CudnnSdpaShape shape{n, n, TimingProblem::kH, TimingProblem::kKV,
                               TimingProblem::kD, CudaDType::kBF16};
    const double build0 = attn_->plan_build_seconds();
    const absl::Status prepared = attn_->Prepare(shape);
    ASSERT_TRUE(prepared.ok()) << prepared;
    std::printf("cuDNN plan for n=%d built in %.3f s\n", n,
                attn_->plan_build_seconds() - build0);
    const ck::AttentionArgs& a = p.args;
    attention_test::TimeAndReport("cuDNN SDPA (+gather)", p, [&] {
      cudaError_t e = ck::GatherKvRows(a.k_cache, a.dtype, a.block_table,
                                       a.block_size, n, width, dense_k.get(),
                                       nullptr);
      if (e == cudaSuccess) {
        e = ck::GatherKvRows(a.v_cache, a.dtype, a.block_table, a.block_size,
                             n, width, dense_v.get(), nullptr);
      }
      if (e != cudaSuccess) return e;
      return attn_->Run(shape, a.q, dense_k.get(), dense_v.get(), a.out,
                        a.scale)
                     .ok()
                 ? cudaSuccess
                 : cudaErrorUnknown;
    });
    attention_test::TimeAndReport("FlashMmaAttention", p, [&] {
      return ck::FlashMmaAttention(a, nullptr);
    });
    attention_test::TimeAndReport("FlashAttention (WMMA)", p, [&] {
      return ck::FlashAttention(a, nullptr);
    });
  }
}

}  // namespace
}  // namespace specserve
