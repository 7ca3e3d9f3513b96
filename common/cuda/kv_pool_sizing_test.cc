// KvPoolBytesFromUtilization and ForwardWorkspaceReserveBytes (CPU only).

#include "common/cuda/kv_pool_sizing.h"

#include "gtest/gtest.h"

namespace specserve {
namespace {

constexpr size_t kGiB = size_t{1} << 30;

TEST(KvPoolSizingTest, PoolIsTheFractionLessWeightsAndWorkspace) {
  // An 80 GiB H100 alone: 0.9 x 80 = 72 GiB, less 16 GiB of 8B weights and
  // 2 GiB of workspace.
  GpuMemoryBudget m;
  m.total_bytes = 80 * kGiB;
  m.free_before_bytes = 79 * kGiB;
  m.instance_bytes = 16 * kGiB;
  m.reserve_bytes = 2 * kGiB;
  m.utilization = 0.9;
  absl::StatusOr<size_t> pool = KvPoolBytesFromUtilization(m);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ(*pool, 72 * kGiB - 18 * kGiB);
  m.utilization = 1.0;
  m.free_before_bytes = 80 * kGiB;
  EXPECT_EQ(*KvPoolBytesFromUtilization(m), 62 * kGiB);
}

TEST(KvPoolSizingTest, TwoServicesShareOneGpuByTheirFractions) {
  // The speculator took 0.2 first; the target's 0.7 fits in what is free.
  GpuMemoryBudget target;
  target.total_bytes = 80 * kGiB;
  target.free_before_bytes = 80 * kGiB - 16 * kGiB;  // 0.2 taken
  target.instance_bytes = 16 * kGiB;
  target.reserve_bytes = 2 * kGiB;
  target.utilization = 0.7;
  absl::StatusOr<size_t> pool = KvPoolBytesFromUtilization(target);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ(*pool, static_cast<size_t>(0.7 * 80 * kGiB) - 18 * kGiB);
  // The default 0.9 for both does not fit: refused with the flags named.
  target.utilization = 0.9;
  absl::StatusOr<size_t> refused = KvPoolBytesFromUtilization(target);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("--gpu_memory_utilization"),
            std::string::npos);
  EXPECT_NE(refused.status().message().find("--kv_budget_bytes"),
            std::string::npos);
}

TEST(KvPoolSizingTest, NothingLeftForThePool) {
  GpuMemoryBudget m;
  m.total_bytes = 24 * kGiB;
  m.free_before_bytes = 24 * kGiB;
  m.instance_bytes = 16 * kGiB;
  m.reserve_bytes = 6 * kGiB;
  m.utilization = 0.9;  // 21.6 GiB < 22 GiB
  EXPECT_EQ(KvPoolBytesFromUtilization(m).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(KvPoolSizingTest, RejectsBadUtilization) {
  GpuMemoryBudget m;
  m.total_bytes = m.free_before_bytes = 8 * kGiB;
  for (const double u : {0.0, -0.5, 1.01}) {
    m.utilization = u;
    EXPECT_EQ(KvPoolBytesFromUtilization(m).status().code(),
              absl::StatusCode::kInvalidArgument)
        << u;
  }
  m.utilization = 0.5;
  m.total_bytes = 0;
  EXPECT_EQ(KvPoolBytesFromUtilization(m).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(KvPoolSizingTest, WorkspaceReserveCoversTheForwardRegions) {
  ModelConfig c;  // Llama-3.1-8B
  c.hidden_size = 4096;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  c.intermediate_size = 14336;
  c.vocab_size = 128256;
  const size_t one = ForwardWorkspaceReserveBytes(c, 1, 2);
  const size_t rows = ForwardWorkspaceReserveBytes(c, 2048, 2);
  EXPECT_GE(one, size_t{256} << 20);
  // Per row at least the fp32 logits and the MLP activations.
  const size_t per_row_min = 4 * 128256 + 3 * 2 * 14336;
  EXPECT_GE(rows - one, 2047 * per_row_min);
  // 2048 rows of the 8B model: ~1.3 GiB, well under the 80 GiB GPU.
  EXPECT_LT(rows, 2 * kGiB);
}

}  // namespace
}  // namespace specserve
