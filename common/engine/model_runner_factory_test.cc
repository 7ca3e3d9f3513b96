#include "common/engine/model_runner_factory.h"

#include "common/cuda/cuda_model_runner.h"
#include "common/cuda/device.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

std::shared_ptr<const ModelWeights> Load() {
  auto w = LoadModelWeights("models/stories260K");
  EXPECT_TRUE(w.ok()) << w.status();
  return std::make_shared<const ModelWeights>(*std::move(w));
}

TEST(ModelRunnerFactoryTest, CpuRunnerAndPoolSizedInBytes) {
  RunnerOptions o;
  o.device = "cpu";
  o.kv_cache.block_size = 16;
  const size_t per_token = CpuModelRunner::BytesPerToken(Load()->config);
  o.kv_cache.pool_bytes = per_token * 16 * 10 + 5;  // 10 blocks and change
  auto r = CreateModelRunner(Load(), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->backend(), "cpu");
  EXPECT_EQ((*r)->kv_cache().num_blocks(), 10);
  EXPECT_EQ((*r)->kv_cache().block_size(), 16);
}

TEST(ModelRunnerFactoryTest, BadOptionsNameTheField) {
  RunnerOptions o;
  o.device = "tpu";
  auto r = CreateModelRunner(Load(), o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  o.device = "cpu";
  o.kv_cache.block_size = 0;
  r = CreateModelRunner(Load(), o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("block_size"), std::string::npos);
  o.kv_cache.block_size = 16;
  o.prefill_attention = "flash3";
  r = CreateModelRunner(Load(), o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("prefill_attention"), std::string::npos);
  o.prefill_attention = "mma";  // CUDA only; the CPU runner ignores it
  EXPECT_TRUE(CreateModelRunner(Load(), o).ok());
  o.prefill_attention = "cudnn";
  EXPECT_TRUE(CreateModelRunner(Load(), o).ok());
  o.prefill_attention = "flash";
  EXPECT_TRUE(CreateModelRunner(Load(), o).ok());
  o.prefill_attention = "auto";
  o.decode_gemm = "cutlass";
  r = CreateModelRunner(Load(), o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("decode_gemm"), std::string::npos);
  for (const char* gemm : {"auto", "cublas", "skinny"}) {
    o.decode_gemm = gemm;  // CUDA only; the CPU runner ignores it
    EXPECT_TRUE(CreateModelRunner(Load(), o).ok()) << gemm;
  }
  o.kv_cache.pool_bytes = 1;  // less than one block
  EXPECT_EQ(CreateModelRunner(Load(), o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.device = "cuda";
  o.kv_cache.pool_bytes = 0;
  o.cuda_dtype = "fp8";
  if (CudaAvailable()) {
    EXPECT_EQ(CreateModelRunner(Load(), o).status().code(),
              absl::StatusCode::kInvalidArgument);
  } else {
    EXPECT_EQ(CreateModelRunner(Load(), o).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

TEST(ModelRunnerFactoryTest, PoolFromTheDeviceIsTwoGibOnCpu) {
  RunnerOptions o;
  o.device = "cpu";
  o.kv_pool_from_device = true;  // the services' --kv_budget_bytes 0
  const size_t per_block =
      CpuModelRunner::BytesPerToken(Load()->config) * o.kv_cache.block_size;
  auto r = CreateModelRunner(Load(), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(static_cast<size_t>((*r)->kv_cache().num_blocks()),
            kDefaultCpuKvBudgetBytes / per_block);
}

TEST(ModelRunnerFactoryTest, GpuMemoryUtilizationOutsideUnitIntervalFails) {
  RunnerOptions o;
  o.device = "cpu";
  for (const double u : {0.0, 1.5, -1.0}) {
    o.gpu_memory_utilization = u;
    auto r = CreateModelRunner(Load(), o);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << u;
    EXPECT_NE(r.status().message().find("gpu_memory_utilization"),
              std::string::npos);
  }
}

// On a GPU: the pool the utilization leaves is smaller than the device's
// memory and larger than nothing; skipped without one.
TEST(ModelRunnerFactoryTest, CudaPoolSizedFromUtilization) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device";
  RunnerOptions o;
  o.device = "cuda";
  o.kv_pool_from_device = true;
  o.gpu_memory_utilization = 0.5;
  absl::StatusOr<CudaMemory> mem = QueryCudaMemory();
  ASSERT_TRUE(mem.ok()) << mem.status();
  auto r = CreateModelRunner(Load(), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT((*r)->kv_cache().num_blocks(), 0);
  EXPECT_LT((*r)->kv_cache().bytes_capacity(), mem->total_bytes / 2);
  // RunnerOptions::warm_up (on by default) captured the graph buckets.
  auto* cuda = dynamic_cast<CudaModelRunner*>(r->get());
  ASSERT_NE(cuda, nullptr);
  EXPECT_GT(cuda->graphs_captured(), 0);
}

// vLLM's API-server budgets by device memory, the A100 excepted; the
// device's name may lead a longer description.
TEST(ModelRunnerFactoryTest, CudaDefaultTokenBudgetFollowsVllm) {
  constexpr size_t kGiB = size_t{1} << 30;
  EXPECT_EQ(CudaDefaultMaxNumBatchedTokens(24 * kGiB, "NVIDIA L4"), 2048);
  EXPECT_EQ(CudaDefaultMaxNumBatchedTokens(kLargeGpuBytes - 1, "NVIDIA X"),
            2048);
  EXPECT_EQ(CudaDefaultMaxNumBatchedTokens(kLargeGpuBytes, "NVIDIA X"), 8192);
  // H100 80GB: 79.1 GiB; H200: 143,771 MiB.
  EXPECT_EQ(CudaDefaultMaxNumBatchedTokens(
                size_t{81} * 1000 * 1000 * 1000,
                "NVIDIA H100 80GB HBM3, sm_90, 132 SMs, 79.1 GiB"),
            8192);
  EXPECT_EQ(CudaDefaultMaxNumBatchedTokens(size_t{143771} << 20,
                                           "NVIDIA H200"),
            8192);
  EXPECT_EQ(CudaDefaultMaxNumBatchedTokens(size_t{80} * kGiB,
                                           "NVIDIA A100-SXM4-80GB"),
            2048);
  EXPECT_EQ(CudaDefaultMaxNumBatchedTokens(kLargerGpuBytes - 1, "NVIDIA X"),
            8192);
  EXPECT_EQ(CudaDefaultMaxNumBatchedTokens(size_t{180} * kGiB, "NVIDIA B200"),
            16384);
}

// A budget the user gave is kept; the CPU's default is 512 rows.
TEST(ModelRunnerFactoryTest, DefaultTokenBudgetOnCpu) {
  RunnerOptions o;
  o.device = "cpu";
  auto r = CreateModelRunner(Load(), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(DefaultMaxNumBatchedTokens(**r, 0), 512);
  EXPECT_EQ(DefaultMaxNumBatchedTokens(**r, 96), 96);
}

// On a GPU: the default follows the device, and a larger budget leaves a
// smaller pool (its workspace is reserved for more rows).
TEST(ModelRunnerFactoryTest, CudaTokenBudgetSizesTheWorkspaceReserve) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<CudaMemory> mem = QueryCudaMemory();
  ASSERT_TRUE(mem.ok()) << mem.status();
  RunnerOptions o;
  o.device = "cuda";
  o.kv_pool_from_device = true;
  o.gpu_memory_utilization = 0.5;
  o.warm_up = false;
  int64_t blocks[2];
  for (int i = 0; i < 2; ++i) {
    o.max_num_batched_tokens = i == 0 ? 256 : 16384;
    auto r = CreateModelRunner(Load(), o);
    ASSERT_TRUE(r.ok()) << r.status();
    blocks[i] = (*r)->kv_cache().num_blocks();
    if (i == 0) {
      EXPECT_EQ(DefaultMaxNumBatchedTokens(**r, 0),
                CudaDefaultMaxNumBatchedTokens(mem->total_bytes,
                                               CudaDeviceDescription()));
    }
  }
  EXPECT_GT(blocks[0], blocks[1]);
}

TEST(ModelRunnerFactoryTest, AutoPicksCudaOnlyWithAGpu) {
  RunnerOptions o;  // device "auto"
  auto r = CreateModelRunner(Load(), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->backend(), CudaAvailable() ? "cuda" : "cpu");
}

TEST(ModelRunnerFactoryTest, WeightDTypeOption) {
  RunnerOptions o;
  o.device = "cpu";
  o.weight_dtype = "int4";
  auto bad = CreateModelRunner(Load(), o);
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("int4"), std::string::npos);
  for (auto [name, dtype] : {std::pair{"f32", WeightDType::kF32},
                             {"bf16", WeightDType::kBF16},
                             {"int8", WeightDType::kInt8}}) {
    o.weight_dtype = name;
    auto w = LoadModelWeights("models/stories260K");
    ASSERT_TRUE(w.ok());
    auto r = CreateModelRunner(*std::move(w), o);  // the consuming overload
    ASSERT_TRUE(r.ok()) << r.status();
    auto* cpu = dynamic_cast<CpuModelRunner*>(r->get());
    ASSERT_NE(cpu, nullptr);
    EXPECT_EQ(cpu->weight_dtype(), dtype);
    // The runner keeps no f32 Linear weights of its own.
    EXPECT_TRUE(cpu->weights().layers[0].wqkv.empty());
    EXPECT_TRUE(cpu->weights().embed.empty());
  }
  // auto keeps an F32 checkpoint in f32.
  o.weight_dtype = "auto";
  auto r = CreateModelRunner(Load(), o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(dynamic_cast<CpuModelRunner*>(r->get())->weight_dtype(),
            WeightDType::kF32);
}

// On CUDA the cache is stored in cuda_dtype: auto works, a matching bf16
// is accepted, f32 (or bf16 with fp16 compute) is INVALID_ARGUMENT. On CPU
// bf16 reaches the runner.
TEST(ModelRunnerFactoryTest, KvCacheDTypeOption) {
  RunnerOptions o;
  o.device = "cpu";
  o.kv_cache_dtype = "bf16";
  auto cpu = CreateModelRunner(Load(), o);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(dynamic_cast<CpuModelRunner*>(cpu->get())->kv_cache_dtype(),
            KvCacheDType::kBF16);
  o.kv_cache_dtype = "f16";
  EXPECT_EQ(CreateModelRunner(Load(), o).status().code(),
            absl::StatusCode::kInvalidArgument);
  if (!CudaAvailable()) GTEST_SKIP() << "no GPU: the CUDA half is skipped";
  o.device = "cuda";
  o.kv_cache.pool_bytes = size_t{64} << 20;
  for (const char* ok : {"auto", "bf16"}) {
    o.kv_cache_dtype = ok;
    auto r = CreateModelRunner(Load(), o);
    EXPECT_TRUE(r.ok()) << ok << ": " << r.status();
  }
  o.kv_cache_dtype = "f32";
  EXPECT_EQ(CreateModelRunner(Load(), o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.cuda_dtype = "fp16";
  o.kv_cache_dtype = "bf16";
  EXPECT_EQ(CreateModelRunner(Load(), o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.kv_cache_dtype = "auto";
  EXPECT_TRUE(CreateModelRunner(Load(), o).ok());
}

TEST(ModelRunnerFactoryTest, LoadModelRunnerPacksLayerByLayerToTheSameModel) {
  for (const char* dtype : {"auto", "int8"}) {
    RunnerOptions o;
    o.device = "cpu";
    o.weight_dtype = dtype;
    auto a = CreateModelRunner(Load(), o);
    auto b = LoadModelRunner("models/stories260K", o);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(dynamic_cast<CpuModelRunner*>(b->get())->weight_bytes(),
              dynamic_cast<CpuModelRunner*>(a->get())->weight_bytes());
    const std::vector<int> ids = {1, 403, 407, 261}, pos = {0, 1, 2, 3};
    std::vector<float> logits[2];
    for (int i = 0; i < 2; ++i) {
      ModelRunner& m = i == 0 ? **a : **b;
      auto seq = m.NewSequence(8);
      ASSERT_TRUE(seq.ok());
      ForwardInput in;
      in.token_ids = ids;
      in.position_ids = pos;
      ForwardOutput out;
      ASSERT_TRUE(m.Forward(in, seq->get(), &out).ok());
      logits[i] = out.logits;
    }
    EXPECT_EQ(logits[0], logits[1]) << dtype;  // the same packed bytes
  }
  auto missing = LoadModelRunner("models/no_such_model", RunnerOptions());
  EXPECT_FALSE(missing.ok());
}

}  // namespace
}  // namespace specserve
