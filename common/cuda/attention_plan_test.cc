// Tests of PlanBatchedAttention (CPU only): every (sequence, query tile,
// split, kv head) is covered exactly once, the splits cover each context,
// partial offsets do not overlap, and the split counts follow the rule of
// attention_plan.h.

#include "common/cuda/attention_plan.h"

#include <random>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace specserve {
namespace cuda_kernels {
namespace {

const int* Info(const BatchedAttentionPlan& p, int i) {
  return p.seq_info.data() + static_cast<size_t>(i) * kSeqInfoFields;
}

// Checks the invariants every plan must hold for `seqs`.
void CheckPlan(const std::vector<AttentionSequence>& seqs, int H, int KV,
               const BatchedAttentionPlan& p) {
  const int group = H / KV;
  ASSERT_EQ(p.num_seqs, static_cast<int>(seqs.size()));
  ASSERT_EQ(p.seq_info.size(), seqs.size() * kSeqInfoFields);
  int row = 0;
  int64_t partial = 0;
  std::set<std::tuple<int, int, int>> seen;
  for (int w = 0; w < p.num_work(); ++w) {
    const int s = p.work[3 * w], t = p.work[3 * w + 1], sp = p.work[3 * w + 2];
    ASSERT_GE(s, 0);
    ASSERT_LT(s, p.num_seqs);
    EXPECT_LT(sp, Info(p, s)[kSeqSplits]);
    EXPECT_LT(t * kBatchedAttentionQueryTile, seqs[s].rows * group);
    EXPECT_TRUE(seen.insert({s, t, sp}).second) << "duplicate work " << w;
  }
  size_t expected_work = 0;
  std::vector<int> combined;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int* info = Info(p, static_cast<int>(i));
    EXPECT_EQ(info[kSeqRowStart], row);
    EXPECT_EQ(info[kSeqRows], seqs[i].rows);
    EXPECT_EQ(info[kSeqFirst], seqs[i].first);
    EXPECT_EQ(info[kSeqTableStart], seqs[i].table_start);
    const int splits = info[kSeqSplits];
    EXPECT_GE(splits, 1);
    EXPECT_LE(splits, kBatchedAttentionMaxSplits);
    const int keys = seqs[i].first + seqs[i].rows;
    // The splits cover [0, keys) and none is empty.
    EXPECT_GE(int64_t{info[kSeqKeysPerSplit]} * splits, keys);
    if (seqs[i].rows > 0) {
      EXPECT_LT(int64_t{info[kSeqKeysPerSplit]} * (splits - 1), keys);
    }
    if (splits > 1) {
      EXPECT_EQ(info[kSeqPartialStart], partial);
      partial += int64_t{splits} * seqs[i].rows * H;
      for (int r = 0; r < seqs[i].rows; ++r) combined.push_back(row + r);
    } else {
      EXPECT_EQ(info[kSeqPartialStart], -1);
    }
    const int tiles = (seqs[i].rows * group + kBatchedAttentionQueryTile - 1) /
                      kBatchedAttentionQueryTile;
    expected_work += static_cast<size_t>(tiles) * splits;
    row += seqs[i].rows;
  }
  EXPECT_EQ(p.total_rows, row);
  EXPECT_EQ(p.partial_triples, partial);
  EXPECT_EQ(static_cast<size_t>(p.num_work()), expected_work);
  ASSERT_EQ(static_cast<size_t>(p.num_combine()), combined.size());
  for (int c = 0; c < p.num_combine(); ++c) {
    EXPECT_EQ(p.combine[2 * c], combined[c]);
    const int s = p.combine[2 * c + 1];
    EXPECT_GE(p.combine[2 * c], Info(p, s)[kSeqRowStart]);
    EXPECT_LT(p.combine[2 * c], Info(p, s)[kSeqRowStart] + seqs[s].rows);
  }
}

TEST(AttentionPlanTest, OneDecodeRowOverALongContextSplits) {
  // Llama-3.1-8B shape: 32 query heads over 8 kv heads; 132 SMs (H100).
  const std::vector<AttentionSequence> seqs = {{1, 32767, 0}};
  absl::StatusOr<BatchedAttentionPlan> p =
      PlanBatchedAttention(seqs, 32, 8, 132);
  ASSERT_TRUE(p.ok()) << p.status();
  CheckPlan(seqs, 32, 8, *p);
  // 1 tile x 8 kv heads = 8 blocks < 2 x 132: the 8 x 32768 keys of work
  // cut for ~4 x 132 = 528 blocks gives chunks of 497 -> 512 keys: 64
  // splits.
  EXPECT_EQ(Info(*p, 0)[kSeqSplits], 64);
  EXPECT_EQ(Info(*p, 0)[kSeqKeysPerSplit], 512);
  EXPECT_EQ(p->num_work(), 64);
  EXPECT_EQ(p->num_combine(), 1);
  EXPECT_EQ(p->partial_triples, 64 * 32);
}

TEST(AttentionPlanTest, LongerContextsGetMoreSplits) {
  const std::vector<AttentionSequence> seqs = {
      {1, 31, 0}, {1, 4095, 2}, {1, 16383, 66}, {4, 800, 400}};
  absl::StatusOr<BatchedAttentionPlan> p =
      PlanBatchedAttention(seqs, 32, 8, 132);
  ASSERT_TRUE(p.ok()) << p.status();
  CheckPlan(seqs, 32, 8, *p);
  EXPECT_EQ(Info(*p, 0)[kSeqSplits], 1);  // 32 keys: below one chunk
  EXPECT_LT(Info(*p, 1)[kSeqSplits], Info(*p, 2)[kSeqSplits]);
  EXPECT_GT(Info(*p, 2)[kSeqSplits], 1);
  // Chunks of equal size: a split never holds more than the chunk (a
  // multiple of 32 and >= 64).
  const int chunk = Info(*p, 2)[kSeqKeysPerSplit];
  EXPECT_GE(chunk, kBatchedAttentionMinSplitKeys);
  for (int i = 0; i < 4; ++i) {
    if (Info(*p, i)[kSeqSplits] > 1) {
      EXPECT_LE(Info(*p, i)[kSeqKeysPerSplit], (chunk + 31) / 32 * 32);
    }
  }
}

TEST(AttentionPlanTest, ABatchThatFillsTheGpuDoesNotSplit) {
  // 64 decode rows x 1 tile x 8 kv heads = 512 blocks >= 2 x 132.
  std::vector<AttentionSequence> seqs;
  for (int i = 0; i < 64; ++i) seqs.push_back({1, 1000 + 300 * i, 10 * i});
  absl::StatusOr<BatchedAttentionPlan> p =
      PlanBatchedAttention(seqs, 32, 8, 132);
  ASSERT_TRUE(p.ok()) << p.status();
  CheckPlan(seqs, 32, 8, *p);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(Info(*p, i)[kSeqSplits], 1);
  EXPECT_EQ(p->num_work(), 64);
  EXPECT_EQ(p->num_combine(), 0);
  EXPECT_EQ(p->partial_triples, 0);
  EXPECT_EQ(BatchedAttentionWorkspaceBytes(*p, 128), 0u);
}

TEST(AttentionPlanTest, MixedDecodeVerifyAndPrefillChunk) {
  // A decode row, a verify round (k = 4), a 100-row prefill chunk, an idle
  // sequence; head_dim 64 shape (Llama-3.2-1B: 32 over 8 heads) on 8 SMs.
  const std::vector<AttentionSequence> seqs = {
      {1, 700, 0}, {5, 90, 3}, {100, 37, 5}, {0, 12, 9}};
  absl::StatusOr<BatchedAttentionPlan> p = PlanBatchedAttention(seqs, 32, 8, 8);
  ASSERT_TRUE(p.ok()) << p.status();
  CheckPlan(seqs, 32, 8, *p);
  EXPECT_EQ(p->total_rows, 106);
  // Tiles: 1x4 heads -> 1, 5x4 -> 2, 100x4 -> 25: 28 x 8 = 224 >= 16.
  EXPECT_EQ(p->num_work(), 28);
  EXPECT_EQ(Info(*p, 3)[kSeqRowStart], 106);
  EXPECT_EQ(BatchedAttentionWorkspaceBytes(*p, 64), 0u);
}

TEST(AttentionPlanTest, WorkspaceHoldsEveryPartial) {
  const std::vector<AttentionSequence> seqs = {{2, 5000, 0}, {1, 100, 1}};
  absl::StatusOr<BatchedAttentionPlan> p = PlanBatchedAttention(seqs, 8, 2, 16);
  ASSERT_TRUE(p.ok()) << p.status();
  CheckPlan(seqs, 8, 2, *p);
  ASSERT_GT(p->partial_triples, 0);
  EXPECT_EQ(BatchedAttentionWorkspaceBytes(*p, 128),
            sizeof(float) * p->partial_triples * 130);
}

TEST(AttentionPlanTest, ExplicitRowStartsSkipRowsAttendedElsewhere) {
  // Rows [0, 100) are a prefill chunk that FlashAttention handles; the plan
  // covers the decode rows 100 and 101 and a verify round at 102..106.
  AttentionSequence a{1, 500, 7, 100}, b{1, 20, 9}, c{5, 60, 11, 102};
  absl::StatusOr<BatchedAttentionPlan> p =
      PlanBatchedAttention({a, b, c}, 8, 2, 4);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(Info(*p, 0)[kSeqRowStart], 100);
  EXPECT_EQ(Info(*p, 1)[kSeqRowStart], 101);  // right after the previous
  EXPECT_EQ(Info(*p, 2)[kSeqRowStart], 102);
  EXPECT_EQ(p->total_rows, 107);
  for (int c = 0; c < p->num_combine(); ++c) {
    const int s = p->combine[2 * c + 1];
    EXPECT_GE(p->combine[2 * c], Info(*p, s)[kSeqRowStart]);
    EXPECT_LT(p->combine[2 * c],
              Info(*p, s)[kSeqRowStart] + Info(*p, s)[kSeqRows]);
  }
  EXPECT_EQ(PlanBatchedAttention({{1, 0, 0, -2}}, 4, 4, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A CUDA graph sizes its launch from BatchedAttentionCapacityFor: no plan
// of a batch within the bounds may exceed it, whatever the contexts.
TEST(AttentionPlanTest, CapacityBoundsEveryPlan) {
  std::mt19937 gen(3);
  for (const auto [H, KV] : {std::pair{32, 8}, std::pair{16, 8},
                             std::pair{8, 8}, std::pair{28, 4}}) {
    for (int sms : {1, 16, 132}) {
      for (int max_rows : {1, 2, 8, 40, 128}) {
        const BatchedAttentionCapacity cap =
            BatchedAttentionCapacityFor(max_rows, max_rows, H, KV, sms);
        for (int trial = 0; trial < 60; ++trial) {
          std::vector<AttentionSequence> seqs;
          int rows = 0, table = 0;
          while (rows < max_rows) {
            const int n = std::min<int>(max_rows - rows,
                                        trial % 3 == 0 ? 1 + gen() % 9 : 1);
            const int ctx = trial % 2 == 0 ? gen() % 64 : gen() % 40000;
            seqs.push_back({n, ctx, table});
            table += (ctx + n + 15) / 16;
            rows += n;
            if (gen() % 5 == 0) break;  // batches below the bucket too
          }
          absl::StatusOr<BatchedAttentionPlan> p =
              PlanBatchedAttention(seqs, H, KV, sms);
          ASSERT_TRUE(p.ok()) << p.status();
          EXPECT_LE(p->num_work(), cap.num_work)
              << H << "/" << KV << " sms " << sms << " rows " << max_rows;
          EXPECT_LE(p->num_combine(), cap.num_combine);
          EXPECT_LE(p->partial_triples, cap.partial_triples)
              << H << "/" << KV << " sms " << sms << " rows " << max_rows;
        }
      }
    }
  }
  EXPECT_EQ(BatchedAttentionCapacityFor(0, 1, 32, 8, 132).num_work, 0);
}

TEST(AttentionPlanTest, EmptyBatch) {
  absl::StatusOr<BatchedAttentionPlan> p = PlanBatchedAttention({}, 4, 4, 132);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->num_work(), 0);
  EXPECT_EQ(p->total_rows, 0);
}

TEST(AttentionPlanTest, RejectsBadShapes) {
  EXPECT_EQ(PlanBatchedAttention({{1, 0, 0}}, 6, 4, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanBatchedAttention({{1, 0, 0}}, 0, 0, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanBatchedAttention({{-1, 0, 0}}, 4, 4, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanBatchedAttention({{1, -2, 0}}, 4, 4, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanBatchedAttention({{1, 0, -1}}, 4, 4, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cuda_kernels
}  // namespace specserve
