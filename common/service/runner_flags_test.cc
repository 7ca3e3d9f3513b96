#include "common/service/runner_flags.h"

#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "gtest/gtest.h"

ABSL_DECLARE_FLAG(std::string, kv_cache_dtype);
ABSL_DECLARE_FLAG(std::string, weight_dtype);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(bool, cuda_graphs);
ABSL_DECLARE_FLAG(bool, warm_up);
ABSL_DECLARE_FLAG(std::string, prefill_attention);

namespace specserve {
namespace {

class RunnerFlagsTest : public ::testing::Test {
 protected:
  absl::FlagSaver saver_;  // restores every flag after each test
};

TEST_F(RunnerFlagsTest, DefaultsKeepTodaysCpuCache) {
  const RunnerOptions o = RunnerOptionsFromFlags();
  EXPECT_EQ(o.kv_cache_dtype, "auto");
  EXPECT_EQ(o.weight_dtype, "auto");
  // CUDA graphs on, the WMMA prefill kernel until FlashMma is measured.
  EXPECT_TRUE(o.cuda_graphs);
  EXPECT_EQ(o.prefill_attention, "auto");
  EXPECT_TRUE(o.warm_up);
}

// The CUDA-only flags reach the options; a bad --prefill_attention fails
// the runner's creation on any device, naming the flag's field.
TEST_F(RunnerFlagsTest, CudaGraphsAndPrefillAttentionReachTheOptions) {
  absl::SetFlag(&FLAGS_cuda_graphs, false);
  absl::SetFlag(&FLAGS_warm_up, false);
  absl::SetFlag(&FLAGS_prefill_attention, "mma");
  RunnerOptions o = RunnerOptionsFromFlags();
  EXPECT_FALSE(o.cuda_graphs);
  EXPECT_FALSE(o.warm_up);
  EXPECT_EQ(o.prefill_attention, "mma");
  absl::SetFlag(&FLAGS_prefill_attention, "cudnn");
  EXPECT_EQ(RunnerOptionsFromFlags().prefill_attention, "cudnn");
  absl::SetFlag(&FLAGS_device, "cpu");
  o = RunnerOptionsFromFlags();
  o.kv_cache.pool_bytes = size_t{1} << 20;
  EXPECT_TRUE(LoadModelRunner("models/stories260K", o).ok());
  absl::SetFlag(&FLAGS_prefill_attention, "flash3");
  o = RunnerOptionsFromFlags();
  o.kv_cache.pool_bytes = size_t{1} << 20;
  const absl::Status bad = LoadModelRunner("models/stories260K", o).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("prefill_attention"), std::string::npos);
}

// --kv_cache_dtype reaches the CPU runner: auto and f32 keep an f32 cache,
// bf16 halves the bytes per token (twice the tokens in the same budget);
// anything else is INVALID_ARGUMENT naming the value.
TEST_F(RunnerFlagsTest, KvCacheDTypeReachesTheCpuRunner) {
  absl::SetFlag(&FLAGS_device, "cpu");
  int blocks[2] = {0, 0};
  for (const char* value : {"auto", "f32", "bf16", "BF16"}) {
    SCOPED_TRACE(value);
    absl::SetFlag(&FLAGS_kv_cache_dtype, value);
    RunnerOptions o = RunnerOptionsFromFlags();
    EXPECT_EQ(o.kv_cache_dtype, value);
    o.kv_cache.pool_bytes = size_t{1} << 20;
    auto r = LoadModelRunner("models/stories260K", o);
    ASSERT_TRUE(r.ok()) << r.status();
    auto* cpu = dynamic_cast<CpuModelRunner*>(r->get());
    ASSERT_NE(cpu, nullptr);
    const bool bf16 = std::string(value) == "bf16" ||
                      std::string(value) == "BF16";
    EXPECT_EQ(cpu->kv_cache_dtype(),
              bf16 ? KvCacheDType::kBF16 : KvCacheDType::kF32);
    EXPECT_EQ(cpu->kv_cache().bytes_per_block(),
              CpuModelRunner::BytesPerToken(cpu->config(),
                                            cpu->kv_cache_dtype()) *
                  cpu->kv_cache().block_size());
    blocks[bf16] = cpu->kv_cache().num_blocks();
  }
  // floor(budget / half a block) is 2 * floor(budget / block) or one more.
  EXPECT_GE(blocks[1], 2 * blocks[0]);
  EXPECT_LE(blocks[1], 2 * blocks[0] + 1);
  absl::SetFlag(&FLAGS_kv_cache_dtype, "int8");
  auto bad = LoadModelRunner("models/stories260K", RunnerOptionsFromFlags());
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("int8"), std::string::npos);
}

}  // namespace
}  // namespace specserve
